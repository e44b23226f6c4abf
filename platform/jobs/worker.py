"""The job worker every platform replica runs: it claims due jobs of the kinds it has handlers for (up to its
concurrency), runs each under a lease it renews every third of the lease, and ends the job with what its handler
did. A job whose lease is lost (cancelled, or taken by another worker after this one stalled) has its handler
cancelled; a replica that stops puts its jobs back for another one, and one that dies leaves them to be claimed
again when their leases run out. A job claimed more than `max_attempts` times is given up (its handler says how)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.platform.db.base import utcnow
from loraplex.platform.jobs.models import CANCELLED, FAILED, SUCCEEDED, Job
from loraplex.platform.jobs.repository import JobRepository

logger = logging.getLogger(__name__)


class Stop(enum.StrEnum):
    """Why a running job's handler was cancelled."""

    CANCELLED = "cancelled"  # the job was cancelled (by its owner)
    LOST = "lost"  # another worker holds it now: this one's lease ran out
    STOPPING = "stopping"  # this replica is stopping: the job goes back to the queue


@dataclass
class JobContext:
    stop: Stop | None = None  # set before the handler is cancelled


class Deferred(Exception):
    """Raised by a handler that cannot start the job now (its tenant is at its concurrency cap): the job is queued
    again, due in `delay_s`, and the claim does not count as an attempt."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"deferred {delay_s} s")
        self.delay_s = delay_s


class JobFailed(Exception):
    """A handler's failure with what the job's row should say (`error`: code and message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error = {"code": code, "message": message}


class Handler(Protocol):
    kind: str

    async def run(self, job: Job, context: JobContext) -> None:
        """Do the job. Returns when it is done, raises `Deferred`, `JobFailed`, or anything (a failure)."""

    async def give_up(self, job: Job) -> None:
        """The job was claimed `max_attempts` times and never finished (its replicas stopped)."""


@dataclass
class _Running:
    task: asyncio.Task[None]
    context: JobContext


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class JobWorker:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        handlers: Sequence[Handler],
        *,
        lease_s: float = 30.0,
        poll_s: float = 1.0,
        concurrency: int = 16,
        name: str | None = None,
    ) -> None:
        self.sessions = sessions
        self.handlers = {handler.kind: handler for handler in handlers}
        self.lease_s, self.poll_s, self.concurrency = lease_s, poll_s, concurrency
        self.name = name or worker_name()
        self._running: dict[str, _Running] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.create_task(self._claim_loop())

    def nudge(self) -> None:
        """A job was queued: look now rather than at the next poll."""
        self._wake.set()

    def runs(self, job_id: str) -> bool:
        return job_id in self._running

    async def interrupt(self, job_id: str) -> bool:
        """Cancel the handler of a job this worker runs (its job was just cancelled) and wait for it to end; whether
        it ran here."""
        running = self._running.get(job_id)
        if running is None:
            return False
        running.context.stop = Stop.CANCELLED
        running.task.cancel()
        await asyncio.gather(running.task, return_exceptions=True)
        return True

    async def close(self) -> None:
        """Stop claiming, and put back every job running here (their handlers are cancelled as stopping)."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        running = list(self._running.values())
        for job in running:
            job.context.stop = Stop.STOPPING
            job.task.cancel()
        await asyncio.gather(*(job.task for job in running), return_exceptions=True)

    async def _claim_loop(self) -> None:
        while True:
            self._wake.clear()
            free = self.concurrency - len(self._running)
            if free > 0 and self.handlers:
                try:
                    async with self.sessions() as session:
                        jobs = await JobRepository(session).claim(
                            list(self.handlers), self.name, utcnow(), self.lease_s, free
                        )
                        await session.commit()
                except Exception:
                    logger.exception("could not claim jobs")
                    jobs = []
                for job in jobs:
                    context = JobContext()
                    task = asyncio.create_task(self._execute(job, context))
                    self._running[job.id] = _Running(task, context)  # before the task first runs
                    task.add_done_callback(self._forget(job.id))
                if len(jobs) == free:
                    continue  # there may be more due
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)

    def _forget(self, job_id: str) -> Callable[[asyncio.Task[None]], object]:
        return lambda _: self._running.pop(job_id, None)

    async def _write(self, name: str, *args: Any, **kwargs: Any) -> bool:
        async with self.sessions() as session:
            done = await getattr(JobRepository(session), name)(*args, **kwargs)
            await session.commit()
        return bool(done)

    async def _execute(self, job: Job, context: JobContext) -> None:
        handler = self.handlers[job.kind]
        if job.attempts > job.max_attempts:
            with contextlib.suppress(Exception):
                await handler.give_up(job)
            await asyncio.shield(self._ended(job, FAILED, {"code": "gave_up", "message": "its runs kept stopping"}))
            return
        work = asyncio.create_task(handler.run(job, context))
        renewal = asyncio.create_task(self._renew(job, work, context))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if not work.done():  # cancelled from outside (interrupt, close): the handler is told why
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            if context.stop is Stop.STOPPING:
                await asyncio.shield(self._safely("put_back", job.id, self.name, utcnow(), 0.0, attempt=False))
            # CANCELLED: the job's row says so already; LOST: another worker has it
        except Deferred as deferred:
            await asyncio.shield(self._safely("put_back", job.id, self.name, utcnow(), deferred.delay_s, attempt=False))
            self._wake_later(deferred.delay_s)
        except JobFailed as failed:
            await asyncio.shield(self._ended(job, FAILED, failed.error))
        except Exception:
            logger.exception("job %s (%s) failed", job.id, job.kind)
            await asyncio.shield(self._ended(job, FAILED, {"code": "server_error", "message": "the job failed"}))
        else:
            await asyncio.shield(self._ended(job, SUCCEEDED))
        finally:
            renewal.cancel()
            await asyncio.gather(renewal, return_exceptions=True)

    async def _ended(self, job: Job, status: str, error: dict[str, Any] | None = None) -> None:
        await self._safely("end", job.id, self.name, status, utcnow(), error)

    async def _safely(self, name: str, *args: Any, **kwargs: Any) -> None:
        try:
            await self._write(name, *args, **kwargs)
        except Exception:  # its lease runs out, and another worker takes it up
            logger.exception("job %s: could not write its state", args[0])

    def _wake_later(self, delay_s: float) -> None:
        asyncio.get_running_loop().call_later(delay_s, self._wake.set)

    async def _renew(self, job: Job, work: asyncio.Task[None], context: JobContext) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                held = await self._write("renew", job.id, self.name, utcnow(), self.lease_s)
            except Exception:  # a missed renewal; the lease has two more thirds
                logger.warning("job %s: could not renew its lease", job.id)
                continue
            if held:
                continue
            async with self.sessions() as session:
                row = await JobRepository(session).get(job.id)
            context.stop = Stop.CANCELLED if row is None or row.status == CANCELLED else Stop.LOST
            work.cancel()
            return
