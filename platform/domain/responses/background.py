"""Background responses (`background: true`) as jobs (platform/jobs): the request is admitted as any response
(limits and the tenant's concurrency lease, so what would be refused is refused at once), stored queued with its
job in one transaction and answered; then a worker in any replica runs it while the client polls
GET /v1/responses/{id}, holding one of its tenant's concurrency slots for as long as it runs (a tenant at its cap
waits for a slot rather than failing). A run whose replica stops is started again by another (the response reads
in_progress meanwhile); after `max_attempts` runs that never ended it reads failed. POST /v1/responses/{id}/cancel
marks the response and its job cancelled; the worker running it stops within a third of its lease (at once in the
replica that took the cancel) and bills what it ran. A run that stops without ending bills nothing: its rerun, under
the same id, is the one billed."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.concurrency import HeldLease
from loraplex.platform.db.base import utcnow
from loraplex.platform.domain.completions.service import record_usage
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnavailable
from loraplex.platform.domain.responses.repository import RUNNING, ResponseRepository
from loraplex.platform.errors import ApiError
from loraplex.platform.ids import ApiKeyId, TenantId
from loraplex.platform.jobs.models import Job
from loraplex.platform.jobs.worker import Deferred, JobContext, JobFailed, Stop

if TYPE_CHECKING:
    from loraplex.platform.resources import Resources

logger = logging.getLogger(__name__)

KIND = "response"
AT_CAP_RETRY_S = 0.5  # a tenant at its concurrency cap: the run waits this long for a slot, then asks again


def ended(response: dict[str, Any], status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
    return {**response, "status": status, "error": error}


async def write(sessions: Any, response_id: str, response: dict[str, Any]) -> bool:
    """Write a background response's new state, unless it has ended (a cancel that came first stays)."""
    async with sessions() as session:
        written = await ResponseRepository(session).finish(response_id, response)
        await session.commit()
    return written


def job_payload(principal: TenantPrincipal, request: dict[str, Any]) -> dict[str, Any]:
    """What a worker needs to run the response again from nothing: the key it was asked with and the request."""
    return {"key_id": str(principal.key_id), "request": request}


class BackgroundResponses:
    """The job handler of background responses."""

    kind = KIND

    def __init__(self, resources: Resources) -> None:
        self.resources = resources

    async def run(self, job: Job, context: JobContext) -> None:
        from loraplex.platform.domain.responses import controllers  # the create path's preparation

        resources = self.resources
        principal = TenantPrincipal(TenantId(job.tenant_id), ApiKeyId(job.payload["key_id"]))
        async with resources.sessions() as session:
            row = await ResponseRepository(session).get(principal.tenant_id, job.id, utcnow())
        if row is None or row.status not in RUNNING:  # deleted, expired or cancelled before it ran
            return
        queued = row.response
        try:
            prepared = await controllers.prepared_background(resources, principal, job.id, job.payload["request"])
        except ApiError as exc:  # what has changed since it was admitted (its endpoint deleted, say)
            await write(resources.sessions, job.id, ended(queued, "failed", _error(exc)))
            raise JobFailed(exc.code or "invalid_request", exc.message) from None
        call = prepared.call
        decision = await resources.leases.acquire(str(principal.tenant_id), cap=prepared.cap)
        if decision.lease is None:
            raise Deferred(AT_CAP_RETRY_S)
        lease = HeldLease(resources.leases, decision.lease)
        try:
            await write(resources.sessions, job.id, ended(queued, "in_progress"))
            try:
                response = await prepared.answer(resources)
            except asyncio.CancelledError:
                if context.stop is Stop.CANCELLED:  # billed for what it ran; the cancel wrote the row
                    await asyncio.shield(record_usage(resources, call))
                raise
            except (ApiError, EngineRequestError, EngineUnavailable) as exc:
                error = _error(exc)
                await record_usage(resources, call)
                await write(resources.sessions, job.id, ended(queued, "failed", error))
                raise JobFailed(error["code"], error["message"]) from None
            # Billed before the response is written: a replica that stops between the two leaves a rerun whose usage
            # row (the same id) is not written twice, rather than an answer never billed.
            await record_usage(resources, call)
            await write(resources.sessions, job.id, response)
        finally:
            await asyncio.shield(lease.release())

    async def give_up(self, job: Job) -> None:
        async with self.resources.sessions() as session:
            row = await ResponseRepository(session).get(TenantId(job.tenant_id), job.id, utcnow())
        if row is not None:
            error = {"code": "server_error", "message": "The servers running this response stopped; create it again."}
            await write(self.resources.sessions, job.id, ended(row.response, "failed", error))


def _error(exc: ApiError | EngineRequestError | EngineUnavailable) -> dict[str, str]:
    if isinstance(exc, ApiError):
        return {"code": exc.code or "server_error", "message": exc.message}
    return {"code": "engine_unavailable", "message": "The engine could not run this response."}
