"""Who may touch what: every route that names an object in its path, called with the owner's key, another tenant's
key, a revoked key of the owner, no key and malformed credentials; and every list route, seen by two tenants.

The owner gets 2xx. Another tenant gets exactly the 404 an id that exists nowhere gets (never 403, never data), and
the object is untouched afterwards. Anything that is not a live key of a tenant gets 401. Errors on /v1 are OpenAI's
envelope; errors on /admin are problem details (docs/decisions/0004-error-shapes.md), where a tenant key is no
credential at all: 401, like a wrong admin token.

One app, database, bucket and pair of tenants serve the whole module; a cell whose request deletes or changes
something works on an object it made itself, so cells stay independent of their order.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from _support.services import PostgresServer, RedisServer, S3Server
from httpx import Response
from litestar import Litestar
from litestar.testing import AsyncTestClient
from safetensors.torch import save as save_safetensors
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.model.config import ModelConfig
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.responses.models import StoredResponse
from loraplex.platform.domain.usage.recorder import UsageEvent
from loraplex.platform.domain.usage.repository import UsageRepository
from loraplex.platform.ids import TenantId
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, bearer, module_settings

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

Client = AsyncTestClient[Litestar]

BASE = "tiny-llama"
ADMIN = bearer(ADMIN_TOKEN)
OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}


# --- module fixtures ------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> AsyncIterator[Settings]:
    """Settings on a database, Redis prefix and bucket of this module's own, removed after it."""
    data_dir = tmp_path_factory.mktemp("data")
    async with module_settings(data_dir, postgres_server, redis_server, s3_server, session_tag) as value:
        yield value


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sessions(settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions of the test's own (the app's pool lives on the test client's event loop, in its own thread)."""
    engine = create_engine(settings.effective_database_url)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(settings: Settings, tiny_base_checkpoint: Path) -> AsyncIterator[Client]:
    async with AsyncTestClient(app=create_app(settings)) as client:
        response = await client.post(
            "/admin/base-models", json={"name": BASE, "source": str(tiny_base_checkpoint)}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        yield client


@pytest.fixture(scope="module")
def resources(api: Client) -> Resources:
    value: Resources = api.app.state.resources
    return value


@pytest.fixture(scope="module")
def adapter_files(tiny_base_checkpoint: Path) -> tuple[bytes, bytes]:
    """A small valid adapter for the base (rank 2 on q_proj), written directly: PEFT's layout, no PEFT import."""
    base = ModelConfig.from_dir(tiny_base_checkpoint)
    rank = 2
    tensors = {}
    for layer in range(base.num_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.full((rank, base.hidden_size), 0.01)
        tensors[f"{prefix}.lora_B.weight"] = torch.full((base.q_size, rank), 0.01)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    return json.dumps(config).encode(), save_safetensors(tensors)


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str
    key_id: str
    spare_key: str  # a second live key: what the revoke cells aim at
    spare_key_id: str
    adapter_id: str
    endpoint_id: str
    endpoint_name: str
    request_id: str  # a usage row
    response_id: str  # a stored response of the Responses API
    key_ids: frozenset[str] = field(default_factory=frozenset)  # every key the tenant has at the start

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.key)


@dataclass(frozen=True)
class World:
    owner: Tenant
    other: Tenant
    revoked_key: str  # the owner's, revoked through the API


async def new_tenant(api: Client) -> str:
    response = await api.post("/admin/tenants", json={"name": f"tenant-{secrets.token_hex(4)}"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    tenant_id: str = response.json()["id"]
    return tenant_id


async def new_key(api: Client, tenant_id: str) -> tuple[str, str]:
    """A new key of the tenant, made by the admin: (full key, key id)."""
    response = await api.post(f"/admin/tenants/{tenant_id}/api-keys", json={"name": "k"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    body = response.json()
    return body["key"], body["id"]


async def new_adapter(api: Client, headers: dict[str, str], files: tuple[bytes, bytes]) -> str:
    response = await api.post(
        "/v1/adapters",
        data={"name": "bot", "base_model": BASE},
        files={CONFIG_FILE: (CONFIG_FILE, files[0]), WEIGHTS_FILE: (WEIGHTS_FILE, files[1])},
        headers=headers,
    )
    assert response.status_code == 201, response.text
    adapter_id: str = response.json()["id"]
    return adapter_id


async def new_endpoint(api: Client, headers: dict[str, str], name: str, adapter_id: str | None = None) -> str:
    body = {"name": name, "base_model": BASE, "adapter_id": adapter_id}
    response = await api.post("/v1/endpoints", json=body, headers=headers)
    assert response.status_code == 201, response.text
    endpoint_id: str = response.json()["id"]
    return endpoint_id


async def add_usage(sessions: async_sessionmaker[AsyncSession], tenant_id: str, key_id: str) -> str:
    request_id = f"chatcmpl-{secrets.token_hex(12)}"
    now = datetime.now(UTC)
    event = UsageEvent(
        request_id=request_id,
        tenant_id=TenantId(uuid.UUID(tenant_id)),
        api_key_id=key_id,
        endpoint_id=None,
        adapter_id=None,
        adapter_digest=None,
        model=BASE,
        base_model=BASE,
        prompt_tokens=10,
        cached_tokens=0,
        completion_tokens=5,
        status="ok",
        started_at=now - timedelta(minutes=2),
        finished_at=now - timedelta(minutes=1),
    )
    async with sessions() as session:
        assert await UsageRepository(session).add_if_absent([event.row()]) == 1
        await session.commit()
    return request_id


async def add_response(sessions: async_sessionmaker[AsyncSession], tenant_id: str) -> str:
    """A stored response of the tenant's (this app runs no engine to make one), as the Responses API stores it."""
    response_id = f"resp_{secrets.token_hex(12)}"
    now = datetime.now(UTC)
    item = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "user", "status": "completed"}
    item["content"] = [{"type": "input_text", "text": f"the secret of {tenant_id}"}]
    body = {"id": response_id, "object": "response", "created_at": int(now.timestamp()), "model": BASE, "output": []}
    async with sessions() as session:
        session.add(
            StoredResponse(
                id=response_id,
                tenant_id=uuid.UUID(tenant_id),
                input_items=[item],
                response=body,
                created_at=now,
                expires_at=now + timedelta(days=1),
            )
        )
        await session.commit()
    return response_id


async def make_tenant(
    api: Client, sessions: async_sessionmaker[AsyncSession], files: tuple[bytes, bytes], label: str
) -> Tenant:
    tenant_id = await new_tenant(api)
    key, key_id = await new_key(api, tenant_id)
    spare_key, spare_key_id = await new_key(api, tenant_id)
    adapter_id = await new_adapter(api, bearer(key), files)
    endpoint_name = f"{label}-bot"
    endpoint_id = await new_endpoint(api, bearer(key), endpoint_name, adapter_id)
    request_id = await add_usage(sessions, tenant_id, key_id)
    response_id = await add_response(sessions, tenant_id)
    return Tenant(
        tenant_id,
        key,
        key_id,
        spare_key,
        spare_key_id,
        adapter_id,
        endpoint_id,
        endpoint_name,
        request_id,
        response_id,
        frozenset({key_id, spare_key_id}),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(api: Client, sessions: async_sessionmaker[AsyncSession], adapter_files: tuple[bytes, bytes]) -> World:
    owner = await make_tenant(api, sessions, adapter_files, "owner")
    other = await make_tenant(api, sessions, adapter_files, "other")
    revoked_key, revoked_id = await new_key(api, owner.id)
    response = await api.delete(f"/v1/api-keys/{revoked_id}", headers=owner.headers)
    assert response.status_code == 200, response.text
    assert response.json()["revoked_at"] is not None
    owner = replace(owner, key_ids=owner.key_ids | {revoked_id})
    return World(owner=owner, other=other, revoked_key=revoked_key)


# --- credentials ----------------------------------------------------------------------------------------------

# Calls that hold no key at all: no header, or a header without a usable key in it.
ANONYMOUS = {
    "no-key": {},
    "basic-auth": {"Authorization": "Basic dXNlcjpwYXNzd29yZA=="},
    "empty-bearer": {"Authorization": "Bearer "},
    "not-a-key": {"Authorization": "Bearer lpx_nothing_here"},
}


def credential_headers(credential: str, world: World) -> dict[str, str]:
    if credential == "owner":
        return world.owner.headers
    if credential == "other-tenant":
        return world.other.headers
    if credential == "revoked-key":
        return bearer(world.revoked_key)
    if credential == "wrong-secret":  # the owner's key id with a secret of the right shape that is not its own
        return bearer(f"lpx_{world.owner.key_id}_{'A' * 32}")
    if credential == "admin-token":
        return ADMIN
    return ANONYMOUS[credential]


TENANT_CREDENTIALS = ["owner", "other-tenant", "revoked-key", "wrong-secret", "admin-token", *ANONYMOUS]
ADMIN_CREDENTIALS = ["admin-token", "owner", "other-tenant", "revoked-key", *ANONYMOUS]


def assert_openai_error(response: Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == OPENAI_ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    return error


def assert_problem(response: Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert isinstance(body["detail"], str) and body["detail"]
    assert "error" not in body


# --- tenant routes that carry an id ---------------------------------------------------------------------------


@dataclass(frozen=True)
class IdRoute:
    method: str
    path: str  # with "{id}"
    kind: str  # "adapter", "endpoint" or "api_key"

    @property
    def changes_something(self) -> bool:
        return self.method != "GET"


TENANT_ROUTES = {
    f"{r.method} {r.path}": r
    for r in (
        IdRoute("GET", "/v1/adapters/{id}", "adapter"),
        IdRoute("DELETE", "/v1/adapters/{id}", "adapter"),
        IdRoute("GET", "/v1/endpoints/{id}", "endpoint"),
        IdRoute("DELETE", "/v1/endpoints/{id}", "endpoint"),
        IdRoute("DELETE", "/v1/api-keys/{id}", "api_key"),
        IdRoute("GET", "/v1/responses/{id}", "response"),
        IdRoute("DELETE", "/v1/responses/{id}", "response"),
    )
}


def shared_target(kind: str, tenant: Tenant) -> str:
    targets = {"adapter": tenant.adapter_id, "endpoint": tenant.endpoint_id, "api_key": tenant.spare_key_id}
    return (targets | {"response": tenant.response_id})[kind]


def missing_id(kind: str) -> str:
    if kind == "api_key":  # key ids are 16 lowercase letters and digits
        return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(16))
    if kind == "response":
        return f"resp_{secrets.token_hex(12)}"
    return str(uuid.uuid4())


async def fresh_target(
    api: Client, sessions: async_sessionmaker[AsyncSession], world: World, kind: str, files: tuple[bytes, bytes]
) -> str:
    """An object of the owner's made for one cell, so that deleting it leaves the shared ones alone."""
    if kind == "response":
        return await add_response(sessions, world.owner.id)
    if kind == "adapter":
        return await new_adapter(api, world.owner.headers, files)
    if kind == "endpoint":
        return await new_endpoint(api, world.owner.headers, f"fresh-{secrets.token_hex(4)}")
    return (await new_key(api, world.owner.id))[1]


async def objects_of(resources: Resources, tenant: Tenant, adapter_id: str) -> list[str]:
    keys: list[str] = await resources.objects.list(f"tenants/{tenant.id}/adapters/{adapter_id}/")
    return keys


async def assert_untouched(api: Client, resources: Resources, world: World, kind: str, target: str) -> None:
    """The owner still has the object, exactly as before."""
    owner = world.owner
    if kind == "adapter":
        response = await api.get(f"/v1/adapters/{target}", headers=owner.headers)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "ready"
        prefix = f"tenants/{owner.id}/adapters/{target}/"
        assert await objects_of(resources, owner, target) == [prefix + CONFIG_FILE, prefix + WEIGHTS_FILE]
    elif kind == "endpoint":
        response = await api.get(f"/v1/endpoints/{target}", headers=owner.headers)
        assert response.status_code == 200, response.text
        assert (response.json()["name"], response.json()["adapter_id"]) == (owner.endpoint_name, owner.adapter_id)
    elif kind == "response":
        response = await api.get(f"/v1/responses/{target}/input_items", headers=owner.headers)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["content"][0]["text"] == f"the secret of {owner.id}"
    else:
        keys = (await api.get("/v1/api-keys?limit=100", headers=owner.headers)).json()["data"]
        assert [k["revoked_at"] for k in keys if k["id"] == target] == [None]
        assert (await api.get("/v1/me", headers=bearer(owner.spare_key))).status_code == 200


async def assert_gone(api: Client, resources: Resources, world: World, kind: str, target: str) -> None:
    """What the owner's own change did: the object is deleted (or the key revoked)."""
    owner = world.owner
    if kind == "api_key":
        keys = (await api.get("/v1/api-keys?limit=100", headers=owner.headers)).json()["data"]
        assert [k["revoked_at"] is not None for k in keys if k["id"] == target] == [True]
        return
    response = await api.get(f"/v1/{kind}s/{target}", headers=owner.headers)
    assert_openai_error(response, 404, "not_found")
    if kind == "adapter":
        assert await objects_of(resources, owner, target) == []


@pytest.mark.parametrize("credential", TENANT_CREDENTIALS)
@pytest.mark.parametrize("route", list(TENANT_ROUTES))
async def test_tenant_id_route(
    api: Client,
    resources: Resources,
    sessions: async_sessionmaker[AsyncSession],
    world: World,
    adapter_files: tuple[bytes, bytes],
    route: str,
    credential: str,
) -> None:
    spec = TENANT_ROUTES[route]
    headers = credential_headers(credential, world)
    if credential == "owner":
        target = (
            await fresh_target(api, sessions, world, spec.kind, adapter_files)
            if spec.changes_something
            else shared_target(spec.kind, world.owner)
        )
        response = await api.request(spec.method, spec.path.format(id=target), headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["id"] == target
        if spec.changes_something:
            await assert_gone(api, resources, world, spec.kind, target)
        return

    target = shared_target(spec.kind, world.owner)
    response = await api.request(spec.method, spec.path.format(id=target), headers=headers)
    if credential == "other-tenant":
        assert_openai_error(response, 404, "not_found")
        assert f"the secret of {world.owner.id}" not in response.text
        # Byte for byte the answer for an id that exists nowhere, but for the id it quotes.
        missing = missing_id(spec.kind)
        nobodys = await api.request(spec.method, spec.path.format(id=missing), headers=headers)
        assert response.text == nobodys.text.replace(missing, target)
    else:
        assert_openai_error(response, 401, "invalid_api_key")
    await assert_untouched(api, resources, world, spec.kind, target)


async def test_other_tenants_adapter_cannot_back_an_endpoint(api: Client, world: World) -> None:
    """An id in a body is checked like an id in a path: 404, and nothing made."""
    owner, other = world.owner, world.other
    name = f"borrowed-{secrets.token_hex(4)}"
    response = await api.post(
        "/v1/endpoints", json={"name": name, "base_model": BASE, "adapter_id": other.adapter_id}, headers=owner.headers
    )
    assert_openai_error(response, 404, "not_found")
    missing = str(uuid.uuid4())
    nobodys = await api.post(
        "/v1/endpoints", json={"name": name, "base_model": BASE, "adapter_id": missing}, headers=owner.headers
    )
    assert response.text == nobodys.text.replace(missing, other.adapter_id)
    listed = (await api.get("/v1/endpoints?limit=100", headers=owner.headers)).json()["data"]
    assert name not in [e["name"] for e in listed]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
async def test_another_tenants_endpoint_name_is_no_model(api: Client, world: World, path: str) -> None:
    """A name in a body is scoped too: `model` naming another tenant's endpoint is model_not_found, like no model."""

    def body(model: str) -> dict[str, Any]:
        if path == "/v1/completions":
            return {"model": model, "prompt": "hi", "max_tokens": 1}
        if path == "/v1/embeddings":
            return {"model": model, "input": "hi"}
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    theirs = await api.post(path, json=body(world.other.endpoint_name), headers=world.owner.headers)
    error = assert_openai_error(theirs, 404, "model_not_found")
    assert error["param"] == "model"
    missing = f"missing-{secrets.token_hex(4)}"
    nobodys = await api.post(path, json=body(missing), headers=world.owner.headers)
    assert theirs.text == nobodys.text.replace(missing, world.other.endpoint_name)
    # The owner's own name does resolve (this app runs no engine, so it then fails for another reason).
    own = await api.post(path, json=body(world.owner.endpoint_name), headers=world.owner.headers)
    assert own.status_code != 404, own.text


async def test_names_and_versions_are_per_tenant(api: Client, world: World) -> None:
    """Another tenant's names are free to take, so a conflict never tells that they exist."""
    response = await api.post(
        "/v1/endpoints", json={"name": world.other.endpoint_name, "base_model": BASE}, headers=world.owner.headers
    )
    assert response.status_code == 201, response.text
    deleted = await api.delete(f"/v1/endpoints/{response.json()['id']}", headers=world.owner.headers)
    assert deleted.status_code == 200
    # Both tenants uploaded an adapter named "bot" (the owner more than once): each counts its own versions.
    theirs = await api.get(f"/v1/adapters/{world.other.adapter_id}", headers=world.other.headers)
    mine = await api.get(f"/v1/adapters/{world.owner.adapter_id}", headers=world.owner.headers)
    assert (theirs.json()["name"], theirs.json()["version"]) == ("bot", 1)
    assert (mine.json()["name"], mine.json()["version"]) == ("bot", 1)


# --- list routes ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ListRoute:
    path: str
    id_field: str
    cursor: bool  # takes ?after=<id of the previous page's last item>

    def ids_of(self, tenant: Tenant) -> set[str]:
        """Every item of `tenant` this list shows (the module never adds any to the other tenant)."""
        return {
            "/v1/adapters": {tenant.adapter_id},
            "/v1/endpoints": {tenant.endpoint_id},
            "/v1/api-keys": set(tenant.key_ids),
            "/v1/usage": {tenant.request_id},
            "/v1/models": {tenant.endpoint_name, BASE},
        }[self.path]


LIST_ROUTES = {
    r.path: r
    for r in (
        ListRoute("/v1/adapters", "id", cursor=True),
        ListRoute("/v1/endpoints", "id", cursor=True),
        ListRoute("/v1/api-keys", "id", cursor=True),
        ListRoute("/v1/usage", "request_id", cursor=True),
        ListRoute("/v1/models", "id", cursor=False),
    )
}


async def listed_ids(api: Client, route: ListRoute, tenant: Tenant, **params: str) -> list[str]:
    query = {"limit": "100", **params} if route.cursor else params
    response = await api.get(route.path, params=query, headers=tenant.headers)
    assert response.status_code == 200, response.text
    return [str(item[route.id_field]) for item in response.json()["data"]]


@pytest.mark.parametrize("viewer", ["owner", "other-tenant"])
@pytest.mark.parametrize("route", list(LIST_ROUTES))
async def test_list_shows_only_the_callers_items(api: Client, world: World, route: str, viewer: str) -> None:
    spec = LIST_ROUTES[route]
    me, them = (world.owner, world.other) if viewer == "owner" else (world.other, world.owner)
    ids = await listed_ids(api, spec, me)
    assert len(ids) == len(set(ids))
    assert spec.ids_of(me) <= set(ids)
    assert not (spec.ids_of(them) - spec.ids_of(me)) & set(ids)
    if me is world.other:  # nothing in this module adds to the other tenant: its list is exactly its own
        assert set(ids) == spec.ids_of(me)


@pytest.mark.parametrize("route", [path for path, r in LIST_ROUTES.items() if r.cursor])
async def test_another_tenants_id_as_cursor_reveals_nothing(api: Client, world: World, route: str) -> None:
    spec = LIST_ROUTES[route]
    for theirs in sorted(spec.ids_of(world.other)):
        assert await listed_ids(api, spec, world.owner, after=theirs) == []


@pytest.mark.parametrize("credential", ["revoked-key", "wrong-secret", "admin-token", *ANONYMOUS])
@pytest.mark.parametrize("route", list(LIST_ROUTES))
async def test_list_without_a_live_key_is_401(api: Client, world: World, route: str, credential: str) -> None:
    response = await api.get(route, headers=credential_headers(credential, world))
    error = assert_openai_error(response, 401, "invalid_api_key")
    assert world.owner.endpoint_name not in response.text and world.owner.request_id not in response.text
    if credential == "revoked-key":
        assert "revoked" in error["message"]


# --- admin routes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdminRoute:
    method: str
    path: str  # "{tenant}", "{key}" and "{base}" are filled in
    body: dict[str, Any] | None = None
    success: int = 200


ADMIN_ROUTES = {
    f"{r.method} {r.path}": r
    for r in (
        AdminRoute("GET", "/admin/tenants/{tenant}"),
        AdminRoute("PATCH", "/admin/tenants/{tenant}", {"name": "renamed", "status": "suspended"}),
        AdminRoute("POST", "/admin/tenants/{tenant}/api-keys", {"name": "minted"}, success=201),
        AdminRoute("DELETE", "/admin/api-keys/{key}"),
        AdminRoute("GET", "/admin/tenants"),
        AdminRoute("POST", "/admin/tenants", {"name": "made"}, success=201),
        AdminRoute("GET", "/admin/base-models"),
        AdminRoute("POST", "/admin/base-models", {"name": "smuggled", "source": "/nowhere"}, success=201),
        AdminRoute("PATCH", "/admin/base-models/{base}", {"speculative_config": {"method": "ngram"}}),
        AdminRoute("GET", "/admin/engines"),
    )
}


async def admin_state(api: Client, world: World) -> list[Any]:
    """Everything an admin route could change, as the admin and the owner see it."""
    owner = world.owner
    return [
        (await api.get(f"/admin/tenants/{owner.id}", headers=ADMIN)).json(),
        (await api.get("/admin/tenants?limit=100", headers=ADMIN)).json(),
        (await api.get("/admin/base-models", headers=ADMIN)).json(),
        (await api.get("/v1/api-keys?limit=100", headers=owner.headers)).json(),
        (await api.get("/v1/me", headers=bearer(owner.spare_key))).status_code,
    ]


@pytest.mark.parametrize("credential", ADMIN_CREDENTIALS)
@pytest.mark.parametrize("route", list(ADMIN_ROUTES))
async def test_admin_route(api: Client, world: World, tiny_base_checkpoint: Path, route: str, credential: str) -> None:
    spec = ADMIN_ROUTES[route]
    body = dict(spec.body) if spec.body is not None else None
    if body is not None and "name" in body:
        body["name"] = f"{body['name']}-{secrets.token_hex(4)}"
    if credential == "admin-token":
        # The admin's changes land on a tenant made for this cell.
        tenant_id = await new_tenant(api)
        key_id = (await new_key(api, tenant_id))[1]
        if body is not None and "source" in body:
            body["source"] = str(tiny_base_checkpoint)
        base = f"{BASE}-{secrets.token_hex(4)}"  # and on a base model made for it
        if "{base}" in spec.path:
            registered = {"name": base, "source": str(tiny_base_checkpoint)}
            assert (await api.post("/admin/base-models", json=registered, headers=ADMIN)).status_code == 201
        path = spec.path.format(tenant=tenant_id, key=key_id, base=base)
        response = await api.request(spec.method, path, json=body, headers=ADMIN)
        assert response.status_code == spec.success, response.text
        return

    before = await admin_state(api, world)
    path = spec.path.format(tenant=world.owner.id, key=world.owner.spare_key_id, base=BASE)
    response = await api.request(spec.method, path, json=body, headers=credential_headers(credential, world))
    assert_problem(response, 401, "unauthenticated")
    assert response.headers["www-authenticate"] == "Bearer"
    assert world.owner.id not in response.json()["detail"]
    assert await admin_state(api, world) == before
