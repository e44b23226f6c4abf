"""The admin's tenants pages: the list with a create form, and a tenant's own page (its terms: fair-share weight,
service tiers and limits; suspend and resume; its API keys, a new one shown once in the answer to the POST).

Every change goes through the API's own functions (tenants' `create_tenant` / `update_tenant`, api_keys'
`create_api_key` / `revoke_api_key`), so a suspension reaches every replica at once, as on the API: the tenant's keys
get 401 and its console sessions end at their next request. Forms are read into the API's own request bodies
(TenantCreate, TenantPatch), so the console accepts exactly what the API accepts.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from litestar import Controller, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.console.access import Caller, ConsoleCaller
from loraplex.platform.console.forms import FormData, parse_form
from loraplex.platform.console.pages import page
from loraplex.platform.console.security import PAGE_HEADERS
from loraplex.platform.db.pagination import MAX_PAGE_SIZE
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.api_keys.controllers import create_api_key, revoke_api_key
from loraplex.platform.domain.api_keys.schemas import ApiKeyCreate, ApiKeyCreated, ApiKeyOut
from loraplex.platform.domain.api_keys.service import ApiKeyService
from loraplex.platform.domain.tenants.controllers import create_tenant, update_tenant
from loraplex.platform.domain.tenants.models import MAX_FAIRNESS_WEIGHT, Tenant
from loraplex.platform.domain.tenants.schemas import (
    LIMIT_FIELDS,
    MAX_CONCURRENT_REQUESTS,
    MAX_PER_MINUTE,
    TenantCreate,
    TenantOut,
    TenantPatch,
)
from loraplex.platform.domain.tenants.service import TenantService
from loraplex.platform.errors import ApiError
from loraplex.platform.ids import TenantId
from loraplex.platform.resources import Resources
from loraplex.platform.service_tiers import TIER_ORDER, ServiceTier

TITLE = "Tenants"
LIST_PATH = "/console/admin/tenants"
PLATFORM_TIERS = "platform"  # the tiers select's value for "the platform's default tiers"


@dataclass(frozen=True, slots=True)
class LimitField:
    """A limit's input on the forms: its TenantLimits name, its label and its bounds."""

    name: str
    label: str
    hint: str
    max: int


LIMITS = (
    LimitField("requests_per_minute", "Requests per minute", "whole tenant", MAX_PER_MINUTE),
    LimitField("tokens_per_minute", "Tokens per minute", "whole tenant; prompt + max_tokens", MAX_PER_MINUTE),
    LimitField("key_requests_per_minute", "Requests per minute per key", "each API key", MAX_PER_MINUTE),
    LimitField("key_tokens_per_minute", "Tokens per minute per key", "each API key", MAX_PER_MINUTE),
    LimitField("max_concurrent_requests", "Max concurrent requests", "across the platform", MAX_CONCURRENT_REQUESTS),
)
LABELS = {
    **{f"limits.{field.name}": field.label.lower() for field in LIMITS},
    "fairness_weight": "fairness weight",
    "service_tiers": "service tiers",
}


@dataclass(frozen=True, slots=True)
class TierChoice:
    value: str  # PLATFORM_TIERS or the tiers joined by commas
    label: str


def tier_choices(default: Sequence[ServiceTier]) -> list[TierChoice]:
    """The tiers select: the platform's default, then every allowed list (each includes default), least first."""
    lists = [
        tiers
        for n in range(1, len(TIER_ORDER) + 1)
        for tiers in combinations(TIER_ORDER, n)
        if ServiceTier.DEFAULT in tiers
    ]
    platform = TierChoice(PLATFORM_TIERS, f"Platform default ({', '.join(default)})")
    return [platform, *(TierChoice(",".join(tiers), ", ".join(tiers)) for tiers in lists)]


def _tier_value(tenant: Tenant) -> str:
    return PLATFORM_TIERS if tenant.service_tiers is None else ",".join(tenant.allowed_service_tiers(()))


def _text(data: dict[str, Any], name: str) -> str | None:
    value = data.get(name)
    return value.strip() or None if isinstance(value, str) else None


def _create_body(data: dict[str, Any]) -> TenantCreate:
    values: dict[str, Any] = {"name": data.get("name", ""), "fairness_weight": data.get("fairness_weight", "")}
    limits = {name: value for name in LIMIT_FIELDS if (value := _text(data, name)) is not None}
    if limits:
        values["limits"] = limits
    return parse_form(TenantCreate, values, labels=LABELS)


def _terms_patch(data: dict[str, Any]) -> TenantPatch:
    """The terms form as a patch: every limit is set (a blank one back to the platform's default); a blank weight
    stays as it is."""
    values: dict[str, Any] = {"limits": {name: _text(data, name) for name in LIMIT_FIELDS}}
    if (weight := _text(data, "fairness_weight")) is not None:
        values["fairness_weight"] = weight
    tiers = _text(data, "service_tiers")
    if tiers == PLATFORM_TIERS:
        values["service_tiers"] = None
    elif tiers is not None:
        values["service_tiers"] = tiers.split(",")
    return parse_form(TenantPatch, values, labels=LABELS)


