"""AsyncEngine: the engine behind an event loop. One thread owns the EngineCore and runs steps while any request
is unfinished; callers on the loop add requests, receive incremental outputs, and abort.

A request's validation errors are raised by `generate` before its first output, so a server can still answer
with a 400; a consumer that stops iterating (a disconnected client) aborts its request and frees its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from loraplex.engine.adapter_ref import AdapterRef, LoRARequest
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore, EngineState
from loraplex.engine.errors import EngineError
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(EngineError):
    """The engine thread failed; no request can be served until the process restarts."""


@dataclass(slots=True)
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sink: _Sink
    lora: AdapterRef | None


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Sink:
    """Carries one request's outputs from the engine thread to its consumer on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._state = core.state()
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

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        add_special_tokens: bool = True,
        lora: AdapterRef | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every step that changes it; the last one has `finished` set.

        Raises RequestError for an invalid request (before anything is yielded) and EngineDeadError if the engine
        fails while the request runs.
        """
        if self._error is not None:
            raise EngineDeadError("the engine has failed; restart it") from self._error
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.core.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, token_ids = None, list(prompt)
        self.core.check_request(token_ids, sampling_params)
        sink = _Sink(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, token_ids, sampling_params, text, sink, lora))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await sink.queue.get()
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
                if not self.core.has_unfinished_requests():
                    self._state = self.core.state()
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                for output in self.core.step():
                    self._deliver(output)
                self._state = self.core.state()
        except BaseException as exc:
            logger.exception("the engine thread failed")
            self._error = exc
            dead = EngineDeadError(f"the engine failed: {exc}")
            for sink in self._sinks.values():
                sink.put(dead)
            self._sinks.clear()

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; False once shutdown was asked for."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Abort):
                output = self.core.abort_request(command.request_id)
                sink = self._sinks.pop(command.request_id, None)
                if output is not None and sink is not None:
                    sink.put(output)
                continue
            try:
                self.core.add_request(
                    command.request_id, command.token_ids, command.params, prompt=command.prompt, lora=command.lora
                )
            except Exception as exc:  # a request the checks on the loop let through (duplicate id): fail only it
                command.sink.put(exc)
                continue
            self._sinks[command.request_id] = command.sink

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        sink.put(output)
        if output.finished:
            del self._sinks[output.request_id]
