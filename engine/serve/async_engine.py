"""AsyncEngine: the engine behind an event loop. One thread owns the EngineCore and runs steps while any request
is unfinished; callers on the loop add requests, receive incremental outputs, and abort.

A request's validation errors are raised by `generate` before its first output, so a server can still answer
with a 400; a consumer that stops iterating (a disconnected client) aborts its request and frees its pages. A
request the engine finishes with an error (its adapter could not be loaded) raises `RequestFailed`, which keeps
the loader's exception so a server can tell the client's fault (an AdapterError) from its own.

Adapters leave memory through `unload_adapter`, which the engine thread runs between steps: at once when no
request uses the adapter, otherwise as soon as the last one finishes.

The waiting queue is bounded (EngineConfig.max_waiting_requests, max_waiting_tokens): `submit` refuses a request
that would take it past a bound with EngineOverloaded, at once and before anything is queued, so a server can
answer 503 before its first byte. The count it checks is the engine's latest snapshot of its queue plus the requests
submitted since, so it never undercounts; a refusal carries a Retry-After estimate, the time the engine's recent rate
of work needs to compute the tokens waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar, Unpack

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.engine_state import EngineState
from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.pooling import PoolingState
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.core.request_check import CheckedPrompt
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.errors import EngineError, EngineOverloaded
from loraplex.engine.lora import AdapterError
from loraplex.engine.lora.manager import AdapterEntry, AdapterState
from loraplex.engine.lora.ref import AdapterRef, LoRARequest

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
    pooling: PoolingState | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """A function to run on the engine thread between steps (it may read and write the engine's state)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]  # answered on `loop`

    def answer(self, result: Any) -> None:
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


# Refusals are counted per (fairness key, priority) for the first this many pairs, then under "(other)": a stream of
# one-off keys (the server's `user` fallback) must not grow the books without bound.
_MAX_REFUSAL_KEYS = 1024
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class QueueBounds:
    """The waiting queue's limits (None: unbounded)."""

    max_waiting_requests: int | None
    max_waiting_tokens: int | None

    def refusal(self, num_waiting: int, num_waiting_tokens: int, num_tokens: int) -> str | None:
        """Why one more request of `num_tokens` cannot join a queue of `num_waiting` requests holding
        `num_waiting_tokens`; None when it can. An empty queue takes any request (its context bounds it)."""
        if num_waiting == 0:
            return None
        if self.max_waiting_requests is not None and num_waiting >= self.max_waiting_requests:
            return f"{num_waiting} requests are waiting (the limit is {self.max_waiting_requests})"
        if self.max_waiting_tokens is not None and num_waiting_tokens + num_tokens > self.max_waiting_tokens:
            return (
                f"{num_waiting_tokens} tokens are waiting and this request adds {num_tokens} "
                f"(the limit is {self.max_waiting_tokens})"
            )
        return None


class SubmitOptions(TypedDict, total=False):
    """`submit`'s keyword arguments, which `generate` passes on."""

    add_special_tokens: bool
    lora: AdapterRef | None
    cache_salt: str | None
    prefill_after: str | None
    fairness_key: str
    fairness_weight: float
    priority: int


class RequestStream:
    """One submitted request's outputs, as an async iterator; the last has `finished` set. Closing it (`aclose`)
    before then aborts the request and frees its pages. Raises what `AsyncEngine.generate` documents."""

    def __init__(self, engine: AsyncEngine, request_id: str, sink: _Sink) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, RequestFailed):
            self._finished = True  # the engine has already let go of it
            raise item
        if isinstance(item, BaseException):
            raise item
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._abort_soon(self.request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        # Commands taken off the queue inside a step (_take_arrivals) that must wait for its end, in order.
        self._held: deque[_Add | _Abort | _Call | None] = deque()
        self._wakeup = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._state = core.state()
        self._adapter_states: dict[str, AdapterState] = {}
        self._unload_later: set[str] = set()  # digests to drop once no request uses them (engine thread's)
        self._error: BaseException | None = None
        config = core.config
        self.bounds = QueueBounds(config.max_waiting_requests, config.max_waiting_tokens)
        # Requests submitted but not yet in a snapshot (the engine thread's `_snapshot` takes them off), and the
        # refusals; under `_lock`, which `submit` (the loop) and `_snapshot` (the engine thread) share.
        self._lock = threading.Lock()
        self._num_pending = 0
        self._num_pending_tokens = 0
        self._drained = (0, 0)  # requests and tokens added by the engine thread since its last snapshot
        self._refusals: dict[tuple[str, int], int] = {}
        self._token_rate = 0.0  # tokens computed per second, a moving average over recent steps
        self._last_work = (time.monotonic(), 0)
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        # A tensor-parallel rank that dies while nothing runs wakes the thread, which then fails (see _run).
        core.on_worker_failure(self._wakeup.set)
        self._thread.start()

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model off the event loop, then start the engine thread."""
        core = await asyncio.to_thread(EngineCore, config)
        return cls(core)

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive() and self.core.workers_alive

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
        **options: Unpack[SubmitOptions],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every step that changes it; the last one has `finished` set. `options`
        are `submit`'s: `prefill_after`, the id of another choice of the same prompt, which this one waits for;
        `fairness_key`, `fairness_weight` and `priority`: see `EngineCore.add_request`.

        Raises RequestError for an invalid request and EngineOverloaded when the waiting queue is full (both before
        anything is yielded), RequestFailed if the engine finishes it with an error (its adapter could not be
        loaded), and EngineDeadError if the engine fails while the request runs. A prompt the caller checked already
        (`core.check_request`) comes as the CheckedPrompt, without `sampling_params`, and is not checked again.
        """
        stream = self.submit(prompt, sampling_params, request_id, **options)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def submit(
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
        pooling: PoolingState | None = None,
    ) -> RequestStream:
        """Queue a request now and return its outputs' stream (`generate` without its lazy start): a caller that
        must know the request was taken before it answers (a server, before its first byte) submits, then iterates.
        Raises at once what `generate` raises before its first output, and EngineOverloaded when the waiting queue
        is full. Called on the event loop the stream is read on."""
        if self._error is not None:
            raise EngineDeadError("the engine has failed; restart it") from self._error
        self.core.check_task(embedding=pooling is not None)  # an embedding request (pooling) or a generation one
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            prompt = self.core.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        checked = self.core.checked(prompt, sampling_params)
        num_tokens = len(checked.token_ids)
        with self._lock:
            state = self._state
            num_waiting = state.num_waiting + self._num_pending
            num_waiting_tokens = state.num_waiting_tokens + self._num_pending_tokens
            refusal = self.bounds.refusal(num_waiting, num_waiting_tokens, num_tokens)
            if refusal is not None:
                label = (fairness_key, priority)
                if label not in self._refusals and len(self._refusals) >= _MAX_REFUSAL_KEYS:
                    label = ("(other)", priority)
                self._refusals[label] = self._refusals.get(label, 0) + 1
                raise EngineOverloaded(
                    f"The engine is overloaded: {refusal}. Retry shortly.",
                    retry_after_s=self._retry_after(num_waiting_tokens),
                )
            self._num_pending += 1
            self._num_pending_tokens += num_tokens
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
                pooling,
            )
        )
        self._wakeup.set()
        return RequestStream(self, request_id, sink)

    def _retry_after(self, num_waiting_tokens: int) -> int:
        """Whole seconds the recent rate of work needs for the waiting tokens, from 1 to MAX_RETRY_AFTER_S."""
        if self._token_rate <= 0:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(num_waiting_tokens / self._token_rate)))

    def refusals(self) -> dict[tuple[str, int], int]:
        """Requests refused for a full queue, by (fairness key, priority), since start."""
        with self._lock:
            return dict(self._refusals)

    def _abort_soon(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    async def resolve_lora(self, lora: LoRARequest) -> AdapterRef:
        """Hash an adapter's files off the event loop; the ref names it in `generate`."""
        return await asyncio.to_thread(self.core.resolve_lora, lora)

    async def unload_adapter(self, digest: str) -> bool:
        """Drop an adapter's weights from the pool and host memory. True if they left now; False if requests still
        use it (they leave as soon as the last one finishes) or the engine never loaded it."""

        def unload() -> bool:
            dropped = self._unload(digest)
            if dropped:
                self._snapshot()  # so that the caller, once answered, no longer sees it
            return dropped

        return bool(await self.call(unload))

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the engine thread between steps, where it may read and write the engine's state (the pool,
        the prefix cache); what it returns or raises. Keep it short: no step runs meanwhile."""
        loop = asyncio.get_running_loop()
        command = _Call(fn, loop, loop.create_future())
        self._commands.put(command)
        self._wakeup.set()
        # Checked after the put: a thread that fails from here on fails the queued command too.
        if self._error is not None:
            raise EngineDeadError("the engine has failed; restart it") from self._error
        result: T = await command.done
        return result

    @property
    def model_name(self) -> str:
        """The name the engine serves its base model under."""
        return self.core.served_model_name

    def set_reasoning(self, reasoning: ReasoningConfig | None) -> None:
        """Reasoning settings for the requests submitted from now on (EngineCore.set_reasoning)."""
        self.core.set_reasoning(reasoning)

    async def abort(self, request_id: str) -> None:
        self._abort_soon(request_id)

    async def shutdown(self) -> None:
        self._commands.put(None)
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 30)
        await asyncio.to_thread(self.core.close)

    # --- the engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self.core.check_workers()
                if not self._drain_commands():
                    return
                if self._unload_later:
                    self._unload_idle_adapters()
                if not self.core.has_unfinished_requests():
                    self._snapshot()
                    self._wakeup.wait()
                    self._wakeup.clear()
                    self._last_work = (time.monotonic(), self._last_work[1])  # idle time is no slow work
                    continue
                for output in self.core.step(arrivals=self._take_arrivals, deliver=self._deliver):
                    self._deliver(output)
                self._snapshot()
        except BaseException as exc:
            logger.exception("the engine thread failed")
            self._error = exc
            dead = EngineDeadError(f"the engine failed: {exc}")
            for sink in self._sinks.values():
                sink.put(dead)
            self._sinks.clear()
            self._fail_queued_calls(dead)
            self.core.close()  # no tensor-parallel rank is left waiting for a step that will not come

    def _snapshot(self) -> None:
        state = self.core.state()
        now = time.monotonic()
        last_at, last_tokens = self._last_work
        if state.num_batched_tokens > last_tokens and now > last_at:
            rate = (state.num_batched_tokens - last_tokens) / (now - last_at)
            self._token_rate = rate if self._token_rate == 0 else 0.8 * self._token_rate + 0.2 * rate
        self._last_work = (now, state.num_batched_tokens)
        with self._lock:  # the new snapshot counts the requests drained since the last: they are no longer pending
            self._state = state
            num_requests, num_tokens = self._drained
            self._num_pending -= num_requests
            self._num_pending_tokens -= num_tokens
            self._drained = (0, 0)
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

    def _fail_queued_calls(self, error: BaseException) -> None:
        while True:
            try:
                command = self._held.popleft() if self._held else self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.answer(error)

    def _drain_commands(self) -> bool:
        """Apply queued adds, aborts and unloads (those held during the last step first); False once shutdown was
        asked for."""
        while True:
            if self._held:
                command = self._held.popleft()
            else:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return True
            if command is None:
                self._fail_queued_calls(EngineDeadError("the engine has shut down"))
                return False
            if isinstance(command, _Call):
                try:
                    result = command.fn()
                except Exception as exc:  # the caller's to handle; the engine goes on
                    command.answer(exc)
                else:
                    command.answer(result)
                continue
            if isinstance(command, _Abort):
                output = self.core.abort_request(command.request_id)
                sink = self._sinks.pop(command.request_id, None)
                if output is not None and sink is not None:
                    sink.put(output)
                continue
            self._add(command)

    def _take_arrivals(self) -> bool:
        """Inside a step, between two of its layers (EngineCore.step's `arrivals`): queue the requests submitted
        since; True if there were any. Aborts, calls and shutdown change what the running step reads, so they wait
        for its end, and so does every command behind one (the order of commands is kept)."""
        took = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return took
            if self._held or not isinstance(command, _Add):
                self._held.append(command)
                continue
            self._add(command)
            took = True

    def _add(self, command: _Add) -> None:
        num_requests, num_tokens = self._drained
        self._drained = (num_requests + 1, num_tokens + len(command.checked.token_ids))
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
                pooling=command.pooling,
            )
        except Exception as exc:  # a request the checks on the loop let through (duplicate id): fail only it
            command.sink.put(exc)
            return
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