async def _list_page(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    *,
    after: uuid.UUID | None = None,
    created: TenantOut | None = None,
    error: str | None = None,
    form: dict[str, Any] | None = None,
    status_code: int = 200,
) -> Template:
    listed = await TenantService(db).list(limit=MAX_PAGE_SIZE, after=TenantId(after) if after else None)
    default_tiers = resources.settings.default_service_tiers
    return page(
        "admin_tenants.html",
        caller,
        title=TITLE,
        status_code=status_code,
        view="list",
        tenants=[TenantOut.of(tenant, default_tiers) for tenant in listed.items],
        own_tiers={str(tenant.id) for tenant in listed.items if tenant.service_tiers is not None},
        more=listed.has_more,
        next_after=str(listed.items[-1].id) if listed.has_more and listed.items else None,
        limits=LIMITS,
        max_weight=MAX_FAIRNESS_WEIGHT,
        created=created,
        error=error,
        form=form or {},
    )


async def _tenant_page(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    tenant_id: TenantId,
    *,
    notice: str | None = None,
    created_key: ApiKeyCreated | None = None,
    error: str | None = None,
    status_code: int = 200,
) -> Template:
    tenant = await TenantService(db).get(tenant_id)  # another id: 404, as on the API
    default_tiers = resources.settings.default_service_tiers
    keys = await ApiKeyService(db, resources.hasher).list(tenant_id, limit=MAX_PAGE_SIZE, after=None)
    out = TenantOut.of(tenant, default_tiers)
    return page(
        "admin_tenants.html",
        caller,
        title=TITLE,
        status_code=status_code,
        view="tenant",
        tenant=out,
        tier_value=_tier_value(tenant),
        tier_choices=tier_choices(default_tiers),
        limits=LIMITS,
        limit_values=out.limits.model_dump(),
        max_weight=MAX_FAIRNESS_WEIGHT,
        keys=[ApiKeyOut.of(key) for key in keys.items],
        more_keys=keys.has_more,
        notice=notice,
        created_key=created_key,
        error=error,
    )


class AdminTenantPages(Controller):
    path = "/tenants"

    @get("/")
    async def index(
        self, caller: Caller, db: DbSession, resources: AppResources, after: FromQuery[uuid.UUID | None] = None
    ) -> Template:
        return await _list_page(caller, db, resources, after=after)

    @post("/", status_code=200)
    async def create(self, caller: Caller, db: DbSession, resources: AppResources, data: FormData) -> Template:
        try:
            created = await create_tenant(db, resources, _create_body(data))
        except ApiError as exc:
            await db.rollback()
            return await _list_page(caller, db, resources, error=exc.message, form=data, status_code=exc.status_code)
        return await _list_page(caller, db, resources, created=created, status_code=201)

    @get("/{tenant_id:uuid}")
    async def tenant(
        self, tenant_id: FromPath[uuid.UUID], caller: Caller, db: DbSession, resources: AppResources
    ) -> Template:
        return await _tenant_page(caller, db, resources, TenantId(tenant_id))

    @post("/{tenant_id:uuid}", status_code=200)
    async def update(
        self, tenant_id: FromPath[uuid.UUID], caller: Caller, db: DbSession, resources: AppResources, data: FormData
    ) -> Template:
        try:
            await update_tenant(db, resources, TenantId(tenant_id), _terms_patch(data))
        except ApiError as exc:
            if exc.status_code == 404:
                raise
            await db.rollback()
            return await _tenant_page(
                caller, db, resources, TenantId(tenant_id), error=exc.message, status_code=exc.status_code
            )
        return await _tenant_page(caller, db, resources, TenantId(tenant_id), notice="Saved.")

    @post("/{tenant_id:uuid}/status", status_code=303)
    async def status(
        self, tenant_id: FromPath[uuid.UUID], caller: Caller, db: DbSession, resources: AppResources, data: FormData
    ) -> Redirect:
        # A bad status is a 400 page and a missing tenant a 404 (console_error): the form offers neither.
        patch = parse_form(TenantPatch, {"status": data.get("status", "")})
        await update_tenant(db, resources, TenantId(tenant_id), patch)
        back = f"{LIST_PATH}/{tenant_id}" if data.get("back") == "tenant" else LIST_PATH
        return Redirect(back, status_code=303, headers=PAGE_HEADERS)

    @post("/{tenant_id:uuid}/api-keys", status_code=201)
    async def create_key(
        self, tenant_id: FromPath[uuid.UUID], caller: Caller, db: DbSession, resources: AppResources, data: FormData
    ) -> Template:
        await TenantService(db).get(TenantId(tenant_id))  # 404 before anything is written
        try:
            form = parse_form(ApiKeyCreate, {"name": data.get("name", "")})
            created = await create_api_key(db, resources, TenantId(tenant_id), form)
        except ApiError as exc:
            return await _tenant_page(
                caller, db, resources, TenantId(tenant_id), error=exc.message, status_code=exc.status_code
            )
        # Answered, not redirected: the secret is shown by this response only.
        return await _tenant_page(caller, db, resources, TenantId(tenant_id), created_key=created, status_code=201)

    @post("/{tenant_id:uuid}/api-keys/{key_id:str}/revoke", status_code=303)
    async def revoke_key(
        self, tenant_id: FromPath[uuid.UUID], key_id: FromPath[str], db: DbSession, resources: AppResources
    ) -> Redirect:
        await revoke_api_key(db, resources, key_id, TenantId(tenant_id))  # another tenant's key: 404
        return Redirect(f"{LIST_PATH}/{tenant_id}", status_code=303, headers=PAGE_HEADERS)
