"""The tenant's API keys page: list, create (the new key shown once, in the answer to the POST, never in a URL or
a later page) and revoke."""

from __future__ import annotations

from litestar import Controller, get, post
from litestar.params import FromPath
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.console.access import Caller, ConsoleCaller
from loraplex.platform.console.forms import Form, FormData, parse_form
from loraplex.platform.console.pages import page
from loraplex.platform.console.security import PAGE_HEADERS
from loraplex.platform.db.pagination import MAX_PAGE_SIZE
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.api_keys.controllers import create_api_key, revoke_api_key
from loraplex.platform.domain.api_keys.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyOut
from loraplex.platform.domain.api_keys.service import ApiKeyService
from loraplex.platform.errors import ApiError
from loraplex.platform.resources import Resources
from loraplex.platform.schemas import Name

TITLE = "API keys"


class KeyForm(Form):
    name: Name | None = None


async def _page(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    *,
    created: ApiKeyCreated | None = None,
    error: str | None = None,
    status_code: int = 200,
) -> Template:
    listed = await ApiKeyService(db, resources.hasher).list(caller.principal.tenant_id, limit=MAX_PAGE_SIZE, after=None)
    return page(
        "keys.html",
        caller,
        title=TITLE,
        status_code=status_code,
        keys=[ApiKeyOut.of(key) for key in listed.items],
        more=listed.has_more,
        session_key_id=caller.principal.key_id,
        created=created,
        error=error,
    )


class KeyPages(Controller):
    path = "/keys"

    @get("/")
    async def index(self, caller: Caller, db: DbSession, resources: AppResources) -> Template:
        return await _page(caller, db, resources)

    @post("/", status_code=200)
    async def create(self, caller: Caller, db: DbSession, resources: AppResources, data: FormData) -> Template:
        try:
            form = parse_form(KeyForm, data)
            created = await create_api_key(db, resources, caller.principal.tenant_id, ApiKeyCreate(name=form.name))
        except ApiError as exc:
            return await _page(caller, db, resources, error=exc.message, status_code=exc.status_code)
        # Answered, not redirected: the secret is shown by this response only (see the page's notice).
        return await _page(caller, db, resources, created=created, status_code=201)

    @post("/{key_id:str}/revoke", status_code=303)
    async def revoke(self, key_id: FromPath[str], caller: Caller, db: DbSession, resources: AppResources) -> Redirect:
        # Another tenant's key answers 404, as on the API (revoke_api_key scopes by tenant).
        await revoke_api_key(db, resources, key_id, caller.principal.tenant_id)
        return Redirect("/console/keys", status_code=303, headers=PAGE_HEADERS)
