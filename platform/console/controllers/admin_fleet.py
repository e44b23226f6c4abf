"""The admin's fleet page: the live engine replicas as they last announced themselves (the router's view: base
model, queue, pages, resident adapters), each resident adapter named by the adapters table where it knows the
digest (the same files may be several tenants' adapters), else shown by its short digest."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from litestar import Controller, get
from litestar.response import Template

from loraplex.engine.serve import FleetRecord
from loraplex.platform.console.access import Caller
from loraplex.platform.console.pages import page
from loraplex.platform.dependencies import AppResources, DbSession
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.adapters.service import AdapterService

TITLE = "Fleet"
SHORT_DIGEST = 12  # hex characters shown of an unknown digest


@dataclass(frozen=True, slots=True)
class Resident:
    """An adapter resident on an engine: who it is (empty when no adapter row has the digest) and its digest."""

    names: tuple[str, ...]  # "tenant / adapter vN"
    short_digest: str
    digest: str


@dataclass(frozen=True, slots=True)
class PoolShare:
    """A replica's page pool in percent of its size, for the meter (in use + evictable + free = 100)."""

    used: str
    evictable: str
    free: str


@dataclass(frozen=True, slots=True)
class EngineRow:
    record: FleetRecord
    residents: tuple[Resident, ...]
    pool: PoolShare | None  # None when the engine announced no pool
    age_s: int  # seconds since its last beat


def short_digest(digest: str) -> str:
    _, _, hex_part = digest.partition(":")
    return (hex_part or digest)[:SHORT_DIGEST]


def residents(digests: Iterable[str], named: Mapping[str, Sequence[str]]) -> tuple[Resident, ...]:
    """`digests` (sorted), each with the adapter names `named` gives it; known ones first."""
    rows = [Resident(tuple(named.get(d, ())), short_digest(d), d) for d in sorted(digests)]
    return tuple(sorted(rows, key=lambda r: (not r.names, r.names, r.digest)))


def pool_share(record: FleetRecord) -> PoolShare | None:
    if record.num_pages <= 0:
        return None
    free = min(max(record.free_pages, 0), record.num_pages)
    evictable = min(max(record.evictable_pages, 0), record.num_pages - free)
    used = record.num_pages - free - evictable

    def share(pages: int) -> str:
        return f"{100 * pages / record.num_pages:.2f}"

    return PoolShare(used=share(used), evictable=share(evictable), free=share(free))


def adapter_names(rows: Iterable[tuple[Adapter, str]]) -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    for adapter, tenant_name in rows:
        if adapter.digest is not None:
            named.setdefault(adapter.digest, []).append(f"{tenant_name} / {adapter.name} v{adapter.version}")
    return named


class AdminFleetPages(Controller):
    path = "/fleet"

    @get("/")
    async def index(self, caller: Caller, db: DbSession, resources: AppResources) -> Template:
        replicas = sorted(await resources.fleet.replicas(), key=lambda r: (r.base_model, r.id))
        digests = {digest for replica in replicas for digest in replica.adapters}
        named = adapter_names(await AdapterService(db, resources).list_by_digests(digests))
        now = time.time()
        engines = [
            EngineRow(
                record=replica,
                residents=residents(replica.adapters, named),
                pool=pool_share(replica),
                age_s=max(0, round(now - replica.updated_at)),
            )
            for replica in replicas
        ]
        return page("admin_fleet.html", caller, title=TITLE, engines=engines)
