"""What hostile or careless clients send, on the platform over real Postgres, Redis and S3 with its embedded engine:
content parts as the `openai` SDK sends them, prompts megabytes long, bodies nested past the parser's depth, NUL
bytes where a query would take them, paths the filesystem refuses, and loosely typed fields. Each is a 4xx in the
path's error shape, never a 5xx, and leaves nothing behind.

The platform is test_completions' (its fixtures imported; module-scoped, so this module starts one of its own).
The database, Redis or engine failing is tests/control_plane/test_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.waiting import wait_for

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from loraplex.platform.domain.completions.service import engine_error
from loraplex.platform.domain.fleet.client import EngineRequestError

from . import test_completions
from .test_completions import ADMIN, ENDPOINT, Owner, Platform, envelope

pytestmark = pytest.mark.integration

settings = test_completions.settings
platform = test_completions.platform
adapter_dir = test_completions.adapter_dir
owner = test_completions.owner

GREEDY: dict[str, Any] = {"temperature": 0, "max_completion_tokens": 8}
# Under the 4 MiB body cap, far over the context: tokenizing it would take seconds.
HUGE_PROMPT_CHARS = 4_000_000


def openai_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error"), error
    return error


def problem(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json"), response.headers
    body: dict[str, Any] = response.json()
    assert body["status"] == status, body
    return body


# --- content parts ------------------------------------------------------------------------------------------------


def test_text_parts_are_the_same_conversation_as_strings_streamed_and_not(platform: Platform, owner: Owner) -> None:
    """The shape the SDK and agent frameworks send: a list of text parts, in any role, means its joined text."""
    client = platform.client(owner.tenant.key)
    as_strings = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Summarize the ticket below for the on-call engineer."},
    ]
    user_parts = [{"type": "text", "text": t} for t in ("Summarize the ticket ", "below for the ", "on-call engineer.")]
    as_parts: list[Any] = [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": user_parts},
    ]
    plain = client.chat.completions.create(model=ENDPOINT, messages=as_strings, **GREEDY)  # type: ignore[arg-type]
    parts = client.chat.completions.create(model=ENDPOINT, messages=as_parts, **GREEDY)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage is not None and plain.usage is not None
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens > 0
    # The SDK's stream helper over the same parts. It refuses an answer cut by the length limit, so the answers stop
    # at a string the greedy answer reaches.
    text = plain.choices[0].message.content
    assert text is not None and len(text) >= 3, text
    stop = [text[1:3]]
    stopped = client.chat.completions.create(model=ENDPOINT, messages=as_parts, stop=stop, **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=ENDPOINT, messages=as_parts, stop=stop, **GREEDY) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content == stopped.choices[0].message.content
    # Each usage row is written once its answer has been sent: wait for the last one.
    rows = wait_for(
        lambda: (
            found if final.id in (found := {r["request_id"]: r for r in platform.usage_rows(owner.tenant)}) else None
        )
    )
    assert rows[parts.id]["prompt_tokens"] == plain.usage.prompt_tokens
    assert rows[final.id]["prompt_tokens"] == plain.usage.prompt_tokens


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-123"}},
    ],
    ids=["image", "audio", "file"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_non_text_parts_are_400_naming_the_part_type(
    platform: Platform, owner: Owner, part: dict[str, Any], stream: bool
) -> None:
    client = platform.client(owner.tenant.key)
    content = [{"type": "text", "text": "What is in this?"}, part]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=ENDPOINT,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
            stream=stream,
        )
    error = envelope(info.value)
    assert part["type"] in error["message"], error
    assert "text only" in error["message"], error
    assert error["param"] is not None and error["param"].startswith("messages"), error


# --- one tenant's huge prompts do not stall the others ------------------------------------------------------------


async def test_huge_prompts_leave_other_tenants_and_healthz_answering(platform: Platform, owner: Owner) -> None:
    """Three 4 MB prompts in parallel are refused as over the context without being tokenized, while another
    tenant's one-token request and /healthz go on answering."""
    other = platform.make_tenant()
    huge = ("the quick brown fox jumps over the lazy dog " * (HUGE_PROMPT_CHARS // 44 + 1))[:HUGE_PROMPT_CHARS]
    async with httpx.AsyncClient(base_url=platform.url, timeout=120) as client:

        async def send_huge() -> httpx.Response:
            body = {"model": ENDPOINT, "messages": [{"role": "user", "content": huge}], "max_tokens": 1}
            return await client.post("/v1/chat/completions", json=body, headers=owner.tenant.headers)

        async def timed(request: Any) -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            response = await request
            return response, time.perf_counter() - started

        huge_requests = [asyncio.ensure_future(send_huge()) for _ in range(3)]
        await asyncio.sleep(0.05)  # the huge bodies are on their way
        small_body = {"model": platform.base_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        small, small_s = await timed(client.post("/v1/chat/completions", json=small_body, headers=other.headers))
        health, health_s = await timed(client.get("/healthz"))
        refused = await asyncio.gather(*huge_requests)
    assert small.status_code == 200, small.text
    assert health.status_code == 200
    assert small_s < 0.5 and health_s < 0.5, (small_s, health_s)
    for response in refused:
        error = openai_error(response)
        assert error["code"] == "context_length_exceeded", error
        assert "characters long" in error["message"], error


# --- hostile bodies -----------------------------------------------------------------------------------------------

DEEP_ARRAY = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"a":' * 5000 + "1" + "}" * 5000


@pytest.mark.parametrize("body", [DEEP_ARRAY, DEEP_OBJECT], ids=["array", "object"])
def test_json_nested_past_the_parsers_depth_is_400_on_every_json_route(
    platform: Platform, owner: Owner, body: str
) -> None:
    headers = {"Content-Type": "application/json"}
    tenant_routes = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/endpoints")]
    tenant_routes.append(("POST", "/v1/api-keys"))
    for method, path in tenant_routes:
        response = httpx.request(
            method, f"{platform.url}{path}", content=body, headers={**headers, **owner.tenant.headers}, timeout=30
        )
        assert "nested too deeply" in openai_error(response)["message"], path
    tenant_id = owner.tenant.id
    admin_routes = [("POST", "/admin/tenants"), ("PATCH", f"/admin/tenants/{tenant_id}"), ("PUT", "/admin/prices")]
    admin_routes += [("POST", "/admin/base-models"), ("POST", f"/admin/tenants/{tenant_id}/api-keys")]
    for method, path in admin_routes:
        response = httpx.request(
            method, f"{platform.url}{path}", content=body, headers={**headers, **ADMIN}, timeout=30
        )
        assert "nested too deeply" in problem(response)["detail"], path


def test_nul_bytes_in_anything_that_reaches_a_query_are_400_and_store_nothing(
    platform: Platform, owner: Owner, adapter_dir: Path
) -> None:
    tenant = owner.tenant
    tenants_before = platform.admin("GET", "/admin/tenants", params={"limit": 100}).json()["data"]
    endpoints_before = platform.get(tenant, "/v1/endpoints").json()["data"]
    keys_before = platform.get(tenant, "/v1/api-keys").json()["data"]
    # In bodies: `model`, names, `base_model`, a price's base model.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for body in ({**chat, "model": "loraplex\x00demo"}, {**chat, "model": "\x00"}):
        assert openai_error(platform.post(tenant, "/v1/chat/completions", json=body))["param"] == "model"
    completion = {"model": "x\x00", "prompt": "hi"}
    assert openai_error(platform.post(tenant, "/v1/completions", json=completion))["param"] == "model"
    for body in (
        {"name": "bot\x00", "base_model": platform.base_model},
        {"name": "bot-nul", "base_model": platform.base_model + "\x00"},
    ):
        openai_error(platform.post(tenant, "/v1/endpoints", json=body))
    openai_error(platform.post(tenant, "/v1/api-keys", json={"name": "ci\x00"}))
    problem(platform.admin("POST", "/admin/tenants", json={"name": "acme\x00corp"}))
    problem(platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"name": "acme\x00"}))
    price = {"base_model": "demo\x00", "input_per_mtok": "1", "output_per_mtok": "2"}
    problem(platform.admin("PUT", "/admin/prices", json=price))
    problem(platform.admin("POST", "/admin/base-models", json={"name": "m\x00", "source": "/models/m"}))
    problem(platform.admin("POST", "/admin/base-models", json={"name": "nul-source", "source": "/models/\x00m"}))
    files = {name: (name, (adapter_dir / name).read_bytes()) for name in (CONFIG_FILE, WEIGHTS_FILE)}
    for data in ({"name": "nul\x00", "base_model": platform.base_model}, {"name": "nul", "base_model": "b\x00"}):
        openai_error(platform.post(tenant, "/v1/adapters", data=data, files=files))
    # In query strings and paths, raw or percent-encoded.
    for path in ("/v1/api-keys?after=%00", "/v1/endpoints?after=x%00", "/v1/adapters?name=a%00b", "/v1/usage?x=%00"):
        openai_error(platform.get(tenant, path))
    problem(platform.admin("GET", "/admin/tenants?after=%00"))
    problem(platform.admin("GET", "/admin/billing/report?group_by=tenant%00"))
    response = httpx.delete(f"{platform.url}/v1/api-keys/abc%00def", headers=tenant.headers, timeout=30)
    assert response.status_code in (400, 404), response.text
    openai_error(response, response.status_code)
    response = platform.admin("DELETE", "/admin/api-keys/abc%00def")
    assert response.status_code in (400, 404), response.text
    problem(response, response.status_code)
    # Nothing half-written.
    assert platform.admin("GET", "/admin/tenants", params={"limit": 100}).json()["data"] == tenants_before
    assert platform.get(tenant, "/v1/endpoints").json()["data"] == endpoints_before
    assert platform.get(tenant, "/v1/api-keys").json()["data"] == keys_before
    names = [m["name"] for m in platform.admin("GET", "/admin/base-models").json()["data"]]
    assert "nul-source" not in names


def test_a_base_model_source_the_filesystem_refuses_is_400(platform: Platform) -> None:
    for source in ("/" + "a" * 1000, "/tmp/" + "b" * 300 + "/model", "/" + "/".join(["c" * 200] * 5)):
        response = platform.admin("POST", "/admin/base-models", json={"name": "too-long", "source": source})
        body = problem(response)
        assert "source" in body["detail"] or "cannot be served" in body["detail"], body
    names = [m["name"] for m in platform.admin("GET", "/admin/base-models").json()["data"]]
    assert "too-long" not in names


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "16"),
        ("max_completion_tokens", 16.0),
        ("stream", "yes"),
        ("stream", 1),
        ("temperature", True),
        ("top_p", "0.5"),
        ("seed", "7"),
        ("logprobs", "true"),
        ("n", True),
        ("stream_options", {"include_usage": "true"}),
        ("messages", [{"role": "user", "content": "hi", "name": 5}]),
        ("messages", [{"role": "user", "content": 5}]),
    ],
)
def test_loosely_typed_fields_are_400_as_at_openai(platform: Platform, owner: Owner, field: str, value: Any) -> None:
    body = {"model": ENDPOINT, "messages": [{"role": "user", "content": "hi"}], field: value}
    error = openai_error(platform.post(owner.tenant, "/v1/chat/completions", json=body))
    assert error["param"] is not None and error["param"].startswith(field), error


