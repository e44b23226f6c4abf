"""Every query on the jobs table. A claim is a conditional UPDATE (the row must still be claimable as it was read),
so two workers never both take a job, on Postgres (whose read also skips rows another claim has locked) and on the
embedded SQLite alike; every later write by a worker names its claim and does nothing once the claim is lost."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.jobs.models import CANCELLED, QUEUED, RUNNING, Job


def _claimable(now: datetime) -> Any:
    """Queued and due, or running under a lease that has run out (its replica stopped)."""
    return or_(
        and_(Job.status == QUEUED, Job.run_after <= now),
        and_(Job.status == RUNNING, Job.lease_until < now),
    )


class JobRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(self, job: Job) -> None:
        self.session.add(job)

    async def get(self, job_id: str) -> Job | None:
        return await self.session.get(Job, job_id, populate_existing=True)

    async def claim(self, kinds: list[str], worker: str, now: datetime, lease_s: float, limit: int) -> list[Job]:
        """Up to `limit` claimable jobs of `kinds`, oldest first, now leased to `worker` (each claim counts an
        attempt)."""
        query = (
            select(Job.id, Job.attempts)
            .where(Job.kind.in_(kinds), _claimable(now))
            .order_by(Job.created_at)
            .limit(limit)
        )
        if self.session.get_bind().dialect.name == "postgresql":
            query = query.with_for_update(skip_locked=True)
        seen = (await self.session.execute(query)).all()
        claimed: list[str] = []
        for job_id, attempts in seen:
            result = await self.session.execute(
                update(Job)
                .where(Job.id == job_id, Job.attempts == attempts, _claimable(now))
                .values(
                    status=RUNNING,
                    claimed_by=worker,
                    lease_until=now + timedelta(seconds=lease_s),
                    attempts=attempts + 1,
                    updated_at=now,
                )
            )
            if getattr(result, "rowcount", 0):
                claimed.append(job_id)
        jobs = [await self.get(job_id) for job_id in claimed]
        return [job for job in jobs if job is not None]

    def _held(self, job_id: str, worker: str) -> Any:
        return update(Job).where(Job.id == job_id, Job.claimed_by == worker, Job.status == RUNNING)

    async def renew(self, job_id: str, worker: str, now: datetime, lease_s: float) -> bool:
        """Extend `worker`'s lease; False when it holds the job no more (cancelled, or claimed by another after
        the lease ran out)."""
        result = await self.session.execute(
            self._held(job_id, worker).values(lease_until=now + timedelta(seconds=lease_s), updated_at=now)
        )
        return bool(getattr(result, "rowcount", 0))

    async def end(
        self, job_id: str, worker: str, status: str, now: datetime, error: dict[str, Any] | None = None
    ) -> bool:
        """The job ended as `status`, if `worker` still holds it."""
        result = await self.session.execute(
            self._held(job_id, worker).values(status=status, error=error, lease_until=None, updated_at=now)
        )
        return bool(getattr(result, "rowcount", 0))

    async def put_back(self, job_id: str, worker: str, now: datetime, delay_s: float, *, attempt: bool) -> bool:
        """Queue the job again, due in `delay_s`; unless `attempt`, the claim does not count as one (the job could
        not start, or its replica is stopping)."""
        values: dict[str, Any] = {
            "status": QUEUED,
            "claimed_by": None,
            "lease_until": None,
            "run_after": now + timedelta(seconds=delay_s),
            "updated_at": now,
        }
        if not attempt:
            values["attempts"] = Job.attempts - 1
        result = await self.session.execute(self._held(job_id, worker).values(**values))
        return bool(getattr(result, "rowcount", 0))

    async def cancel(self, job_id: str, now: datetime) -> bool:
        """Cancel a job that has not ended; whether it had not."""
        result = await self.session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_((QUEUED, RUNNING)))
            .values(status=CANCELLED, lease_until=None, updated_at=now)
        )
        return bool(getattr(result, "rowcount", 0))
