"""What a completion reads of the configuration: the target its `model` names and its tenant's terms. Read from the
database once and then served from this process's `ConfigCache` until a change to those rows (decision 0035).

Cached values hold rows read by sessions that are closed since (detached ORM objects): nothing on the request path
may change them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.config_cache import CacheTable, ConfigCache
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.adapters.repository import AdapterRepository
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.endpoints.models import Endpoint
from loraplex.platform.domain.endpoints.repository import EndpointRepository
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.tenants.repository import TenantRepository
from loraplex.platform.errors import ApiError
from loraplex.platform.ids import TenantId
from loraplex.platform.ratelimit import Limits
from loraplex.platform.service_tiers import ServiceTier
from loraplex.platform.settings import Settings


@dataclass(frozen=True, slots=True)
class Target:
    """What `model` names for this tenant."""

    model: str  # as the client wrote it
    base_model: BaseModel
    endpoint: Endpoint | None = None
    adapter: Adapter | None = None


@dataclass(frozen=True, slots=True)
class TenantTerms:
    """What the tenant's record says about serving its requests, each value what an admin set, else the platform's
    default."""

    limits: Limits  # per minute, the whole tenant
    key_limits: Limits  # per minute, each API key (default: the tenant's whole budget)
    max_concurrent_requests: int  # in flight at once, across the platform
    fairness_weight: float  # the tenant's weight in the engines' fair share
    service_tiers: list[ServiceTier]  # what `service_tier` may name

    @classmethod
    def of(cls, tenant: Tenant | None, settings: Settings) -> TenantTerms:
        """The terms of `tenant` (None: deleted since its key was cached, so the defaults)."""
        requests = (tenant.requests_per_minute if tenant else None) or settings.default_requests_per_minute
        tokens = (tenant.tokens_per_minute if tenant else None) or settings.default_tokens_per_minute
        key_requests = (tenant.key_requests_per_minute if tenant else None) or requests
        key_tokens = (tenant.key_tokens_per_minute if tenant else None) or tokens
        cap = (tenant.max_concurrent_requests if tenant else None) or settings.default_max_concurrent_requests
        return cls(
            limits=Limits(requests, tokens),
            key_limits=Limits(key_requests, key_tokens),
            max_concurrent_requests=cap,
            fairness_weight=tenant.fairness_weight if tenant else 1.0,
            service_tiers=(
                tenant.allowed_service_tiers(settings.default_service_tiers)
                if tenant
                else list(settings.default_service_tiers)
            ),
        )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


class CompletionLookups:
    """The cached reads of the completions path; one per process (in `Resources`)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], settings: Settings, cache: ConfigCache) -> None:
        self._sessions = sessions
        self._settings = settings
        self._cache = cache
        self._targets: CacheTable[tuple[TenantId, str], Target] = cache.table()
        self._terms: CacheTable[TenantId, TenantTerms] = cache.table()

    async def target(self, tenant_id: TenantId, model: str) -> Target:
        """An endpoint of this tenant by name, else a base model by name; anything else (another tenant's endpoint
        included) is 404 model_not_found, which is not cached."""
        known = self._targets.get((tenant_id, model))
        if known is not None:
            return known
        fill = self._cache.fill()
        async with self._sessions() as session:
            target = await _read_target(session, tenant_id, model)
        self._targets.put((tenant_id, model), target, fill)
        return target

    async def terms(self, tenant_id: TenantId) -> TenantTerms:
        known = self._terms.get(tenant_id)
        if known is not None:
            return known
        fill = self._cache.fill()
        async with self._sessions() as session:
            tenant = await TenantRepository(session).get(tenant_id)
        terms = TenantTerms.of(tenant, self._settings)
        self._terms.put(tenant_id, terms, fill)
        return terms


async def _read_target(session: AsyncSession, tenant_id: TenantId, model: str) -> Target:
    endpoint = await EndpointRepository(session).get_by_name(model, tenant_id)
    base_models = BaseModelRepository(session)
    if endpoint is not None:
        base = await base_models.get(endpoint.base_model_id)
        adapter = None
        if endpoint.adapter_id is not None:
            adapter = await AdapterRepository(session).get_readable_by_id(endpoint.adapter_id, tenant_id)
        if base is None or (endpoint.adapter_id is not None and adapter is None):
            raise model_not_found(model)
        return Target(model=model, base_model=base, endpoint=endpoint, adapter=adapter)
    base = await base_models.get_by_name(model)
    if base is None:
        raise model_not_found(model)
    return Target(model=model, base_model=base)
