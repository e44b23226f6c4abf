"""The engine's OpenAI-compatible HTTP server, shaped like vLLM's so its users feel at home.

Routes: POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, GET /v1/state (the load
the platform's router reads), GET /healthz, GET /metrics (Prometheus). Every error, routing and body validation
included, answers in OpenAI's envelope `{"error": {message, type, param, code}}`.

Ownership: `create_engine_app` serves an engine it does not own (the caller creates and shuts it down); `serve`
owns one for the life of a uvicorn server. A request is validated (model, sampling fields, prompt length)
before anything is sent, so a bad request is a 400 even when it asked for a stream; once a stream has begun, an
error ends it with an error event and `[DONE]`. A client that goes away aborts its engine requests, which frees
their pages: a stream's generator is closed (Litestar cancels it on disconnect, and the response's background
task closes it otherwise), and a non-streaming request races its generation against the disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from litestar import Controller, Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.params import JSONBody
from litestar.response import Stream
from pydantic import BaseModel

from loraplex.engine.async_engine import AsyncEngine, EngineDeadError
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import ContextLengthExceeded, EngineError, RequestError
from loraplex.engine.metrics import CONTENT_TYPE, EngineMetrics, RequestRecord
from loraplex.engine.outputs import PositionLogprobs, RequestOutput
from loraplex.engine.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_MEDIA_TYPE: Final = "text/event-stream"
SSE_DONE: Final = "data: [DONE]\n\n"
# nginx's "client closed request": never seen by the client, but honest in access logs.
STATUS_CLIENT_CLOSED: Final = 499


class ApiError(Exception):
    """An error to answer in OpenAI's envelope with this status."""

    def __init__(self, status_code: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


class ClientDisconnected(Exception):
    """The client closed the connection before its non-streaming response was ready."""


# --- errors ------------------------------------------------------------------------------------------------------


def _error_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    if status_code == 429:
        return "rate_limit_error"
    return "invalid_request_error"


def _error_detail(exc: BaseException, request: Request[Any, Any, Any] | None = None) -> tuple[int, ErrorDetail]:
    """Map any exception to a status and OpenAI's error body."""
    status_code, message, code, param = 500, "The server had an error while processing your request.", None, None
    if isinstance(exc, ApiError):
        status_code, message, code, param = exc.status_code, exc.message, exc.code, exc.param
    elif isinstance(exc, EngineDeadError):
        status_code, message, code = 503, str(exc), "engine_unavailable"
    elif isinstance(exc, RequestError):
        status_code, message, code, param = 400, str(exc), exc.code or "invalid_request", exc.param
    elif isinstance(exc, ValidationException):
        status_code, code = 400, "invalid_request"
        message, param = _validation_message(exc)
    elif isinstance(exc, HTTPException):
        status_code, message = exc.status_code, str(exc.detail)
        where = f"{request.method} {request.url.path}" if request is not None else "this request"
        if status_code == 404:
            message, code = f"Invalid URL ({where})", "unknown_url"
        elif status_code == 405:
            message, code = f"Method not allowed ({where})", "method_not_allowed"
        elif status_code == 400:
            code = "invalid_request"
    else:
        logger.error("unhandled error", exc_info=exc)
    return status_code, ErrorDetail(message=message, type=_error_type(status_code), param=param, code=code)


def _param_name(key: str) -> str:
    """Litestar's `messages.0.content` -> OpenAI's `messages[0].content`."""
    name = ""
    for part in key.split("."):
        name += f"[{part}]" if part.isdigit() else (f".{part}" if name else part)
    return name


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    errors = [e for e in (exc.extra if isinstance(exc.extra, list) else []) if isinstance(e, dict)]
    if not errors:
        return str(exc.detail or "Invalid request body."), None
    first = errors[0]
    key = first.get("key")
    if key == "data":  # the body itself is missing, not one of its fields
        return "The request body must be a JSON object.", None
    param = _param_name(str(key)) if key else None
    detail = str(first.get("message", "invalid value")).removeprefix("Value error, ")
    message = f"Invalid value for '{param}': {detail}" if param else f"Invalid request body: {detail}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return message, param


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """The app's one exception handler: routing, body validation, request and engine errors alike."""
    status_code, detail = _error_detail(exc, request)
    return _json(ErrorResponse(error=detail), status_code=status_code)


def _json(model: BaseModel, *, status_code: int = 200) -> Response[bytes]:
    return Response(model.model_dump_json().encode(), status_code=status_code, media_type="application/json")


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(exc: BaseException) -> str:
    _, detail = _error_detail(exc)
    return _sse(ErrorResponse(error=detail))


# --- running engine requests -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, for echo (decoded when it came as token ids)


@dataclass(slots=True)
class _Job:
    """One HTTP request: its engine requests share the response id, arrival time and parameters."""

    response_id: str
    created: int
    prompts: list[_Prompt]
    params: SamplingParams
    arrived: float  # perf_counter() when the HTTP request reached its handler

    def request_id(self, index: int) -> str:
        return self.response_id if len(self.prompts) == 1 else f"{self.response_id}-{index}"


@dataclass(slots=True)
class _Delta:
    """What one engine output adds to choice `index` of a stream."""

    index: int
    text: str  # never sent before
    token_ids: list[int]  # the tokens generated since the previous delta
    logprobs: list[PositionLogprobs] | None  # theirs, when asked for
    output: RequestOutput  # the cumulative output (finish_reason, stop_reason)


async def _merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of every stream as they come, tagged with the stream's index; the first error ends all of them.

    Closing this generator cancels the streams' pumps, which closes (and so aborts) each stream.
    """
    done: Final = object()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request[Any, Any, Any]) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected
        return task.result()
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def _usage(job: _Job, finals: dict[int, RequestOutput]) -> Usage:
    return Usage.of(
        num_prompt_tokens=sum(len(p.token_ids) for p in job.prompts),
        num_completion_tokens=sum(len(out.outputs[0].token_ids) for out in finals.values()),
        num_cached_tokens=sum(out.num_cached_tokens for out in finals.values()),
    )


# --- the serving logic -------------------------------------------------------------------------------------------


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.model_name = engine.core.served_model_name
        self.max_model_len = engine.core.max_model_len
        self.created = int(time.time())
        self.metrics = EngineMetrics(engine.state, lambda: engine.is_healthy)

    # validation, before any response byte

    def _check_model(self, model: str | None) -> None:
        if not self.engine.is_healthy:
            raise EngineDeadError("the engine has failed; restart it")
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                code="model_not_found",
                param="model",
            )

    def _check_prompt(self, token_ids: list[int], params: SamplingParams, param: str) -> None:
        try:
            self.engine.core.check_request(token_ids, params)
        except ContextLengthExceeded as exc:
            exc.param = param
            raise

    def _log_unknown(self, request_id: str, fields: list[str]) -> None:
        if fields:
            logger.warning("%s: ignoring unknown fields %s", request_id, ", ".join(fields))

    def completion_job(self, body: CompletionRequest) -> _Job:
        arrived = time.perf_counter()
        self._check_model(body.model)
        params = body.sampling_params()
        tokenizer = self.engine.core.tokenizer
        prompts: list[_Prompt] = []
        for prompt in body.prompts:
            if isinstance(prompt, str):
                prompts.append(_Prompt(tokenizer.encode(prompt), prompt))
            else:
                text = tokenizer.decode(prompt, skip_special_tokens=False) if body.echo else None
                prompts.append(_Prompt(list(prompt), text))
            self._check_prompt(prompts[-1].token_ids, params, "prompt")
        job = _Job(f"cmpl-{secrets.token_hex(16)}", int(time.time()), prompts, params, arrived)
        self._log_unknown(job.response_id, body.unknown_fields)
        return job

    def chat_job(self, body: ChatCompletionRequest) -> _Job:
        arrived = time.perf_counter()
        self._check_model(body.model)
        params = body.sampling_params()
        tokenizer = self.engine.core.tokenizer
        text = tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=body.add_generation_prompt)
        # The rendered template carries its own special tokens (BOS included): adding them again would double them.
        prompt = _Prompt(tokenizer.encode(text, add_special_tokens=False), text)
        self._check_prompt(prompt.token_ids, params, "messages")
        job = _Job(f"chatcmpl-{secrets.token_hex(16)}", int(time.time()), [prompt], params, arrived)
        self._log_unknown(job.response_id, body.unknown_fields)
        return job

    # generation

    async def _generate(self, job: _Job, index: int) -> AsyncGenerator[RequestOutput, None]:
        """One engine request's outputs; records its metrics and log line however it ends."""
        request_id = job.request_id(index)
        prompt = job.prompts[index]
        first_token_at: float | None = None
        last: RequestOutput | None = None
        failed = False
        try:
            outputs = self.engine.generate(prompt.token_ids, job.params, request_id)
            # Closing the generator is what aborts the request.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if first_token_at is None and output.outputs[0].token_ids:
                        first_token_at = time.perf_counter()
                    last = output
                    yield output
        except Exception:
            failed = True
            raise
        finally:
            ended = time.perf_counter()
            if last is not None and last.finished:
                finish_reason = last.outputs[0].finish_reason or "stop"
            else:
                finish_reason = "error" if failed else "abort"
            record = RequestRecord(
                finish_reason=finish_reason,
                num_prompt_tokens=len(prompt.token_ids),
                num_cached_tokens=last.num_cached_tokens if last is not None else 0,
                num_generated_tokens=len(last.outputs[0].token_ids) if last is not None else 0,
                time_to_first_token_s=None if first_token_at is None else first_token_at - job.arrived,
                latency_s=ended - job.arrived,
            )
            self.metrics.record(record)
            logger.info(
                "%s: %d prompt tokens (%d cached), %d generated, finish %s, first token %s, %.3f s",
                request_id,
                record.num_prompt_tokens,
                record.num_cached_tokens,
                record.num_generated_tokens,
                finish_reason,
                "-" if record.time_to_first_token_s is None else f"{record.time_to_first_token_s:.3f} s",
                record.latency_s,
            )

    def _outputs(self, job: _Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        return _merge([self._generate(job, i) for i in range(len(job.prompts))])

    async def _finals(self, job: _Job) -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for index, output in outputs:
                finals[index] = output
        return finals

    async def _deltas(self, job: _Job) -> AsyncGenerator[_Delta, None]:
        """What each output adds to its choice; outputs that add no visible text (a held-back tail, a partial
        character) are folded into the next one, so no chunk is empty but the finishing one."""
        num_chars = [0] * len(job.prompts)
        num_tokens = [0] * len(job.prompts)
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for index, output in outputs:
                completion = output.outputs[0]
                text = completion.text[num_chars[index] :]
                if not text and not completion.finished:
                    continue
                start = num_tokens[index]
                logprobs = completion.logprobs[start:] if completion.logprobs is not None else None
                num_chars[index] = len(completion.text)
                num_tokens[index] = len(completion.token_ids)
                yield _Delta(index, text, completion.token_ids[start:], logprobs, output)

    # completions

    async def complete(self, job: _Job, body: CompletionRequest, request: Request[Any, Any, Any]) -> CompletionResponse:
        finals = await _unless_disconnected(request, self._finals(job))
        choices = []
        for index, prompt in enumerate(job.prompts):
            completion = finals[index].outputs[0]
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs, _ = CompletionLogprobs.of(completion.token_ids, completion.logprobs, 0)
            echo = (prompt.text or "") if body.echo else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=echo + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        return CompletionResponse(
            id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=_usage(job, finals)
        )

    async def complete_stream(self, job: _Job, body: CompletionRequest) -> AsyncGenerator[BaseModel, None]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
            return CompletionChunk(
                id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=usage
            )

        if body.echo:
            for index, prompt in enumerate(job.prompts):
                yield chunk([CompletionChoice(index=index, text=prompt.text or "")])
        text_offsets = [0] * len(job.prompts)
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._deltas(job)) as deltas:
            async for delta in deltas:
                logprobs = None
                if body.logprobs is not None and delta.logprobs is not None:
                    logprobs, text_offsets[delta.index] = CompletionLogprobs.of(
                        delta.token_ids, delta.logprobs, text_offsets[delta.index]
                    )
                if delta.output.finished:
                    finals[delta.index] = delta.output
                completion = delta.output.outputs[0]
                choice = CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield chunk([choice])
        if body.include_usage:
            yield chunk([], _usage(job, finals))

    # chat

    async def chat(
        self, job: _Job, body: ChatCompletionRequest, request: Request[Any, Any, Any]
    ) -> ChatCompletionResponse:
        finals = await _unless_disconnected(request, self._finals(job))
        completion = finals[0].outputs[0]
        logprobs = None
        if body.logprobs and completion.logprobs is not None:
            logprobs = ChoiceLogprobs.of(completion.token_ids, completion.logprobs, body.top_logprobs or 0)
        choice = ChatChoice(
            index=0,
            message=AssistantMessage(content=completion.text),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        return ChatCompletionResponse(
            id=job.response_id, created=job.created, model=self.model_name, choices=[choice], usage=_usage(job, finals)
        )

    async def chat_stream(self, job: _Job, body: ChatCompletionRequest) -> AsyncGenerator[BaseModel, None]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=usage
            )

        yield chunk([ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self._deltas(job)) as deltas:
            async for delta in deltas:
                logprobs = None
                if body.logprobs and delta.logprobs is not None:
                    logprobs = ChoiceLogprobs.of(delta.token_ids, delta.logprobs, body.top_logprobs or 0)
                if delta.output.finished:
                    finals[delta.index] = delta.output
                completion = delta.output.outputs[0]
                choice = ChatChunkChoice(
                    index=delta.index,
                    delta=DeltaMessage(content=delta.text) if delta.text else DeltaMessage(),
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield chunk([choice])
        if body.include_usage:
            yield chunk([], _usage(job, finals))

    # operations

    def state(self) -> dict[str, Any]:
        state = self.engine.state()
        pool = state.pool
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len,
            "healthy": self.engine.is_healthy,
            "num_waiting": state.num_waiting,
            "num_running": state.num_running,
            "num_preemptions": state.num_preemptions,
            "num_steps": state.num_steps,
            "pool": {
                "num_pages": pool.num_pages,
                "num_free": pool.num_free,
                "page_bytes": pool.page_bytes,
                "by_kind": dict(pool.by_kind),
            },
        }


# --- HTTP --------------------------------------------------------------------------------------------------------

Serving = NamedDependency[OpenAIServing]


async def _server_sent_events(job: _Job, chunks: AsyncGenerator[BaseModel, None]) -> AsyncGenerator[str, None]:
    """OpenAI's framing: `data: {json}\\n\\n` per chunk, an error event if the stream fails, then `data: [DONE]`."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield _sse(chunk)
    except Exception as exc:  # the response has begun: the error can only be told in the stream
        if not isinstance(exc, EngineError):
            logger.exception("%s: the stream failed", job.response_id)
        yield _sse_error(exc)
    yield SSE_DONE


def _stream(job: _Job, chunks: AsyncGenerator[BaseModel, None]) -> Stream:
    body = _server_sent_events(job, chunks)

    async def close() -> None:
        # Litestar does not close an iterator it stops reading (a send that failed on a dead connection): closing
        # it here aborts the engine requests at once instead of whenever the generator is collected.
        await body.aclose()

    return Stream(
        body,
        media_type=SSE_MEDIA_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(close),
    )


class OpenAIController(Controller):
    path = "/v1"
    tags = ["openai"]

    @post("/completions", status_code=200, summary="Create a completion (OpenAI's legacy completions API)")
    async def completions(
        self, data: JSONBody[CompletionRequest], request: Request[Any, Any, Any], serving: Serving
    ) -> Response[Any]:
        job = serving.completion_job(data)
        if data.stream:
            return _stream(job, serving.complete_stream(job, data))
        try:
            return _json(await serving.complete(job, data, request))
        except ClientDisconnected:
            return _client_closed()

    @post("/chat/completions", status_code=200, summary="Create a chat completion")
    async def chat_completions(
        self, data: JSONBody[ChatCompletionRequest], request: Request[Any, Any, Any], serving: Serving
    ) -> Response[Any]:
        job = serving.chat_job(data)
        if data.stream:
            return _stream(job, serving.chat_stream(job, data))
        try:
            return _json(await serving.chat(job, data, request))
        except ClientDisconnected:
            return _client_closed()

    @get("/models", summary="The served model")
    async def models(self, serving: Serving) -> Response[bytes]:
        card = ModelCard(id=serving.model_name, created=serving.created, max_model_len=serving.max_model_len)
        return _json(ModelList(data=[card]))

    @get("/state", summary="Load and free capacity, for the platform's router")
    async def state(self, serving: Serving) -> dict[str, Any]:
        return serving.state()


def _client_closed() -> Response[bytes]:
    detail = ErrorDetail(message="The client closed the connection.", type="invalid_request_error", code="aborted")
    return _json(ErrorResponse(error=detail), status_code=STATUS_CLIENT_CLOSED)


class OperationsController(Controller):
    path = "/"
    tags = ["operations"]

    @get("/healthz", summary="Liveness: 200 while the engine serves, 503 once it has failed")
    async def healthz(self, serving: Serving) -> Response[dict[str, str]]:
        if serving.engine.is_healthy:
            return Response({"status": "ok"})
        return Response({"status": "unavailable"}, status_code=503)

    @get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def metrics(self, serving: Serving) -> Response[bytes]:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)


def create_engine_app(engine: AsyncEngine) -> Litestar:
    """An app serving `engine`, which the caller owns (creates, and shuts down after the app stops)."""
    serving = OpenAIServing(engine)

    def provide_serving() -> OpenAIServing:
        return serving

    return Litestar(
        route_handlers=[OpenAIController, OperationsController],
        dependencies={"serving": Provide(provide_serving, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        openapi_config=OpenAPIConfig(title="loraplex engine", version="1", path="/schema"),
        logging_config=None,  # the process configures logging; Litestar's default would replace its handlers
    )


async def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8100) -> None:
    """Load the engine, serve it until uvicorn is told to stop (SIGINT/SIGTERM), then shut the engine down.

    Raises CheckpointError / ValueError from loading before anything listens.
    """
    import uvicorn

    engine = await AsyncEngine.create(config)
    try:
        app = create_engine_app(engine)
        server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        )
        await server.serve()
    finally:
        await engine.shutdown()


__all__ = ["create_engine_app", "handle_exception", "serve"]
