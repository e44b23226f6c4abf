"""Admin management of tenants, and a tenant's view of itself."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]


class TestCreate:
    async def test_create_and_get(self, client: Client, admin_headers: dict[str, str]) -> None:
        response = await client.post("/admin/tenants", json={"name": "  acme  "}, headers=admin_headers)
        assert response.status_code == 201
        tenant = response.json()
        assert set(tenant) == {"id", "name", "status", "created_at", "limits"}
        assert tenant["name"] == "acme"
        assert tenant["status"] == "active"
        fetched = await client.get(f"/admin/tenants/{tenant['id']}", headers=admin_headers)
        assert fetched.json() == tenant

    async def test_duplicate_name_is_409_and_writes_nothing(
        self, client: Client, admin_headers: dict[str, str]
    ) -> None:
        assert (await client.post("/admin/tenants", json={"name": "dup"}, headers=admin_headers)).status_code == 201
        response = await client.post("/admin/tenants", json={"name": "dup"}, headers=admin_headers)
        assert response.status_code == 409
        assert response.json()["code"] == "conflict"
        listed = await client.get("/admin/tenants", headers=admin_headers)
        assert [t["name"] for t in listed.json()["data"]] == ["dup"]

    @pytest.mark.parametrize("body", [{}, {"name": ""}, {"name": "a\x00b"}, {"name": "x" * 201}, {"name": 3}])
    async def test_bad_bodies(self, client: Client, admin_headers: dict[str, str], body: dict[str, Any]) -> None:
        response = await client.post("/admin/tenants", json=body, headers=admin_headers)
        assert response.status_code == 400
        assert (await client.get("/admin/tenants", headers=admin_headers)).json()["data"] == []


class TestList:
    async def test_newest_first_with_cursor(self, client: Client, admin_headers: dict[str, str]) -> None:
        names = [f"t{i}" for i in range(5)]
        for name in names:
            await client.post("/admin/tenants", json={"name": name}, headers=admin_headers)
        first = (await client.get("/admin/tenants?limit=2", headers=admin_headers)).json()
        assert first["object"] == "list"
        assert [t["name"] for t in first["data"]] == ["t4", "t3"]
        assert first["has_more"] is True
        second = (await client.get(f"/admin/tenants?limit=2&after={first['last_id']}", headers=admin_headers)).json()
        assert [t["name"] for t in second["data"]] == ["t2", "t1"]
        third = (await client.get(f"/admin/tenants?limit=2&after={second['last_id']}", headers=admin_headers)).json()
        assert [t["name"] for t in third["data"]] == ["t0"]
        assert third["has_more"] is False

    async def test_limit_is_bounded(self, client: Client, admin_headers: dict[str, str]) -> None:
        response = await client.get("/admin/tenants?limit=1000", headers=admin_headers)
        assert response.status_code == 400


class TestUpdate:
    async def test_rename(self, client: Client, admin_headers: dict[str, str], make_tenant: Any) -> None:
        tenant, _ = await make_tenant("old-name")
        response = await client.patch(
            f"/admin/tenants/{tenant['id']}", json={"name": "new-name"}, headers=admin_headers
        )
        assert response.status_code == 200
        assert response.json()["name"] == "new-name"

    async def test_rename_to_taken_name(self, client: Client, admin_headers: dict[str, str], make_tenant: Any) -> None:
        tenant, _ = await make_tenant("one")
        await make_tenant("two")
        response = await client.patch(f"/admin/tenants/{tenant['id']}", json={"name": "two"}, headers=admin_headers)
        assert response.status_code == 409
        fetched = await client.get(f"/admin/tenants/{tenant['id']}", headers=admin_headers)
        assert fetched.json()["name"] == "one"

    async def test_suspend_and_reactivate(
        self, client: Client, admin_headers: dict[str, str], make_tenant: Any
    ) -> None:
        tenant, key = await make_tenant("suspend-me")
        auth = {"Authorization": f"Bearer {key}"}
        assert (await client.get("/v1/me", headers=auth)).status_code == 200
        response = await client.patch(
            f"/admin/tenants/{tenant['id']}", json={"status": "suspended"}, headers=admin_headers
        )
        assert response.json()["status"] == "suspended"
        refused = await client.get("/v1/me", headers=auth)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "account_suspended"
        await client.patch(f"/admin/tenants/{tenant['id']}", json={"status": "active"}, headers=admin_headers)
        assert (await client.get("/v1/me", headers=auth)).status_code == 200

    @pytest.mark.parametrize("body", [{}, {"status": "deleted"}, {"name": None, "status": None}])
    async def test_bad_patch(self, client: Client, admin_headers: dict[str, str], make_tenant: Any, body: Any) -> None:
        tenant, _ = await make_tenant("patch-target")
        response = await client.patch(f"/admin/tenants/{tenant['id']}", json=body, headers=admin_headers)
        assert response.status_code == 400

    async def test_unknown_tenant(self, client: Client, admin_headers: dict[str, str]) -> None:
        response = await client.patch(f"/admin/tenants/{uuid.uuid4()}", json={"name": "x"}, headers=admin_headers)
        assert response.status_code == 404
        assert (await client.get(f"/admin/tenants/{uuid.uuid4()}", headers=admin_headers)).status_code == 404


class TestAdminAuth:
    async def test_wrong_token(self, client: Client) -> None:
        response = await client.get("/admin/tenants", headers={"Authorization": "Bearer nope"})
        assert response.status_code == 401

    async def test_tenant_key_is_not_an_admin_key(self, client: Client, make_tenant: Any) -> None:
        _, key = await make_tenant("not-admin")
        response = await client.get("/admin/tenants", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 401


async def test_me(client: Client, make_tenant: Any) -> None:
    tenant, key = await make_tenant("me")
    response = await client.get("/v1/me", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    assert response.json() == tenant
