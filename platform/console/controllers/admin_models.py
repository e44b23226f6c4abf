"""The admin's models & prices page: the registered base models with a form to register one and ones to set or clear
a base model's speculative config and its reasoning config, and the versioned price book (every version per base
model and service tier, the one in force now marked) with a form to add a version.

The forms are read into the API's own request bodies (BaseModelCreate, BaseModelPatch: the speculative and reasoning
configs as their JSON text; PriceSet: decimal prices, at most 9 decimals, an instant read as UTC) and go through the
API's own functions (`register_base_model`, `update_base_model`, `set_price`), so a price that would re-rate recorded
usage is refused here as there. A refused form re-renders the page with the message and the admin's input, having
written nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from litestar import Controller, get, post
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.console.access import Caller, ConsoleCaller
from loraplex.platform.console.forms import FormData, parse_form
from loraplex.platform.console.pages import page
from loraplex.platform.console.security import CSRF_FIELD
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.base_models.controllers import register_base_model, update_base_model
from loraplex.platform.domain.base_models.models import Quantization
from loraplex.platform.domain.base_models.schemas import BaseModelCreate, BaseModelOut, BaseModelPatch
from loraplex.platform.domain.base_models.service import BaseModelService
from loraplex.platform.domain.billing.controllers import set_price
from loraplex.platform.domain.billing.schemas import PriceOut, PriceSet
from loraplex.platform.domain.billing.service import BillingService
from loraplex.platform.errors import ApiError
from loraplex.platform.resources import Resources
from loraplex.platform.service_tiers import TIER_ORDER

TITLE = "Models & prices"
PRICE_LABELS = {
    "base_model": "base model",
    "service_tier": "service tier",
    "input_per_mtok": "input price (USD per 1M tokens)",
    "cached_input_per_mtok": "cached input price (USD per 1M tokens)",
    "output_per_mtok": "output price (USD per 1M tokens)",
    "reasoning_per_mtok": "reasoning price (USD per 1M tokens)",
    "effective_at": "effective from",
}
MODEL_LABELS = {
    "name": "name",
    "source": "source path",
    "quantization": "quantization",
    "speculative_config": "speculative config",
    "reasoning_config": "reasoning config",
}


@dataclass(frozen=True, slots=True)
class PriceBook:
    """One base model and tier's versions, newest first (PriceOut.history's order and statuses)."""

    base_model: str
    service_tier: str
    versions: tuple[PriceOut, ...]


def price_books(versions: Sequence[PriceOut]) -> list[PriceBook]:
    """The price book's versions grouped per base model and tier, in the order the price book lists them."""
    grouped: dict[tuple[str, str], list[PriceOut]] = {}
    for version in versions:
        grouped.setdefault((version.base_model, version.service_tier.value), []).append(version)
    return [PriceBook(model, tier, tuple(rows)) for (model, tier), rows in grouped.items()]


def speculative_text(model: BaseModelOut) -> str:
    """A base model's speculative config as the JSON text its form field takes ("" when it does not speculate)."""
    if model.speculative_config is None:
        return ""
    return json.dumps(model.speculative_config.model_dump(exclude_none=True))


def reasoning_text(model: BaseModelOut) -> str:
    """A base model's reasoning config as the JSON text its form field takes ("" when it does not reason)."""
    if model.reasoning_config is None:
        return ""
    return json.dumps(model.reasoning_config.model_dump())


