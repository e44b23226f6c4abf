"""What the engine server's protocol routes share: a chat stream written as the protocol's events (one write per
chunk, whatever events it makes: a write costs more than the events), a failure after the start told in the
stream, and the streamed response whose end closes the engine requests."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from pydantic import BaseModel

from loraplex.engine.errors import EngineError
from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.jobs import Job

logger = logging.getLogger(__name__)


class EventWriter(Protocol):
    """A protocol's writing of a chat stream: the text of one chat chunk's events, of the end, of a failure."""

    def feed(self, chunk: dict[str, object]) -> str: ...

    def end(self) -> str: ...

    def failed(self, exc: BaseException) -> str: ...


async def written(job: Job, chunks: AsyncGenerator[BaseModel, None], writer: EventWriter) -> AsyncGenerator[str, None]:
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield writer.feed(chunk.model_dump(exclude_none=True))
        yield writer.end()
    except Exception as exc:  # the response has begun: the error can only be told in the stream
        if not isinstance(exc, EngineError | ApiError):
            logger.exception("%s: the stream failed", job.response_id)
        yield writer.failed(exc)


def event_stream(job: Job, body: AsyncGenerator[str, None], headers: dict[str, str] | None = None) -> Stream:
    async def close() -> None:
        # Litestar does not close an iterator it stops reading: closing it here aborts the engine requests now.
        await body.aclose()
        job.close()

    return Stream(
        body,
        media_type="text/event-stream",
        headers={**(headers or {}), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(close),
    )