def test_loosely_typed_admin_and_tenant_fields_are_400_and_exact_ones_pass(platform: Platform, owner: Owner) -> None:
    tenant = platform.make_tenant()
    problem(platform.admin("POST", "/admin/tenants", json={"name": 5}))
    problem(platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": "5"}}))
    problem(platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": True}}))
    # Past the limits' 32-bit columns: a 400 naming the bound, not a database error; the largest value is stored.
    too_many = {"limits": {"tokens_per_minute": 2**31}}
    problem(platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json=too_many))
    largest = {"limits": {"tokens_per_minute": 2**31 - 1, "key_tokens_per_minute": 2**31 - 1}}
    response = platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json=largest)
    assert response.status_code == 200, response.text
    defaults = {"name": "typed", "base_model": platform.base_model, "defaults": {"max_tokens": "4"}}
    openai_error(platform.post(tenant, "/v1/endpoints", json=defaults))
    # What the JSON form of a UUID, a decimal, a timestamp or an enum is (a string) still passes.
    response = platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"status": "suspended"})
    assert response.status_code == 200, response.text
    response = platform.admin(
        "PATCH", f"/admin/tenants/{tenant.id}", json={"status": "active", "limits": {"requests_per_minute": 50}}
    )
    assert response.status_code == 200, response.text
    adapter_id = owner.adapter["id"]
    body = {"name": "typed-ok", "base_model": platform.base_model, "adapter_id": adapter_id}
    assert platform.post(owner.tenant, "/v1/endpoints", json=body).status_code == 201
    price = {"base_model": platform.base_model, "input_per_mtok": "0.5", "output_per_mtok": 2, "effective_at": None}
    assert platform.admin("PUT", "/admin/prices", json=price).status_code in (200, 201)


def test_an_engine_refusing_the_platforms_key_is_a_502_not_the_tenants_401() -> None:
    """A fleet engine whose --api-key differs from LORAPLEX_ENGINE_API_KEY answers the platform 401: the operator's
    mistake, which must not tell the tenant that its own key is wrong."""
    refused = EngineRequestError(401, {"error": {"message": "Incorrect API key provided for this engine."}})
    error = engine_error(refused)
    assert (error.status_code, error.code) == (502, "engine_auth")
    assert "API key" not in error.message
    passed_on = engine_error(EngineRequestError(400, {"error": {"message": "bad", "code": "invalid_value"}}))
    assert (passed_on.status_code, passed_on.code) == (400, "invalid_value")
