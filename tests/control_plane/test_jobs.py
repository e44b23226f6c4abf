"""The jobs table and its worker (platform/jobs, decision 0049) on a real migrated database, Postgres and the
embedded SQLite: a job is claimed by one worker only, a lease that runs out lets another worker take the job and
the first one's writes do nothing, a job put back waits and costs no attempt, a cancelled one is never claimed; the
worker ends each job with what its handler did, puts its jobs back when it stops, tells a handler why it was
cancelled (cancelled, lost, stopping), and gives up a job whose runs kept stopping."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _support import services
from _support.waiting import wait_for_async
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.db.migrate import upgrade
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.jobs.models import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, Job
from loraplex.platform.jobs.repository import JobRepository
from loraplex.platform.jobs.worker import Deferred, JobContext, JobFailed, JobWorker, Stop

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(
    params=[pytest.param("postgres", marks=pytest.mark.integration), pytest.param("sqlite", marks=pytest.mark.unit)]
)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Sessions, uuid.UUID]]:
    """Sessions on a migrated database, and a tenant in it (jobs belong to one)."""
    database: str | None = None
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        database = f"t_{request.getfixturevalue('session_tag')}_{secrets.token_hex(4)}"
        await services.create_database(server.url, database)
        url = services.database_url_for(server.url, database)
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'jobs.sqlite'}"
    engine = create_engine(url)
    try:
        await upgrade(engine)
        sessions = create_session_factory(engine)
        tenant_id = uuid.uuid4()
        async with sessions() as session:
            session.add(Tenant(id=tenant_id, name=f"jobs-{tenant_id.hex[:6]}"))
            await session.commit()
        yield sessions, tenant_id
    finally:
        await engine.dispose()
        if database is not None:
            await services.drop_database(server.url, database)


async def _add(sessions: Sessions, tenant_id: uuid.UUID, count: int, kind: str = "test", **fields: Any) -> list[str]:
    ids = [f"job_{uuid.uuid4().hex[:12]}" for _ in range(count)]
    async with sessions() as session:
        for index, job_id in enumerate(ids):
            now = utcnow() + timedelta(microseconds=index)  # created in this order
            values = {"payload": {"n": index}, "created_at": now, "run_after": now, **fields}
            JobRepository(session).add(Job(id=job_id, kind=kind, tenant_id=tenant_id, **values))
        await session.commit()
    return ids


async def _do(sessions: Sessions, name: str, *args: Any, **kwargs: Any) -> Any:
    async with sessions() as session:
        result = await getattr(JobRepository(session), name)(*args, **kwargs)
        await session.commit()
    return result


async def _job(sessions: Sessions, job_id: str) -> Job:
    async with sessions() as session:
        job = await JobRepository(session).get(job_id)
    assert job is not None
    return job


async def test_a_job_is_claimed_by_one_worker_only(db: tuple[Sessions, uuid.UUID]) -> None:
    sessions, tenant_id = db
    ids = await _add(sessions, tenant_id, 6)
    await _add(sessions, tenant_id, 2, kind="other")  # no worker here handles it
    now = utcnow()
    first, second = await asyncio.gather(
        _do(sessions, "claim", ["test"], "w1", now, 30.0, 6), _do(sessions, "claim", ["test"], "w2", now, 30.0, 6)
    )
    mine, theirs = {job.id for job in first}, {job.id for job in second}
    assert not mine & theirs and mine | theirs == set(ids)
    for job in (*first, *second):
        assert job.status == RUNNING and job.attempts == 1 and job.claimed_by in ("w1", "w2")
    assert await _do(sessions, "claim", ["test"], "w3", now, 30.0, 6) == []  # all held
    oldest = await _do(sessions, "claim", ["other"], "w3", now, 30.0, 1)
    assert [job.payload["n"] for job in oldest] == [0]  # oldest first


async def test_a_lapsed_lease_passes_to_another_worker_and_the_first_can_no_longer_write(
    db: tuple[Sessions, uuid.UUID],
) -> None:
    sessions, tenant_id = db
    (job_id,) = await _add(sessions, tenant_id, 1)
    now = utcnow()
    assert [job.id for job in await _do(sessions, "claim", ["test"], "w1", now, 30.0, 5)] == [job_id]
    assert await _do(sessions, "renew", job_id, "w1", now + timedelta(seconds=20), 30.0)
    assert await _do(sessions, "claim", ["test"], "w2", now + timedelta(seconds=40), 30.0, 5) == []  # renewed
    later = now + timedelta(seconds=51)
    (taken,) = await _do(sessions, "claim", ["test"], "w2", later, 30.0, 5)
    assert taken.claimed_by == "w2" and taken.attempts == 2
    assert not await _do(sessions, "renew", job_id, "w1", later, 30.0)
    assert not await _do(sessions, "end", job_id, "w1", SUCCEEDED, later)
    assert not await _do(sessions, "put_back", job_id, "w1", later, 0.0, attempt=False)
    assert await _do(sessions, "end", job_id, "w2", SUCCEEDED, later)
    assert (await _job(sessions, job_id)).status == SUCCEEDED
    assert await _do(sessions, "claim", ["test"], "w3", later + timedelta(hours=1), 30.0, 5) == []  # ended


async def test_a_job_put_back_waits_and_costs_no_attempt_and_a_cancelled_one_is_never_claimed(
    db: tuple[Sessions, uuid.UUID],
) -> None:
    sessions, tenant_id = db
    back, cancelled = await _add(sessions, tenant_id, 2)
    now = utcnow()
    assert len(await _do(sessions, "claim", ["test"], "w1", now, 30.0, 5)) == 2
    assert await _do(sessions, "put_back", back, "w1", now, 10.0, attempt=False)
    job = await _job(sessions, back)
    assert job.status == QUEUED and job.attempts == 0 and job.claimed_by is None
    assert await _do(sessions, "claim", ["test"], "w2", now + timedelta(seconds=5), 30.0, 5) == []  # not due
    assert await _do(sessions, "cancel", cancelled, now)
    assert not await _do(sessions, "renew", cancelled, "w1", now, 30.0)
    assert not await _do(sessions, "cancel", cancelled, now)  # once
    (due,) = await _do(sessions, "claim", ["test"], "w2", now + timedelta(hours=1), 30.0, 5)
    assert due.id == back and due.attempts == 1
    assert (await _job(sessions, cancelled)).status == CANCELLED


class Recorder:
    """A handler whose jobs do what their payload says: "ok", "fail", "raise", "defer-once" or "wait" (until
    cancelled); it keeps each run's context."""

    kind = "test"

    def __init__(self) -> None:
        self.runs: dict[str, list[JobContext]] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.given_up: list[str] = []

    def started_event(self, job_id: str) -> asyncio.Event:
        return self.started.setdefault(job_id, asyncio.Event())

    async def run(self, job: Job, context: JobContext) -> None:
        self.runs.setdefault(job.id, []).append(context)
        self.started_event(job.id).set()
        action = job.payload["do"]
        if action == "fail":
            raise JobFailed("bad_input", "line 3 is not JSON")
        if action == "raise":
            raise RuntimeError("a bug")
        if action == "defer-once" and len(self.runs[job.id]) == 1:
            raise Deferred(0.05)
        if action == "wait":
            await asyncio.Event().wait()

    async def give_up(self, job: Job) -> None:
        self.given_up.append(job.id)


