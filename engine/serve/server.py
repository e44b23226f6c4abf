"""The engine's OpenAI-compatible HTTP server, shaped like vLLM's so its users feel at home.

Routes: POST /v1/completions and /v1/chat/completions (streaming or not; `model` names the base model or a LoRA
adapter, or a trusted caller names an adapter's files and digest in `lora_adapter`), POST /v1/embeddings (an
embedding model's, engine/serve/embeddings.py), POST /v1/responses (OpenAI's Responses API, stateless:
engine/serve/protocols/responses_http.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's, in its
envelope: engine/serve/protocols/messages_http.py), GET /v1/models (the base model
and its adapters), POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), GET /v1/state (the load the
platform's router reads), GET /healthz, GET /metrics (Prometheus). Every error, routing and body validation
included, answers in OpenAI's envelope `{"error": {message, type, param, code}}`.

This module is the HTTP layer: the exception handler and error envelope, SSE framing, the controllers, and the app.
What a request means (validation, generation, the response bodies) is `serving`'s `OpenAIServing`.

Ownership: `create_engine_app` serves an engine it does not own (the caller creates and shuts it down); `serve`
owns one for the life of a uvicorn server. With a `RegistrationConfig` the app's lifespan also registers the engine
in the fleet's Redis registry (see `registration`) while it serves.
A request is validated before anything is sent, so a bad request is a 400 even when it asked for a stream; once a
stream has begun, an error ends it with an error event and `[DONE]`
(an adapter that fails to load while the request waits for it is such an error: a 400 if the adapter is at fault,
a 500 if the server is).
A client that goes away aborts its engine requests, which frees their pages: a stream's generator is closed
(Litestar cancels it on disconnect, and the response's background task closes it otherwise), and a non-streaming
request races its generation against the disconnect, answering 499.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Final

from litestar import Controller, Litestar, Request, Response, Router, get, post
from litestar.background_tasks import BackgroundTask
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency, Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import JSONBody
from litestar.response import Stream
from pydantic import BaseModel

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.errors import EngineError, EngineOverloaded
from loraplex.engine.lora.ref import LoRARequest
from loraplex.engine.serve.api_errors import ApiError, ClientDisconnected, ErrorDetail, ErrorResponse, error_detail
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.embeddings import EmbeddingRequest, create_embeddings
from loraplex.engine.serve.http_edge import GuardedRequest, refuse_nul_bytes
from loraplex.engine.serve.jobs import Job
from loraplex.engine.serve.kv_routes import after_kv, before_kv, billed_usage, sweep_forever, transfer_stream
from loraplex.engine.serve.kv_transfer import KVBlocksRequest, KVTransferConfig, KVTransfers
from loraplex.engine.serve.lora_registry import AdapterRoots, LoraRegistry
from loraplex.engine.serve.metrics import CONTENT_TYPE
from loraplex.engine.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from loraplex.engine.serve.protocols.messages import ANTHROPIC_VERSION_HEADER, anthropic_model_list
from loraplex.engine.serve.protocols.messages_http import MessagesController
from loraplex.engine.serve.protocols.responses_http import ResponsesController
from loraplex.engine.serve.registration import FleetRegistration, RegistrationConfig
from loraplex.engine.serve.server_info import engine_state, model_card, model_cards
from loraplex.engine.serve.serving import OpenAIServing

logger = logging.getLogger(__name__)

SSE_MEDIA_TYPE: Final = "text/event-stream"
SSE_DONE: Final = "data: [DONE]\n\n"
# nginx's "client closed request": never seen by the client, but honest in access logs.
STATUS_CLIENT_CLOSED: Final = 499


# --- errors ------------------------------------------------------------------------------------------------------


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """The app's one exception handler: routing, body validation, request and engine errors alike."""
    status_code, detail = error_detail(exc, request)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, EngineOverloaded) else None
    return _json(ErrorResponse(error=detail), status_code=status_code, headers=headers)


