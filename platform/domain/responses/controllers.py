"""HTTP for tenants' Responses API clients (Codex CLI, the Agents SDK): POST /v1/responses, and for stored responses
GET /v1/responses/{id}, GET /v1/responses/{id}/input_items and DELETE /v1/responses/{id}. A response is the tenant's
chat completion (the same resolution of `model`, limits, tiers, fair share, metering and billing) converted by the
engine's Responses converter (engine/serve/protocols/responses.py) and written back as a response object and its
typed events (`ResponsesFraming`); with `store` (the default) it is stored per tenant before it is answered, and a
later `previous_response_id` continues its conversation (whose prefix the engine's cache holds: billed as cache
hits). Stateless clients ask for their reasoning sealed instead (`include: ["reasoning.encrypted_content"]`,
sealing.py), and what they send back must open. Another tenant's id reads as no response: 404."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from litestar import Controller, Response, delete, get, post
from litestar import Request as HttpRequest
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.params import JSONBody, Parameter

from loraplex.engine import RequestError
from loraplex.engine.serve import responses as responses_api
from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.db.base import utcnow
from loraplex.platform.dependencies import GENERATION_CHECKED_LATER, AppResources, Principal, config_basis
from loraplex.platform.domain.completions.calls import MAX_BODY_BYTES, too_large
from loraplex.platform.domain.completions.controllers import (
    Framing,
    admit_completion,
    collect,
    complete,
    prepare_completion,
)
from loraplex.platform.domain.completions.schemas import ChatCompletionRequest
from loraplex.platform.domain.completions.service import Call, converted_chat, resolve
from loraplex.platform.domain.responses import background
from loraplex.platform.domain.responses.repository import RUNNING, ResponseRepository
from loraplex.platform.domain.responses.sealing import InvalidSeal, ReasoningSeal
from loraplex.platform.domain.responses.service import history, input_items, stored
from loraplex.platform.errors import ApiError, invalid_request
from loraplex.platform.ids import TenantId
from loraplex.platform.jobs.models import Job
from loraplex.platform.jobs.repository import JobRepository
from loraplex.platform.resources import Resources

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
SEALED = "reasoning.encrypted_content"


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response with id '{response_id}'.", code="not_found", param=param)


class ResponsesFraming(Framing):
    """A chat completion written as a response and its events, for one request; stored when `store`."""

    running_usage = True

    def __init__(
        self,
        resources: Resources,
        tenant_id: TenantId,
        body: responses_api.ResponsesRequest,
        model: str,
        items: list[dict[str, Any]],
        seal: ReasoningSeal | None = None,
        *,
        response_id: str | None = None,
    ) -> None:
        self.resources, self.tenant_id, self.body, self.model, self.items = resources, tenant_id, body, model, items
        self.seal = seal  # include reasoning.encrypted_content: reasoning items carry their text sealed
        self.store = body.store is not False
        self.response_id = response_id or responses_api.new_response_id()  # given: a background response's run
        self.events = responses_api.ResponseStream(body, response_id=self.response_id, model=model, store=self.store)
        self.failed: dict[str, Any] | None = None  # the response of a stream that broke

    def request_id(self, chat: bool) -> str:
        return self.response_id  # the usage row's key is the response's id

    async def answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        response = responses_api.response_of(
            answer, self.body, response_id=self.response_id, model=self.model, store=self.store
        )
        self._sealed(response["output"])
        await self._store(response)
        return response

    def chunk(self, event: dict[str, Any]) -> str:
        if "error" in event:  # the engine failed the request after accepting it (service.engine_failure)
            return self._failed(str(event["error"].get("message", "The engine failed.")), event["error"].get("code"))
        events = self.events.feed(event)
        self._sealed([e["item"] for e in events if e["type"] == "response.output_item.done"])
        return "".join(responses_api.sse(e) for e in events)

    def error(self, error: ApiError) -> str:
        return self._failed(error.message, error.code)

    def _failed(self, message: str, code: str | None) -> str:
        event = self.events.failed(message, code)
        self.failed = event["response"]
        return responses_api.sse(event)

    async def done(self) -> str:
        if self.failed:  # stored as it failed, as OpenAI keeps a failed response
            self._sealed(self.failed["output"])
            await self._store(self.failed)
            return ""
        events = self.events.end()
        assert self.events.response is not None
        self._sealed([e["item"] for e in events if e["type"] == "response.output_item.done"])
        self._sealed(self.events.response["output"])
        await self._store(self.events.response)
        return "".join(responses_api.sse(e) for e in events)

    def _sealed(self, items: list[dict[str, Any]]) -> None:
        """Seal the think block of each reasoning item in `items`, when the client asked for it."""
        if self.seal is None:
            return
        for item in items:
            if item.get("type") == "reasoning" and "encrypted_content" not in item:
                text = "".join(part.get("text", "") for part in item.get("content") or [])
                item["encrypted_content"] = self.seal.seal(str(self.tenant_id), text)

    async def _store(self, response: dict[str, Any]) -> None:
        if not self.store:
            return
        now = utcnow()
        row = stored(self.tenant_id, response, self.items, now, self.resources.settings.responses_retention_days)
        try:
            async with self.resources.sessions() as session:
                await ResponseRepository(session).add(row, now)
                await session.commit()
        except Exception:  # the answer exists and is billed: it goes out, unstored, and the failure is logged
            logger.exception("response %s could not be stored", self.response_id)


def _seal(resources: Resources) -> ReasoningSeal:
    return ReasoningSeal(bytes.fromhex(resources.hasher.derive("responses-reasoning-seal", "v1")))


def _open_sealed(seal: ReasoningSeal, tenant: str, body: responses_api.ResponsesRequest) -> None:
    """Every sealed reasoning item the client sent back must open for this tenant: else a 400 naming it."""
    for index, item in enumerate(body.input if isinstance(body.input, list) else []):
        token = item.get("encrypted_content") if isinstance(item, dict) and item.get("type") == "reasoning" else None
        if token is None:
            continue
        try:
            seal.open(tenant, str(token))
        except InvalidSeal as exc:
            raise invalid_request(
                f"input[{index}].encrypted_content does not open: {exc}",
                param=f"input[{index}].encrypted_content",
                code="invalid_encrypted_content",
            ) from None


async def _history(
    resources: Resources, principal: TenantPrincipal, body: responses_api.ResponsesRequest
) -> list[dict[str, Any]]:
    if body.previous_response_id is None:
        return []
    async with resources.sessions() as session:
        chain = await ResponseRepository(session).chain(principal.tenant_id, body.previous_response_id, utcnow())
    if chain is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    return history(chain)


async def _converted(
    resources: Resources,
    principal: TenantPrincipal,
    data: responses_api.ResponsesRequest,
    response_id: str | None = None,
) -> tuple[ChatCompletionRequest, ResponsesFraming]:
    """The chat completion a response is (its sealed reasoning opened, its stored conversation before it) and how
    it is written back; raises the 4xx of what cannot be."""
    if not data.model:
        raise invalid_request("model: field required", param="model")
    seal = _seal(resources)
    _open_sealed(seal, str(principal.tenant_id), data)
    target = await resolve(resources, principal, data.model)
    try:
        chat = responses_api.to_chat(data, await _history(resources, principal, data))
    except RequestError as exc:
        raise invalid_request(str(exc), param=exc.param) from None
    chat["model"] = data.model
    if data.stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    sealing = seal if SEALED in (data.include or []) else None
    framing = ResponsesFraming(
        resources, principal.tenant_id, data, target.model, input_items(data), sealing, response_id=response_id
    )
    return converted_chat(chat), framing


async def _background(
    request: HttpRequest[Any, Any, Any],
    resources: Resources,
    principal: TenantPrincipal,
    data: responses_api.ResponsesRequest,
    raw: dict[str, Any],
) -> Response[Any]:
    """Admit the response (every refusal now), store it queued with its job, and answer that (background.py)."""
    chat, framing = await _converted(resources, principal, data)
    _, headers, lease = await admit_completion(
        request, resources, principal, chat, CHAT_PATH, config_basis(request), framing
    )
    try:  # the job takes a slot of its own when it runs, in whichever replica claims it
        now = utcnow()
        queued = responses_api.envelope(
            framing.body,
            response_id=framing.response_id,
            model=framing.model,
            created_at=int(now.timestamp()),
            status="queued",
            output=[],
            usage=None,
            store=True,
        )
        queued["background"] = True
        row = stored(principal.tenant_id, queued, framing.items, now, resources.settings.responses_retention_days)
        job = Job(
            id=framing.response_id,
            kind=background.KIND,
            tenant_id=principal.tenant_id,
            payload=background.job_payload(principal, raw),
            created_at=now,
            run_after=now,
        )
        async with resources.sessions() as session:
            await ResponseRepository(session).add(row, now)
            JobRepository(session).add(job)
            await session.commit()
    finally:
        await lease.release()
    if resources.jobs is not None:
        resources.jobs.nudge()
    return Response(queued, headers=headers)


@dataclass
class BackgroundRun:
    """A background response, prepared to run in a job: its call and how its answer is written."""

    call: Call
    framing: ResponsesFraming
    cap: int  # the tenant's concurrency cap, whose slot the run holds

    async def answer(self, resources: Resources) -> dict[str, Any]:
        framing = self.framing
        response = responses_api.response_of(
            await collect(resources, self.call),
            framing.body,
            response_id=framing.response_id,
            model=framing.model,
            store=True,
        )
        framing._sealed(response["output"])
        return {**response, "background": True}


async def prepared_background(
    resources: Resources, principal: TenantPrincipal, response_id: str, raw: dict[str, Any]
) -> BackgroundRun:
    """The run of background response `response_id` from the request it was created with (`raw`), for a job: the
    lookups again (it was admitted when it was created), raising the refusals they make now."""
    data = responses_api.ResponsesRequest.model_validate(raw)
    chat, framing = await _converted(resources, principal, data, response_id)
    prepared = await prepare_completion(resources, principal, chat, CHAT_PATH, framing)
    return BackgroundRun(prepared.call, framing, prepared.terms.max_concurrent_requests)


class ResponsesController(Controller):
    path = "/"
    tags = ["tenant: responses (OpenAI's Responses API)"]

    @post(
        "/responses",
        status_code=200,
        summary="Create a model response (OpenAI's Responses API)",
        request_max_body_size=MAX_BODY_BYTES,
        exception_handlers={RequestEntityTooLarge: too_large},
        opt={GENERATION_CHECKED_LATER: True},
    )
    async def create(
        self,
        request: HttpRequest[Any, Any, Any],
        data: JSONBody[responses_api.ResponsesRequest],
        principal: Principal,
        resources: AppResources,
    ) -> Response[Any]:
        if data.background and data.store is False:
            raise invalid_request("a background response is stored: leave store out or send true", param="store")
        if data.background and data.stream:
            raise invalid_request("streaming a background response is not supported yet: poll it", param="stream")
        if data.background:
            raw = data.model_dump(mode="json", exclude_unset=True)  # before sealed reasoning is opened
            return await _background(request, resources, principal, data, raw)
        chat, framing = await _converted(resources, principal, data)
        return await complete(request, resources, principal, chat, CHAT_PATH, config_basis(request), framing)

    @get("/responses/{response_id:str}", summary="A stored response")
    async def retrieve(self, response_id: str, principal: Principal, resources: AppResources) -> dict[str, Any]:
        now = utcnow()
        async with resources.sessions() as session:
            row = await ResponseRepository(session).get(principal.tenant_id, response_id, now)
        if row is None:
            raise _not_found(response_id)
        return row.response

    @post("/responses/{response_id:str}/cancel", status_code=200, summary="Cancel a background response")
    async def cancel(self, response_id: str, principal: Principal, resources: AppResources) -> dict[str, Any]:
        """A queued or running background response stops, and reads cancelled; one that has ended is a 400."""
        async with resources.sessions() as session:
            row = await ResponseRepository(session).get(principal.tenant_id, response_id, utcnow())
        if row is None:
            raise _not_found(response_id)
        if not row.response.get("background"):
            raise invalid_request("only a background response can be cancelled", param="response_id")
        if row.status == "cancelled":
            return row.response
        if row.status not in RUNNING:
            raise invalid_request(
                f"this response has ended ({row.status}): it cannot be cancelled", param="response_id"
            )
        now = utcnow()
        async with resources.sessions() as session:  # the response and its job, together
            await ResponseRepository(session).finish(response_id, background.ended(row.response, "cancelled"))
            await JobRepository(session).cancel(response_id, now)
            await session.commit()
        if resources.jobs is not None:  # run here: stopped now (elsewhere: at its worker's next renewal)
            await resources.jobs.interrupt(response_id)
        async with resources.sessions() as session:
            after = await ResponseRepository(session).get(principal.tenant_id, response_id, utcnow())
        return after.response if after is not None else background.ended(row.response, "cancelled")

    @get("/responses/{response_id:str}/input_items", summary="A stored response's input items")
    async def input_items(
        self,
        response_id: str,
        principal: Principal,
        resources: AppResources,
        limit: int = Parameter(default=20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        async with resources.sessions() as session:
            row = await ResponseRepository(session).get(principal.tenant_id, response_id, utcnow())
        if row is None:
            raise _not_found(response_id)
        items = list(row.input_items) if order == "asc" else list(reversed(row.input_items))
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    @delete("/responses/{response_id:str}", status_code=200, summary="Delete a stored response")
    async def remove(self, response_id: str, principal: Principal, resources: AppResources) -> dict[str, Any]:
        async with resources.sessions() as session:
            deleted = await ResponseRepository(session).delete(principal.tenant_id, response_id, utcnow())
            await session.commit()
        if not deleted:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