async def _add_doing(sessions: Sessions, tenant_id: uuid.UUID, action: str, **fields: Any) -> str:
    (job_id,) = await _add(sessions, tenant_id, 1, payload={"do": action}, **fields)
    return job_id


async def _ended(sessions: Sessions, job_id: str, status: str) -> Job:
    async def check() -> Job | None:
        job = await _job(sessions, job_id)
        return job if job.status == status else None

    return await wait_for_async(check, what=f"job {job_id} {status}")


async def test_the_worker_ends_each_job_as_its_handler_did(db: tuple[Sessions, uuid.UUID]) -> None:
    sessions, tenant_id = db
    handler = Recorder()
    worker = JobWorker(sessions, [handler], lease_s=3.0, poll_s=0.05, name="w")
    worker.start()
    try:
        ok = await _add_doing(sessions, tenant_id, "ok")
        failed = await _add_doing(sessions, tenant_id, "fail")
        broken = await _add_doing(sessions, tenant_id, "raise")
        deferred = await _add_doing(sessions, tenant_id, "defer-once")
        worker.nudge()
        assert (await _ended(sessions, ok, SUCCEEDED)).attempts == 1
        assert (await _ended(sessions, failed, FAILED)).error == {"code": "bad_input", "message": "line 3 is not JSON"}
        assert (await _ended(sessions, broken, FAILED)).error == {"code": "server_error", "message": "the job failed"}
        # Deferred: run again once due, and the deferral was not an attempt
        assert (await _ended(sessions, deferred, SUCCEEDED)).attempts == 1 and len(handler.runs[deferred]) == 2
        # A job whose runs kept stopping (claimed max_attempts times, its last lease lapsed) is given up.
        lapsed = utcnow() - timedelta(seconds=1)
        stopped = await _add_doing(sessions, tenant_id, "ok", status=RUNNING, attempts=3, lease_until=lapsed)
        worker.nudge()
        assert (await _ended(sessions, stopped, FAILED)).error["code"] == "gave_up"  # type: ignore[index]
        assert handler.given_up == [stopped] and stopped not in handler.runs
    finally:
        await worker.close()


async def test_the_worker_tells_its_handler_why_it_stops_it(db: tuple[Sessions, uuid.UUID]) -> None:
    sessions, tenant_id = db
    handler = Recorder()
    worker = JobWorker(sessions, [handler], lease_s=0.6, poll_s=0.05, name="w")
    worker.start()
    cancelled = await _add_doing(sessions, tenant_id, "wait")
    lost = await _add_doing(sessions, tenant_id, "wait")
    stopping = await _add_doing(sessions, tenant_id, "wait")
    worker.nudge()
    for job_id in (cancelled, lost, stopping):
        await asyncio.wait_for(handler.started_event(job_id).wait(), 15)
    # Cancelled where it runs: the handler stops now and learns why.
    assert await _do(sessions, "cancel", cancelled, utcnow())
    assert await worker.interrupt(cancelled) and not worker.runs(cancelled)
    assert handler.runs[cancelled][0].stop is Stop.CANCELLED
    # Its lease taken by another worker (this one seemed gone): found at its next renewal.
    async with sessions() as session:
        job = await JobRepository(session).get(lost)
        assert job is not None
        job.lease_until = utcnow() - timedelta(seconds=1)
        await session.commit()
    assert [job.id for job in await _do(sessions, "claim", ["test"], "other", utcnow(), 60.0, 1)] == [lost]

    async def lost_it() -> bool:
        return not worker.runs(lost)

    await wait_for_async(lost_it, what="the worker to drop the job it lost")
    assert handler.runs[lost][0].stop is Stop.LOST and (await _job(sessions, lost)).claimed_by == "other"
    # The replica stops: its job goes back to the queue, costing no attempt, for another worker.
    await worker.close()
    assert handler.runs[stopping][0].stop is Stop.STOPPING
    job = await _job(sessions, stopping)
    assert job.status == QUEUED and job.attempts == 0 and job.claimed_by is None
    assert (await _job(sessions, cancelled)).status == CANCELLED