def _json(model: BaseModel, *, status_code: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(
        model.model_dump_json().encode(), status_code=status_code, media_type="application/json", headers=headers
    )


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse_error(exc: BaseException) -> str:
    _, detail = error_detail(exc)
    return _sse(ErrorResponse(error=detail))


# --- HTTP --------------------------------------------------------------------------------------------------------

Serving = NamedDependency[OpenAIServing]
Transfers = NamedDependency[KVTransfers]


async def _server_sent_events(job: Job, chunks: AsyncGenerator[BaseModel, None]) -> AsyncGenerator[str, None]:
    """OpenAI's framing: `data: {json}\\n\\n` per chunk, an error event if the stream fails, then `data: [DONE]`."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield _sse(chunk)
    except Exception as exc:  # the response has begun: the error can only be told in the stream
        if not isinstance(exc, EngineError | ApiError):
            logger.exception("%s: the stream failed", job.response_id)
        yield _sse_error(exc)
    yield SSE_DONE


def _stream(job: Job, chunks: AsyncGenerator[BaseModel, None]) -> Stream:
    body = _server_sent_events(job, chunks)

    async def close() -> None:
        # Litestar does not close an iterator it stops reading (a send that failed on a dead connection): closing
        # it here aborts the engine requests at once instead of whenever the generator is collected. The job's own
        # close covers a body never started (the client gone before the first chunk).
        await body.aclose()
        job.close()

    return Stream(
        body,
        media_type=SSE_MEDIA_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(close),
    )


def api_key_guard(api_key: str) -> Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], None]:
    """A guard that admits a request only with `Authorization: Bearer <api_key>` (vLLM's --api-key), or with it in
    `x-api-key`, as the anthropic SDKs send it."""
    expected = api_key.encode()

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        scheme, _space, token = connection.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else connection.headers.get("x-api-key", "")
        if not given or not hmac.compare_digest(given.encode(), expected):
            raise ApiError(401, "Incorrect API key provided for this engine.", code="invalid_api_key")

    return guard


class OpenAIController(Controller):
    path = "/v1"
    tags = ["openai"]

    @post("/completions", status_code=200, summary="Create a completion (OpenAI's legacy completions API)")
    async def completions(
        self, data: JSONBody[CompletionRequest], request: Request[Any, Any, Any], serving: Serving, kv: Transfers
    ) -> Response[Any]:
        job = await serving.completion_job(data)
        await before_kv(kv, job, data)
        job.start(serving.engine)  # a full queue answers 503 here, before any byte
        if data.stream:
            return _stream(job, transfer_stream(kv, job, data, serving.complete_stream(job, data)))
        try:
            answer = await serving.complete(job, data, request)
            await after_kv(kv, job, data, answer)
            return _json(billed_usage(data, answer))
        except ClientDisconnected:
            return _client_closed()
        finally:
            job.close()

    @post("/chat/completions", status_code=200, summary="Create a chat completion")
    async def chat_completions(
        self, data: JSONBody[ChatCompletionRequest], request: Request[Any, Any, Any], serving: Serving, kv: Transfers
    ) -> Response[Any]:
        job = await serving.chat_job(data)
        await before_kv(kv, job, data)
        job.start(serving.engine)  # a full queue answers 503 here, before any byte
        if data.stream:
            return _stream(job, transfer_stream(kv, job, data, serving.chat_stream(job, data)))
        try:
            answer = await serving.chat(job, data, request)
            await after_kv(kv, job, data, answer)
            return _json(billed_usage(data, answer))
        except ClientDisconnected:
            return _client_closed()
        finally:
            job.close()

    @post("/embeddings", status_code=200, summary="Create embeddings (an embedding model's; OpenAI's embeddings API)")
    async def embeddings(
        self, data: JSONBody[EmbeddingRequest], request: Request[Any, Any, Any], serving: Serving
    ) -> Response[Any]:
        try:
            return _json(await create_embeddings(serving, data, request))
        except ClientDisconnected:
            return _client_closed()

    @get(
        "/models", summary="The base model and its LoRA adapters (in Anthropic's shape when anthropic-version is sent)"
    )
    async def models(self, request: Request[Any, Any, Any], serving: Serving) -> Response[Any]:
        cards = model_cards(serving)
        if ANTHROPIC_VERSION_HEADER in request.headers:
            return Response(anthropic_model_list([(card.id, card.created) for card in cards.data]))
        return _json(cards)

    @get("/models/{model_id:path}", summary="One model: the base model or a LoRA adapter (the SDK's models.retrieve)")
    async def model(self, model_id: str, serving: Serving) -> Response[bytes]:
        return _json(model_card(serving, model_id.lstrip("/")))

    @post("/load_lora_adapter", status_code=200, summary="Validate a LoRA adapter and serve it under a name (vLLM's)")
    async def load_lora_adapter(self, data: JSONBody[LoadLoRAAdapterRequest], serving: Serving) -> Response[str]:
        await serving.loras.load(data.lora_name, data.lora_path)
        return _text(f"Success: LoRA adapter '{data.lora_name}' added successfully.")

    @post("/unload_lora_adapter", status_code=200, summary="Stop serving a LoRA adapter name (vLLM's)")
    async def unload_lora_adapter(self, data: JSONBody[UnloadLoRAAdapterRequest], serving: Serving) -> Response[str]:
        await serving.loras.unload(data.lora_name)
        return _text(f"Success: LoRA adapter '{data.lora_name}' removed successfully.")

    @post("/kv/blocks", status_code=200, summary="Cached KV blocks by their chained hashes, for a peer engine")
    async def kv_blocks(self, data: JSONBody[KVBlocksRequest], kv: Transfers) -> Response[bytes]:
        if not kv.enabled:
            raise ApiError(404, "KV transfer is off: the engine was started without --api-key", code="not_found")
        return Response(await kv.export(data), status_code=200, media_type="application/octet-stream")

    @get("/state", summary="Load and free capacity, for the platform's router")
    async def state(self, serving: Serving, kv: Transfers) -> dict[str, Any]:
        return {**engine_state(serving), "kv_transfer": kv.stats()}


def _text(message: str) -> Response[str]:
    # vLLM answers these two routes with plain text; its users' scripts print or ignore it.
    return Response(message, status_code=200, media_type="text/plain")


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


def create_engine_app(
    engine: AsyncEngine,
    loras: LoraRegistry | None = None,
    *,
    adapter_roots: Sequence[str] = (),
    registration: RegistrationConfig | None = None,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    kv_transfer: KVTransferConfig | None = None,
) -> Litestar:
    """An app serving `engine`, which the caller owns (creates, and shuts down after the app stops), and the
    adapters already in `loras` (see `load_lora_modules`); without it, adapters come only from the load route.

    `adapter_roots`: the folders and s3:// prefixes a request's `lora_adapter` may point into (none: the field is
    refused). `registration`: register the engine in the fleet while the app runs (its lifespan, so only under an
    ASGI server that runs lifespans, as uvicorn does); its base-model name is then also accepted as `model`.
    `api_key`: every /v1 route (completions, models, the adapter load and unload routes) then needs it as a bearer
    token, as vLLM's --api-key does; /healthz and /metrics stay open for probes and scrapes. `tool_call_parser`: see
    `OpenAIServing`. `kv_transfer`: KV transfer between engines (engine/serve/kv_transfer.py; default: on with an
    API key, this server's public URL the registration's). Raises ValueError for a malformed root or an unknown
    parser.
    """
    roots = AdapterRoots(adapter_roots)
    aliases = [registration.base_model] if registration is not None and registration.base_model else []
    serving = OpenAIServing(
        engine, loras, adapter_roots=roots, model_aliases=aliases, tool_call_parser=tool_call_parser
    )

    def provide_serving() -> OpenAIServing:
        return serving

    transfers = KVTransfers(
        engine,
        kv_transfer
        or KVTransferConfig(public_url=registration.url if registration is not None else None, api_key=api_key),
    )

    def provide_transfers() -> KVTransfers:
        return transfers

    lifespan = []
    if transfers.enabled:

        @contextlib.asynccontextmanager
        async def sweeping(_: Litestar) -> AsyncIterator[None]:
            task = asyncio.create_task(sweep_forever(transfers), name="loraplex-kv-pins")
            try:
                yield
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await transfers.aclose()

        lifespan.append(sweeping)
    fleet: FleetRegistration | None = None
    if registration is not None:
        fleet = FleetRegistration(engine, registration)

        @contextlib.asynccontextmanager
        async def registered(_: Litestar) -> AsyncIterator[None]:
            async with fleet.running():
                yield

        lifespan.append(registered)

    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty")
    openai = Router(
        path="/",
        route_handlers=[OpenAIController, MessagesController, ResponsesController],
        guards=[] if api_key is None else [api_key_guard(api_key)],
    )
    app = Litestar(
        route_handlers=[openai, OperationsController],
        dependencies={
            "serving": Provide(provide_serving, use_cache=True, sync_to_thread=False),
            "kv": Provide(provide_transfers, use_cache=True, sync_to_thread=False),
        },
        exception_handlers={Exception: handle_exception},
        request_class=GuardedRequest,
        before_request=refuse_nul_bytes,
        openapi_config=OpenAPIConfig(title="loraplex engine", version="1", path="/schema"),
        logging_config=None,  # the process configures logging; Litestar's default would replace its handlers
        lifespan=lifespan,
    )
    app.state.fleet_registration = fleet  # None without a registration; its counters are for operators and tests
    return app


async def load_lora_modules(engine: AsyncEngine, lora_modules: Sequence[LoRARequest]) -> LoraRegistry:
    """A registry holding the adapters named at start-up, each validated and hashed (vLLM's --lora-modules).

    Raises LoraModuleError (a ValueError naming the adapter) for the first one that cannot be served.
    """
    loras = LoraRegistry(engine, engine.core.served_model_name)
    await loras.load_all(lora_modules)
    return loras


async def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8100,
    lora_modules: Sequence[LoRARequest] = (),
    *,
    adapter_roots: Sequence[str] = (),
    registration: RegistrationConfig | None = None,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    kv_transfer: KVTransferConfig | None = None,
) -> None:
    """Load the engine and the adapters named in `lora_modules`, serve them (and, with `registration`, announce
    them to the fleet) until uvicorn is told to stop (SIGINT/SIGTERM), then shut the engine down.

    Raises CheckpointError / ValueError from loading (LoraModuleError for an adapter, ValueError for a malformed
    adapter root) before anything listens.
    """
    import uvicorn

    AdapterRoots(adapter_roots)  # a malformed root fails before the model loads, not after
    engine = await AsyncEngine.create(config)
    try:
        loras = await load_lora_modules(engine, lora_modules)
        app = create_engine_app(
            engine,
            loras,
            adapter_roots=adapter_roots,
            registration=registration,
            api_key=api_key,
            tool_call_parser=tool_call_parser,
            kv_transfer=kv_transfer,
        )
        server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
        )
        await server.serve()
    finally:
        await engine.shutdown()


__all__ = ["create_engine_app", "handle_exception", "load_lora_modules", "serve"]
