"""Background responses (`background: true`): admitted as any response (limits, the tenant's concurrency lease),
stored queued and answered at once, then run by this process while the client polls GET /v1/responses/{id}. The
running replica beats the row's `heartbeat_at`; a response whose beat is older than STALE_S (its replica stopped)
reads as failed. POST /v1/responses/{id}/cancel stops the task where it runs in this process, and otherwise marks
the row cancelled, which a replica that finishes it later does not overwrite."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from datetime import datetime, timedelta
from typing import Any

from loraplex.platform.concurrency import HeldLease
from loraplex.platform.db.base import utcnow
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnavailable
from loraplex.platform.domain.responses.models import StoredResponse
from loraplex.platform.domain.responses.repository import RUNNING, ResponseRepository
from loraplex.platform.errors import ApiError

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
STALE_S = 30.0


class BackgroundRuns:
    """The background responses this process runs, by id."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    async def cancel(self, response_id: str) -> bool:
        """Cancel the response's task if this process runs it, and wait for it to write that; whether it did."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stale(row: StoredResponse, now: datetime) -> bool:
    """A background response still marked running whose replica has stopped beating."""
    beat = row.heartbeat_at or row.created_at
    return row.status in RUNNING and beat < now - timedelta(seconds=STALE_S)


def ended(response: dict[str, Any], status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
    return {**response, "status": status, "error": error}


async def write(sessions: Any, response_id: str, response: dict[str, Any], *, unless_ended: bool = True) -> bool:
    async with sessions() as session:
        written = await ResponseRepository(session).finish(response_id, response, unless_ended=unless_ended)
        await session.commit()
    return written


async def _heartbeat(sessions: Any, response_id: str) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        with contextlib.suppress(Exception):  # a missed beat is a later one; a stopped replica misses them all
            async with sessions() as session:
                await ResponseRepository(session).beat(response_id, utcnow())
                await session.commit()


async def run(
    sessions: Any,
    response_id: str,
    queued: dict[str, Any],
    answer: Coroutine[Any, Any, dict[str, Any]],
    lease: HeldLease,
    record: Coroutine[Any, Any, None],
) -> None:
    """Run `answer` (the whole response, as the platform writes it) for the stored `queued` response, writing its
    states; `record` writes the usage whatever happens; the lease is released at the end."""
    beat = asyncio.create_task(_heartbeat(sessions, response_id))
    try:
        await write(sessions, response_id, ended(queued, "in_progress"))
        try:
            response = await answer
        except asyncio.CancelledError:
            await asyncio.shield(write(sessions, response_id, ended(queued, "cancelled")))
            return
        except (ApiError, EngineRequestError, EngineUnavailable) as exc:
            message = exc.message if isinstance(exc, ApiError) else "The engine could not run this response."
            code = exc.code if isinstance(exc, ApiError) else "engine_unavailable"
            await write(
                sessions, response_id, ended(queued, "failed", {"code": code or "server_error", "message": message})
            )
            return
        except Exception:
            logger.exception("background response %s failed", response_id)
            error = {"code": "server_error", "message": "The server had an error while running this response."}
            await write(sessions, response_id, ended(queued, "failed", error))
            return
        await write(sessions, response_id, response)
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        await asyncio.shield(record)
        await asyncio.shield(lease.release())
