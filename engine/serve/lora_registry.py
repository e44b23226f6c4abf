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

`AdapterRoots` is the other way to name an adapter: a request's own `lora_adapter` (files and digest, given by a
trusted caller such as the platform), accepted only from the folders and s3:// prefixes the operator allowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from loraplex.engine.lora import AdapterError, adapter_digest, parse_adapter
from loraplex.engine.lora.manager import AdapterState
from loraplex.engine.lora.ref import S3_SCHEME, AdapterRef, LoRARequest
from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.lora_spec import MAX_ADAPTER_NAME_CHARS

logger = logging.getLogger(__name__)

MAX_NAME_CHARS: Final = MAX_ADAPTER_NAME_CHARS
LORA_ADAPTER_PARAM: Final = "lora_adapter"
_BUCKET: Final = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's rules (so never `.` or `..`)


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


class AdapterRoots:
    """Where a request's `lora_adapter` may be read from: the folders and s3:// prefixes the operator named
    (--adapter-root). Only a trusted caller (the platform) should be able to put adapters there; with no roots the
    field is refused, so a client of a bare engine can never make it read a path of its choosing.

    `s3://bucket/tenants` (with or without the trailing slash) admits `s3://bucket/tenants/...` and never
    `s3://bucket/tenants-x/...`; `s3://bucket` admits the whole bucket. A folder root admits the folders inside it,
    compared after symlinks are resolved on both sides (a link inside a root that leads out of it is outside), and
    the resolved folder is what the engine reads. Sources with `.`, `..` or empty segments are refused outright.
    Immutable once made.
    """

    def __init__(self, roots: Iterable[str] = ()) -> None:
        """Raises ValueError for a root that is neither an absolute folder nor s3://bucket[/prefix]."""
        self._s3: list[tuple[str, str]] = []  # (bucket, key prefix: "" for the whole bucket, else ending in "/")
        self._folders: list[str] = []  # real paths
        for root in roots:
            if root.startswith(S3_SCHEME):
                try:
                    bucket, key = _split_s3(root)
                except ValueError as exc:
                    raise ValueError(f"adapter root {root!r}: {exc}") from None
                self._s3.append((bucket, f"{key}/" if key else ""))
            elif os.path.isabs(root) and _clean_path(root):
                self._folders.append(os.path.realpath(root))
            else:
                raise ValueError(
                    f"adapter root {root!r} must be an absolute folder (without . or .. parts) or s3://bucket[/prefix]"
                )

    @property
    def is_empty(self) -> bool:
        return not self._s3 and not self._folders

    def check(self, source: str) -> str:
        """The source the engine should read for a request's `lora_adapter.source` (a folder's resolved path, an
        s3:// URI as given less a trailing slash). Raises a 403 ApiError when no roots are configured, and a 400
        one for a source outside every root or not in a form that can be compared with them.

        Resolves symlinks, so it touches the file system (a few stats) on the caller's thread.
        """
        if self.is_empty:
            raise ApiError(
                403,
                "This server does not accept `lora_adapter`: no adapter roots are configured (start it with "
                "--adapter-root). Name an adapter loaded on the server in `model` instead.",
                code="lora_adapter_not_allowed",
                param=LORA_ADAPTER_PARAM,
            )
        if source.startswith(S3_SCHEME):
            try:
                bucket, key = _split_s3(source)
            except ValueError as exc:
                raise _outside(f"lora_adapter.source {source!r} is not a valid s3:// URI: {exc}") from None
            if any(bucket == root_bucket and f"{key}/".startswith(prefix) for root_bucket, prefix in self._s3):
                return f"{S3_SCHEME}{bucket}/{key}" if key else f"{S3_SCHEME}{bucket}"
        elif os.path.isabs(source) and _clean_path(source):
            real = os.path.realpath(source)
            if any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self._folders):
                return real
        else:
            raise _outside(
                f"lora_adapter.source {source!r} must be an absolute folder without . or .. parts, or an s3:// URI"
            )
        raise _outside(f"lora_adapter.source {source!r} is not under any of this server's adapter roots")


def _outside(message: str) -> ApiError:
    return ApiError(400, message, code="lora_adapter_source_not_allowed", param=LORA_ADAPTER_PARAM)


def _clean_path(path: str) -> bool:
    """No `.` or `..` parts (so what is compared is what was meant); the empty parts of `//` are harmless."""
    return not any(part in (".", "..") for part in path.split(os.sep))


def _split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without a trailing slash) of s3://bucket[/prefix]; ValueError if either is malformed."""
    bucket, _, key = uri.removeprefix(S3_SCHEME).partition("/")
    key = key.rstrip("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not a bucket name")
    # S3 keys are literal strings, but some servers and proxies normalize `.`, `..` and `//` in URL paths.
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError("its key has an empty, . or .. part")
    return bucket, key


__all__ = ["AdapterRoots", "LoraModuleError", "LoraRegistry", "RegisteredAdapter"]
