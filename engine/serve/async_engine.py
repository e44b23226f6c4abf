"""AsyncEngine: the engine behind an event loop. One thread owns the EngineCore and runs steps while any request
is unfinished; callers on the loop add requests, receive incremental outputs, and abort.

A request's validation errors are raised by `generate` before its first output, so a server can still answer
with a 400; a consumer that stops iterating (a disconnected client) aborts its request and frees its pages. A
request the engine finishes with an error (its adapter could not be loaded) raises `RequestFailed`, which keeps
the loader's exception so a server can tell the client's fault (an AdapterError) from its own.

Adapters leave memory through `unload_adapter`, which the engine thread runs between steps: at once when no
request uses the adapter, otherwise as soon as the last one finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import CheckedPrompt, EngineCore, EngineState
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.errors import EngineError
from loraplex.engine.lora import AdapterError
from loraplex.engine.lora.manager import AdapterEntry, AdapterState
from loraplex.engine.lora.ref import AdapterRef, LoRARequest

logger = logging.getLogger(__name__)


class EngineDeadError(EngineError):
    """The engine thread failed; no request can be served until the process restarts."""


class RequestFailed(EngineError):
    """The engine finished a request with an error (its adapter could not be loaded); `cause` is the loader's
    exception when known."""

    def __init__(self, message: str, *, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def is_client_error(self) -> bool:
        """The adapter's fault (its files, its size for this pool), not the server's."""
        return isinstance(self.cause, AdapterError)


@dataclass(slots=True)
class _Add:
    request_id: str
    checked: CheckedPrompt
    prompt: str | None
    sink: _Sink
    lora: AdapterRef | None
    cache_salt: str | None = None
    prefill_after: str | None = None
    fairness_key: str = ""
    fairness_weight: float = 1.0
    priority: int = 0


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Unload:
    digest: str
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[bool]  # answered on `loop`

    def answer(self, result: bool | BaseException) -> None:
        def set_result() -> None:
            if self.done.done():  # the caller was cancelled
                return
            if isinstance(result, BaseException):
                self.done.set_exception(result)
            else:
                self.done.set_result(result)

        self.loop.call_soon_threadsafe(set_result)


class _Sink:
    """Carries one request's outputs from the engine thread to its consumer on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.adapter: AdapterEntry | None = None  # the engine thread's, to explain a failed load

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | _Unload | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._state = core.state()
        self._adapter_states: dict[str, AdapterState] = {}
        self._unload_later: set[str] = set()  # digests to drop once no request uses them (engine thread's)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model off the event loop, then start the engine thread."""
        core = await asyncio.to_thread(EngineCore, config)
        return cls(core)

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def state(self) -> EngineState:
        """A snapshot taken by the engine thread after its latest step."""
        return self._state

    def adapter_states(self) -> Mapping[str, AdapterState]:
        """Each adapter the engine knows, by digest: a snapshot taken with `state()`'s."""
        return self._adapter_states

    async def generate(
        self,
        prompt: str | list[int] | CheckedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        add_special_tokens: bool = True,
        lora: AdapterRef | None = None,
        cache_salt: str | None = None,
        prefill_after: str | None = None,
        fairness_key: str = "",
        fairness_weight: float = 1.0,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every step that changes it; the last one has `finished` set.
        `prefill_after`: the id of another choice of the same prompt, which this one waits for (see
        `EngineCore.add_request`); `fairness_key`, `fairness_weight` and `priority`: see `EngineCore.add_request`.

        Raises RequestError for an invalid request (before anything is yielded), RequestFailed if the engine
        finishes it with an error (its adapter could not be loaded), and EngineDeadError if the engine fails while
        the request runs. A prompt the caller checked already (`core.check_request`) comes as the CheckedPrompt,
        without `sampling_params`, and is not checked again.
        """
        if self._error is not None:
            raise EngineDeadError("the engine has failed; restart it") from self._error
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            prompt = self.core.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        checked = self.core.checked(prompt, sampling_params)
        sink = _Sink(asyncio.get_running_loop())
        self._commands.put(
            _Add(
                request_id,
                checked,
                text,
                sink,
                lora,
                cache_salt,
                prefill_after,
                fairness_key,
                fairness_weight,
                priority,
            )
        )
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, RequestFailed):
                    finished = True  # the engine has already let go of it
                    raise item
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))
                self._wakeup.set()

    async def resolve_lora(self, lora: LoRARequest) -> AdapterRef:
        """Hash an adapter's files off the event loop; the ref names it in `generate`."""
        return await asyncio.to_thread(self.core.resolve_lora, lora)

    async def unload_adapter(self, digest: str) -> bool:
        """Drop an adapter's weights from the pool and host memory. True if they left now; False if requests still
        use it (they leave as soon as the last one finishes) or the engine never loaded it."""
        loop = asyncio.get_running_loop()
        command = _Unload(digest, loop, loop.create_future())
        self._commands.put(command)
        self._wakeup.set()
        # Checked after the put: a thread that fails from here on fails the queued command too.
        if self._error is not None:
            raise EngineDeadError("the engine has failed; restart it") from self._error
        return await command.done

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    async def shutdown(self) -> None:
        self._commands.put(None)
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 30)

    # --- the engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_commands():
                    return
                if self._unload_later:
                    self._unload_idle_adapters()
                if not self.core.has_unfinished_requests():
                    self._snapshot()
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                for output in self.core.step():
                    self._deliver(output)
                self._snapshot()
        except BaseException as exc:
            logger.exception("the engine thread failed")
            self._error = exc
            dead = EngineDeadError(f"the engine failed: {exc}")
            for sink in self._sinks.values():
                sink.put(dead)
            self._sinks.clear()
            self._fail_queued_unloads(dead)

    def _snapshot(self) -> None:
        self._state = self.core.state()
        self._adapter_states = {digest: entry.state for digest, entry in self.core.adapters.entries.items()}

    def _adapter_in_use(self, digest: str) -> bool:
        # Waiting requests count too: they hold the adapter's entry, which must outlive them.
        return any(r.adapter is not None and r.adapter.ref.digest == digest for r in self.core.requests.values())

    def _unload(self, digest: str) -> bool:
        if self._adapter_in_use(digest):
            self._unload_later.add(digest)
            return False
        self._unload_later.discard(digest)
        return self.core.adapters.unload(digest)

    def _unload_idle_adapters(self) -> None:
        for digest in list(self._unload_later):
            if not self._adapter_in_use(digest):
                self._unload(digest)

    def _fail_queued_unloads(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Unload):
                command.answer(error)

    def _drain_commands(self) -> bool:
        """Apply queued adds, aborts and unloads; False once shutdown was asked for."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                self._fail_queued_unloads(EngineDeadError("the engine has shut down"))
                return False
            if isinstance(command, _Unload):
                dropped = self._unload(command.digest)
                if dropped:
                    self._snapshot()  # so that the caller, once answered, no longer sees it
                command.answer(dropped)
                continue
            if isinstance(command, _Abort):
                output = self.core.abort_request(command.request_id)
                sink = self._sinks.pop(command.request_id, None)
                if output is not None and sink is not None:
                    sink.put(output)
                continue
            try:
                request = self.core.add_request(
                    command.request_id,
                    command.checked,
                    prompt=command.prompt,
                    lora=command.lora,
                    cache_salt=command.cache_salt,
                    prefill_after=command.prefill_after,
                    fairness_key=command.fairness_key,
                    fairness_weight=command.fairness_weight,
                    priority=command.priority,
                )
            except Exception as exc:  # a request the checks on the loop let through (duplicate id): fail only it
                command.sink.put(exc)
                continue
            command.sink.adapter = request.adapter
            self._sinks[command.request_id] = command.sink

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if output.finished and output.outputs[0].finish_reason == "error":
            # The entry keeps the loader's exception after the manager forgets it: whose fault it was.
            cause = sink.adapter.error if sink.adapter is not None else None
            sink.put(RequestFailed(output.error or "the request failed", cause=cause))
        else:
            sink.put(output)
        if output.finished:
            del self._sinks[output.request_id]
