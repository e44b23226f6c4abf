"""HTTP for the fleet: GET /admin/engines lists the live engine replicas and their load."""

from __future__ import annotations

from typing import Any

from litestar import Controller, get

from loraplex.platform.dependencies import AppResources


class AdminEngineController(Controller):
    path = "/engines"
    tags = ["admin: fleet"]

    @get("/", summary="Live engine replicas: base model, resident adapters, free pages, queue")
    async def list(self, resources: AppResources) -> dict[str, Any]:
        replicas = await resources.fleet.replicas()
        return {"object": "list", "data": [r.to_json() for r in replicas]}
