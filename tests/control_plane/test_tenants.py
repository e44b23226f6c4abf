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
        assert set(tenant) == {"id", "name", "status", "created_at", "fairness_weight", "service_tiers", "limits"}
        assert tenant["name"] == "acme"
        assert tenant["status"] == "active"
        # The defaults: weight 1, the platform's tiers (flex and default; priority is granted), no caps of its own.
        assert tenant["fairness_weight"] == 1
        assert tenant["service_tiers"] == ["flex", "default"]
        assert tenant["limits"]["max_concurrent_requests"] is None
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


class TestFairShare:
    """The fair-share terms of a tenant: its weight, the service tiers it may use, its concurrency cap."""

    async def test_create_with_terms_and_read_them_back(self, client: Client, admin_headers: dict[str, str]) -> None:
        body = {
            "name": "big-customer",
            "fairness_weight": 2.5,
            "service_tiers": ["priority", "default"],
            "limits": {"max_concurrent_requests": 8, "requests_per_minute": 100},
        }
        response = await client.post("/admin/tenants", json=body, headers=admin_headers)
        assert response.status_code == 201, response.text
        created = response.json()
        assert created["fairness_weight"] == 2.5
        assert created["service_tiers"] == ["default", "priority"]  # least urgent first, whatever the order given
        assert created["limits"]["max_concurrent_requests"] == 8
        assert created["limits"]["requests_per_minute"] == 100
        assert (await client.get(f"/admin/tenants/{created['id']}", headers=admin_headers)).json() == created

    async def test_patch_sets_and_resets_each_term(
        self, client: Client, admin_headers: dict[str, str], make_tenant: Any
    ) -> None:
        tenant, key = await make_tenant("tiered")
        path = f"/admin/tenants/{tenant['id']}"
        changes = {"fairness_weight": 1000, "service_tiers": ["default"], "limits": {"max_concurrent_requests": 10**6}}
        response = await client.patch(path, json=changes, headers=admin_headers)
        assert response.status_code == 200, response.text
        patched = response.json()
        assert (patched["fairness_weight"], patched["service_tiers"]) == (1000, ["default"])
        assert patched["limits"]["max_concurrent_requests"] == 10**6
        assert (await client.get(path, headers=admin_headers)).json() == patched
        # The tenant sees the same terms.
        assert (await client.get("/v1/me", headers={"Authorization": f"Bearer {key}"})).json() == patched
        # An absent field stays; a null tier list or cap goes back to the platform's default.
        response = await client.patch(path, json={"fairness_weight": 0.25}, headers=admin_headers)
        assert (response.json()["fairness_weight"], response.json()["service_tiers"]) == (0.25, ["default"])
        response = await client.patch(
            path, json={"service_tiers": None, "limits": {"max_concurrent_requests": None}}, headers=admin_headers
        )
        assert response.status_code == 200, response.text
        reset = response.json()
        assert reset["service_tiers"] == ["flex", "default"]
        assert reset["limits"]["max_concurrent_requests"] is None
        assert reset["fairness_weight"] == 0.25

    @pytest.mark.parametrize(
        ("changes", "param"),
        [
            ({"fairness_weight": 0}, "fairness_weight"),
            ({"fairness_weight": -1}, "fairness_weight"),
            ({"fairness_weight": 1000.5}, "fairness_weight"),
            ({"fairness_weight": None}, "fairness_weight"),
            ({"fairness_weight": "2"}, "fairness_weight"),
            ({"service_tiers": []}, "service_tiers"),
            ({"service_tiers": ["flex"]}, "service_tiers"),  # without default, no request naming no tier could run
            ({"service_tiers": ["default", "default"]}, "service_tiers"),
            ({"service_tiers": ["default", "scale"]}, "service_tiers"),
            ({"service_tiers": "default"}, "service_tiers"),
            ({"limits": {"max_concurrent_requests": 0}}, "max_concurrent_requests"),
            ({"limits": {"max_concurrent_requests": 10**6 + 1}}, "max_concurrent_requests"),
            ({"limits": {"max_concurrent_requests": 1.5}}, "max_concurrent_requests"),
        ],
    )
    async def test_bad_terms_are_400_and_change_nothing(
        self, client: Client, admin_headers: dict[str, str], make_tenant: Any, changes: dict[str, Any], param: str
    ) -> None:
        tenant, _ = await make_tenant("strict")
        path = f"/admin/tenants/{tenant['id']}"
        # With a valid change alongside: the whole request is refused, not the bad field alone.
        response = await client.patch(path, json={"name": "renamed", **changes}, headers=admin_headers)
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/problem+json")
        assert param in response.json()["detail"], response.text
        assert (await client.get(path, headers=admin_headers)).json() == tenant
        response = await client.post("/admin/tenants", json={"name": "never-made", **changes}, headers=admin_headers)
        assert response.status_code == 400, response.text
        listed = (await client.get("/admin/tenants", headers=admin_headers)).json()["data"]
        assert [t["name"] for t in listed] == ["strict"]


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
