"""The tenant's Playground: chat with one of the models the tenant can name (its endpoints and the base models, as
GET /v1/models lists them), from the browser.

The page is a form; static/playground.js keeps the conversation and posts it, as an OpenAI chat completion request,
to POST /console/playground/chat, which answers exactly as POST /v1/chat/completions does (the same `complete`:
rate limits, concurrency leases, usage rows and billing), acting as the key this session signed in with. The
console's guard checks the request's X-CSRF-Token header, and errors come back as JSON (console_error), for the
script to show.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromQuery, JSONBody
from litestar.response import Template

from loraplex.platform.console.access import Caller
from loraplex.platform.console.pages import page
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.completions.calls import MAX_BODY_BYTES
from loraplex.platform.domain.completions.controllers import complete
from loraplex.platform.domain.completions.schemas import MAX_TOKENS, ChatCompletionRequest
from loraplex.platform.domain.endpoints.service import EndpointService

TITLE = "Playground"
CHAT_PATH = "/console/playground/chat"
DEFAULT_MAX_TOKENS = 64


class PlaygroundPages(Controller):
    path = "/playground"

    @get("/")
    async def index(self, caller: Caller, db: DbSession, model: FromQuery[str | None] = None) -> Template:
        # Every endpoint, as GET /v1/models lists them: a missing one could not be chosen.
        endpoint_names = [endpoint.name for endpoint in await EndpointService(db).list_all(caller.principal.tenant_id)]
        base_models = [base.name for base in await BaseModelRepository(db).list()]
        return page(
            "playground.html",
            caller,
            title=TITLE,
            endpoints=endpoint_names,
            base_models=base_models,
            # The model asked for, when it is one of these; else the select's first.
            selected=model if model in (*endpoint_names, *base_models) else None,
            chat_path=CHAT_PATH,
            default_max_tokens=DEFAULT_MAX_TOKENS,
            max_tokens=MAX_TOKENS,
        )

    @post("/chat", status_code=200, request_max_body_size=MAX_BODY_BYTES)
    async def chat(
        self,
        request: Request[Any, Any, Any],
        caller: Caller,
        resources: AppResources,
        data: JSONBody[ChatCompletionRequest],
    ) -> Response[Any]:
        """POST /v1/chat/completions for the signed-in key: the same checks, answer, usage and bill."""
        return await complete(request, resources, caller.principal, data, "/v1/chat/completions")
