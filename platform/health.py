"""Liveness and readiness. /readyz checks every dependency this process needs, each with a deadline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Controller, Response, get
from sqlalchemy import text

from loraplex.platform.dependencies import AppResources

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 3.0


async def _check(name: str, probe: Callable[[], Awaitable[Any]]) -> tuple[str, str]:
    try:
        await asyncio.wait_for(probe(), timeout=CHECK_TIMEOUT_S)
    except Exception as exc:  # a readiness probe reports every failure, whatever its type
        logger.warning("readiness check %s failed: %s", name, exc)
        return name, f"error: {type(exc).__name__}: {exc}"[:300]
    return name, "ok"


class HealthController(Controller):
    path = "/"
    tags = ["operations"]
    include_in_schema = True

    @get("/healthz", summary="Liveness: the process is serving")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/readyz", summary="Readiness: database, Redis and object store answer")
    async def readyz(self, resources: AppResources) -> Response[dict[str, Any]]:
        async def database() -> None:
            async with resources.db_engine.connect() as connection:
                await connection.execute(text("SELECT 1"))

        results = dict(
            await asyncio.gather(
                _check("database", database),
                _check("redis" if resources.settings.redis_url else "kv (in-process)", resources.kv.ping),
                _check("object_store", resources.objects.check),
            )
        )
        ready = all(value == "ok" for value in results.values())
        body = {"status": "ready" if ready else "unavailable", "checks": results}
        return Response(body, status_code=200 if ready else 503)
