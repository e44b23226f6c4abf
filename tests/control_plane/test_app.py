"""The app shell: health, readiness, OpenAPI, and the two error shapes (OpenAI's on /v1, problem details elsewhere)."""

from __future__ import annotations

from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from loraplex.platform.kv import RedisStore
from loraplex.platform.resources import Resources

pytestmark = pytest.mark.integration


class TestHealth:
    async def test_healthz(self, client: AsyncTestClient[Litestar]) -> None:
        response = await client.get("/healthz")
        assert response.status_code == 200
        assert response.json() == {"status": "ok"}

    async def test_readyz_checks_every_dependency(self, client: AsyncTestClient[Litestar]) -> None:
        response = await client.get("/readyz")
        assert response.status_code == 200, response.text
        assert response.json() == {
            "status": "ready",
            "checks": {"database": "ok", "redis": "ok", "object_store": "ok"},
        }

    async def test_readyz_reports_a_dead_dependency(self, client: AsyncTestClient[Litestar]) -> None:
        resources: Resources = client.app.state.resources
        live = resources.kv
        # Point the process at a Redis that does not answer (port 1 is never a Redis).
        resources.kv = RedisStore("redis://127.0.0.1:1/0", prefix="x:")
        try:
            response = await client.get("/readyz")
        finally:
            await resources.kv.close()
            resources.kv = live
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "unavailable"
        assert body["checks"]["database"] == "ok"
        assert body["checks"]["redis"].startswith("error")


async def test_openapi_schema(client: AsyncTestClient[Litestar]) -> None:
    response = await client.get("/schema/openapi.json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in ("/admin/tenants", "/admin/tenants/{tenant_id}", "/v1/me", "/v1/api-keys", "/readyz"):
        assert path in paths


class TestOpenAIErrorsOnV1:
    async def test_unknown_url(self, client: AsyncTestClient[Litestar]) -> None:
        response = await client.get("/v1/no-such-thing")
        assert response.status_code == 404
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"

    async def test_missing_key(self, client: AsyncTestClient[Litestar]) -> None:
        response = await client.get("/v1/me")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"

    async def test_body_validation(self, client: AsyncTestClient[Litestar], make_tenant: Any) -> None:
        _, key = await make_tenant("errors-v1")
        response = await client.post(
            "/v1/api-keys", json={"name": "x" * 500}, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "name"

    async def test_unknown_field(self, client: AsyncTestClient[Litestar], make_tenant: Any) -> None:
        _, key = await make_tenant("errors-v1-extra")
        response = await client.post("/v1/api-keys", json={"nmae": "typo"}, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 400
        assert "nmae" in response.json()["error"]["message"] + str(response.json()["error"]["param"])


class TestProblemDetailsOnAdmin:
    async def test_missing_token(self, client: AsyncTestClient[Litestar]) -> None:
        response = await client.get("/admin/tenants")
        assert response.status_code == 401
        assert response.headers["content-type"].startswith("application/problem+json")
        body = response.json()
        assert body["status"] == 401
        assert body["title"] == "Unauthorized"
        assert body["instance"] == "/admin/tenants"
        assert response.headers["www-authenticate"] == "Bearer"

    async def test_validation(self, client: AsyncTestClient[Litestar], admin_headers: dict[str, str]) -> None:
        response = await client.post("/admin/tenants", json={"name": ""}, headers=admin_headers)
        assert response.status_code == 400
        body = response.json()
        assert body["status"] == 400
        assert body["errors"][0]["key"] == "name"

    async def test_unknown_url(self, client: AsyncTestClient[Litestar], admin_headers: dict[str, str]) -> None:
        response = await client.get("/admin/nothing-here", headers=admin_headers)
        assert response.status_code == 404
        assert response.json()["status"] == 404

    async def test_wrong_method(self, client: AsyncTestClient[Litestar], admin_headers: dict[str, str]) -> None:
        response = await client.put("/admin/tenants", json={}, headers=admin_headers)
        assert response.status_code == 405
        assert response.json()["status"] == 405
