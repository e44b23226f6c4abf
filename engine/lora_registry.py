"""The engine server's adapter names: which `model` name runs which adapter, as vLLM's `--lora-modules` and
`/v1/load_lora_adapter` set them.

Names are the server's; the engine knows an adapter only by its `AdapterRef`, whose content digest is its identity.
Loading a name reads the adapter's two files once, off the event loop, validates them against the base model as
the engine's loader will (so a broken adapter is refused now, not at its first request), and hashes those same
bytes. Loading a name again with new content re-points it: requests that start after that run the new digest and
never the old weights, while requests already running finish with the weights they started with. When no name
refers to a digest any more, the engine is asked to drop its weights (at once if idle, else when its last request
ends).

Lives on the event loop (no thread touches it). Loads and unloads of one name apply in the order they arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.engine.adapter_manager import AdapterState
from loraplex.engine.adapter_ref import S3_SCHEME, AdapterRef, LoRARequest
from loraplex.engine.api_errors import ApiError
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.lora import AdapterError, adapter_digest, parse_adapter

logger = logging.getLogger(__name__)

MAX_NAME_CHARS: Final = 256


@dataclass(frozen=True, slots=True)
class RegisteredAdapter:
    ref: AdapterRef
    created: int  # unix time the name was (last) pointed at this content


@dataclass(slots=True)
class _NameLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0


class LoraModuleError(ValueError):
    """An adapter named at start-up cannot be served; the message names it and says why."""


class LoraRegistry:
    def __init__(self, engine: AsyncEngine, base_model_name: str) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self._adapters: dict[str, RegisteredAdapter] = {}
        self._locks: dict[str, _NameLock] = {}

    # --- lookups -------------------------------------------------------------------------------------------------

    def get(self, name: str) -> AdapterRef | None:
        registered = self._adapters.get(name)
        return registered.ref if registered is not None else None

    def adapters(self) -> list[RegisteredAdapter]:
        """Every registered name, sorted by name."""
        return [self._adapters[name] for name in sorted(self._adapters)]

    def report(self) -> dict[str, dict[str, str]]:
        """Each name's digest and state (resident, loaded, loading, absent or failed), for /v1/state."""
        states = self.engine.adapter_states()
        report: dict[str, dict[str, str]] = {}
        for registered in self.adapters():
            state = states.get(registered.ref.digest, AdapterState.ABSENT)
            report[registered.ref.name] = {
                "digest": registered.ref.digest,
                "source": registered.ref.source,
                "state": state.value,
            }
        return report

    # --- changes -------------------------------------------------------------------------------------------------

    async def load(self, name: str, path: str) -> AdapterRef:
        """Validate the adapter at `path` and point `name` at it (a 400 ApiError names what is wrong)."""
        self._check_name(name)
        if not path:
            raise ApiError(400, "lora_path must not be empty", code="invalid_value", param="lora_path")
        async with self._locked(name):
            try:
                ref = await asyncio.to_thread(self._read_and_validate, name, path)
            except AdapterError as exc:
                raise ApiError(400, str(exc), code="invalid_lora_adapter", param="lora_path") from exc
            except OSError as exc:
                message = f"could not read the adapter at {path}: {exc.strerror or exc}"
                raise ApiError(400, message, code="invalid_lora_adapter", param="lora_path") from exc
            previous = self._adapters.get(name)
            self._adapters[name] = RegisteredAdapter(ref, int(time.time()))
            if previous is not None and previous.ref.digest != ref.digest:
                logger.info("LoRA adapter %s re-pointed from %s to %s", name, previous.ref.digest, ref.digest)
                await self._release(previous.ref.digest)
            else:
                logger.info("LoRA adapter %s loaded from %s (%s)", name, ref.source, ref.digest)
        return ref

    async def unload(self, name: str) -> AdapterRef:
        """Forget `name` (a 404 ApiError if it is not registered); its weights leave once nothing uses them."""
        async with self._locked(name):
            registered = self._adapters.pop(name, None)
            if registered is None:
                raise ApiError(
                    404, f"The LoRA adapter `{name}` is not loaded.", code="lora_adapter_not_found", param="lora_name"
                )
            logger.info("LoRA adapter %s unloaded", name)
            await self._release(registered.ref.digest)
        return registered.ref

    async def load_all(self, loras: Sequence[LoRARequest]) -> None:
        """Register the adapters named at start-up, in order; the first bad one raises LoraModuleError."""
        seen: set[str] = set()
        for lora in loras:
            if lora.name in seen:
                raise LoraModuleError(f"LoRA adapter {lora.name!r} is named twice")
            seen.add(lora.name)
            try:
                await self.load(lora.name, str(lora.path))
            except ApiError as exc:
                raise LoraModuleError(f"LoRA adapter {lora.name!r} ({lora.path}): {exc.message}") from None

    def _check_name(self, name: str) -> None:
        problem = None
        if not name:
            problem = "lora_name must not be empty"
        elif len(name) > MAX_NAME_CHARS or not name.isprintable() or name != name.strip():
            problem = f"lora_name must be at most {MAX_NAME_CHARS} printable characters, without surrounding spaces"
        elif name == self.base_model_name:
            problem = f"lora_name `{name}` is the base model's name; choose another"
        if problem is not None:
            raise ApiError(400, problem, code="invalid_value", param="lora_name")

    async def _release(self, digest: str) -> None:
        """No name may run `digest` any more: have the engine drop its weights unless another name shares them."""
        if any(r.ref.digest == digest for r in self._adapters.values()):
            return
        if not await self.engine.unload_adapter(digest):
            logger.info("adapter %s leaves memory once its running requests finish", digest)

    @contextlib.asynccontextmanager
    async def _locked(self, name: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(name, _NameLock())
        entry.num_users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.num_users -= 1
            if entry.num_users == 0:
                del self._locks[name]

    # --- worker thread -------------------------------------------------------------------------------------------

    def _read_and_validate(self, name: str, path: str) -> AdapterRef:
        """Read the files once; validate them as the engine's loader will; hash the very bytes validated."""
        # Absolute, so the engine's loader finds the folder whatever the working directory is by then.
        source = path if path.startswith(S3_SCHEME) else str(Path(path).absolute())
        core = self.engine.core
        max_bytes = core.adapters.config.max_adapter_bytes
        config_bytes, weights_bytes = core.adapters.read_files(source)
        parse_adapter(
            config_bytes,
            weights_bytes,
            core.model_config,
            max_rank=core.config.max_lora_rank,
            dtype=core.dtype,
            max_bytes=max_bytes,
        )
        return core.adapters.resolve(name, source, digest=adapter_digest(config_bytes, weights_bytes))


class LoraMetrics:
    """Per-adapter series, added to the server's own Prometheus registry."""

    def __init__(self, registry: CollectorRegistry, loras: LoraRegistry) -> None:
        self.requests = Counter(
            "loraplex_engine_lora_requests",
            "Finished requests that ran with an adapter, by adapter name and finish reason.",
            ["lora_name", "finish_reason"],
            registry=registry,
        )
        registry.register(_LoraCollector(loras))

    def record(self, lora_name: str, finish_reason: str) -> None:
        self.requests.labels(lora_name, finish_reason).inc()


class _LoraCollector(Collector):
    def __init__(self, loras: LoraRegistry) -> None:
        self._loras = loras

    def collect(self) -> Iterable[Metric]:
        states = self._loras.engine.adapter_states()
        num_resident = sum(1 for state in states.values() if state is AdapterState.RESIDENT)
        yield GaugeMetricFamily(
            "loraplex_engine_lora_adapters_resident", "Adapters whose weights are in pool pages.", num_resident
        )
        yield GaugeMetricFamily(
            "loraplex_engine_lora_adapters_registered",
            "Adapter names the server answers to.",
            len(self._loras.adapters()),
        )


__all__ = ["LoraMetrics", "LoraModuleError", "LoraRegistry", "RegisteredAdapter"]