def _fields(data: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The form's fields a request body knows (those bodies refuse unknown fields, the CSRF one included)."""
    return {name: data[name] for name in names if name in data and name != CSRF_FIELD}


async def _set_config(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    data: FormData,
    field: str,
    notice: Callable[[BaseModelOut], str],
) -> Template:
    """PATCH one JSON config `field` (speculative_config, reasoning_config) of the form's base model from the form's
    text, a blank text clearing it; a refusal shows on the page as `<kind>_error`, with nothing written."""
    name = str(data.get("name", "")).strip()
    text = data.get(field, "")
    try:
        if isinstance(text, str) and not text.strip():
            body = BaseModelPatch.model_validate({field: None})
        else:
            body = parse_form(BaseModelPatch, {field: text}, labels=MODEL_LABELS)
        updated = await update_base_model(db, resources, name, body)
    except ApiError as exc:
        await db.rollback()
        error = {f"{field.removesuffix('_config')}_error": exc.message}
        return await _page(caller, db, resources, form=data, status_code=exc.status_code, **error)
    return await _page(caller, db, resources, notice=notice(updated))


async def _page(
    caller: ConsoleCaller,
    db: AsyncSession,
    resources: Resources,
    *,
    notice: str | None = None,
    price_error: str | None = None,
    model_error: str | None = None,
    speculative_error: str | None = None,
    reasoning_error: str | None = None,
    form: dict[str, Any] | None = None,
    status_code: int = 200,
) -> Template:
    models = [BaseModelOut.of(row) for row in await BaseModelService(db, resources.model_configs).list()]
    now = datetime.now(UTC)
    versions = PriceOut.history(await BillingService(db).prices(), now)
    return page(
        "admin_models.html",
        caller,
        title=TITLE,
        status_code=status_code,
        models=models,
        speculative={model.name: speculative_text(model) for model in models},
        reasoning={model.name: reasoning_text(model) for model in models},
        books=price_books(versions),
        tiers=[tier.value for tier in TIER_ORDER],
        quantizations=[q.value for q in Quantization],
        now=f"{now:%Y-%m-%dT%H:%M}",
        notice=notice,
        price_error=price_error,
        model_error=model_error,
        speculative_error=speculative_error,
        reasoning_error=reasoning_error,
        form=form or {},
    )


class AdminModelPages(Controller):
    path = "/"

    @get("/models")
    async def index(self, caller: Caller, db: DbSession, resources: AppResources) -> Template:
        return await _page(caller, db, resources)

    @post("/models", status_code=200)
    async def register(self, caller: Caller, db: DbSession, resources: AppResources, data: FormData) -> Template:
        try:
            body = parse_form(BaseModelCreate, _fields(data, BaseModelCreate.model_fields), labels=MODEL_LABELS)
            created = await register_base_model(db, resources, body)
        except ApiError as exc:
            await db.rollback()
            return await _page(caller, db, resources, model_error=exc.message, form=data, status_code=exc.status_code)
        return await _page(caller, db, resources, notice=f"Base model {created.name} registered.", status_code=201)

    @post("/models/speculative", status_code=200)
    async def set_speculative(self, caller: Caller, db: DbSession, resources: AppResources, data: FormData) -> Template:
        """Set a base model's speculative config from the form's JSON text; a blank one turns speculation off."""

        def notice(updated: BaseModelOut) -> str:
            if updated.speculative_config is None:
                return f"Base model {updated.name} no longer speculates."
            return f"Base model {updated.name} speculates by {updated.speculative_config.method}."

        return await _set_config(caller, db, resources, data, "speculative_config", notice)

    @post("/models/reasoning", status_code=200)
    async def set_reasoning(self, caller: Caller, db: DbSession, resources: AppResources, data: FormData) -> Template:
        """Set a base model's reasoning config from the form's JSON text; a blank one makes it no reasoning model."""

        def notice(updated: BaseModelOut) -> str:
            if updated.reasoning_config is None:
                return f"Base model {updated.name} is no reasoning model."
            return f"Base model {updated.name} reasons by the {updated.reasoning_config.parser} parser."

        return await _set_config(caller, db, resources, data, "reasoning_config", notice)

    @post("/prices", status_code=200)
    async def add_price(self, caller: Caller, db: DbSession, resources: AppResources, data: FormData) -> Template:
        try:
            body = parse_form(PriceSet, _fields(data, PriceSet.model_fields), labels=PRICE_LABELS)
            added = await set_price(db, body)
        except ApiError as exc:
            await db.rollback()
            return await _page(caller, db, resources, price_error=exc.message, form=data, status_code=exc.status_code)
        notice = (
            f"{added.base_model} ({added.service_tier.value} tier): {added.input_per_mtok} / "
            f"{added.cached_input_per_mtok} / {added.output_per_mtok} USD per 1M tokens (reasoning "
            f"{added.reasoning_per_mtok}) from {added.effective_at:%Y-%m-%d %H:%M} UTC ({added.status})."
        )
        return await _page(caller, db, resources, notice=notice, status_code=201)
