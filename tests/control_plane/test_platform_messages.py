"""Anthropic's Messages API through the platform (issue 36, point 2), driven by the `anthropic` SDK with a tenant's
key in `x-api-key` (as Claude Code sends it) against the platform on a real socket: real Postgres, Redis and S3, the
embedded engine on a random Qwen3 checkpoint in Qwen3's chat format. A message on an endpoint with the tenant's
adapter is transformers + peft's greedy answer; streams carry Anthropic's events and add up to the same message;
tool_use -> tool_result loops run; prefix-cache hits show as cache_read_input_tokens and are billed as cache hits;
each message is one usage row keyed by its id; every error is Anthropic's envelope with its status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from _support.adapters import make_peft_adapter
from _support.checkpoints import make_checkpoint
from _support.family_chat import write_family_tokenizer
from _support.waiting import wait_for

from .embedded_platform import embedded_fixtures
from .test_completions import Platform, hf_greedy

pytestmark = pytest.mark.integration

USER: list[Any] = [{"role": "user", "content": "Triage this ticket: the nightly export failed twice."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
GREEDY = {"temperature": 0}  # sent as raw HTTP clients send it: the current SDK has no temperature parameter


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    write_family_tokenizer(path, "qwen3")
    return path


settings, platform = embedded_fixtures("qwen3")


def claude(platform: Platform, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=platform.url, api_key=key, max_retries=0, timeout=60)


def _anthropic(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    assert response.headers["request-id"].startswith("req_")
    return body


def test_an_adapter_endpoint_answers_as_transformers_and_peft(platform: Platform, qwen3: Path, tmp_path: Path) -> None:
    adapter_dir = make_peft_adapter(
        qwen3, tmp_path / "adapter", seed=4, r=8, lora_alpha=64, target_modules="all-linear"
    )
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "triage")
    platform.make_endpoint(tenant, "triage-bot", platform.base_model, adapter["id"])
    client = claude(platform, tenant.key)
    message = client.messages.create(model="triage-bot", max_tokens=10, messages=USER, extra_body=GREEDY)
    prompt_ids = platform.tokenizer.encode_chat(USER)
    assert message.content[0].text == hf_greedy(qwen3, adapter_dir, prompt_ids, 10, platform.tokenizer)  # type: ignore[union-attr]
    assert message.model == "triage-bot" and message.id.startswith("msg_")
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == len(prompt_ids)
    with client.messages.stream(model="triage-bot", max_tokens=10, messages=USER, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.content[0].text == message.content[0].text  # type: ignore[union-attr]
    # The same prompt again is read from the prefix cache, and says so in Anthropic's fields.
    cached = final.usage.cache_read_input_tokens or 0
    assert cached > 0 and final.usage.input_tokens + cached == len(prompt_ids)
    counted = client.messages.count_tokens(model="triage-bot", messages=USER)
    assert counted.input_tokens == len(prompt_ids)
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 2 else None)
    by_id = {row["request_id"]: row for row in rows}
    assert set(by_id) == {message.id, final.id}
    assert by_id[final.id]["cached_tokens"] == cached and by_id[message.id]["model"] == "triage-bot"
    assert by_id[message.id]["completion_tokens"] == message.usage.output_tokens


def test_a_tool_use_loop_on_the_base_model(platform: Platform) -> None:
    tenant = platform.make_tenant()
    client = claude(platform, tenant.key)
    asked = client.messages.create(
        model=platform.base_model,
        max_tokens=200,
        messages=USER,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert asked.stop_reason == "tool_use"
    [call] = [block for block in asked.content if block.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow_up: list[Any] = [
        *USER,
        {"role": "assistant", "content": [block.model_dump() for block in asked.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]},
    ]
    answer = client.messages.create(model=platform.base_model, max_tokens=6, messages=follow_up, tools=[WEATHER])  # type: ignore[list-item]
    assert answer.content and answer.usage.output_tokens > 0
    models = client.models.list()
    assert platform.base_model in [m.id for m in models.data] and models.data[0].type == "model"


def test_errors_in_anthropics_envelope(platform: Platform) -> None:
    tenant = platform.make_tenant()
    url = f"{platform.url}/v1/messages"
    headers = {"x-api-key": tenant.key, "anthropic-version": "2023-06-01"}
    ok = {"model": platform.base_model, "max_tokens": 4, "messages": USER}
    _anthropic(httpx.post(url, json=ok, headers={"x-api-key": "lpx_nope_nope"}), 401, "authentication_error")
    _anthropic(httpx.post(url, json={**ok, "model": "nobody"}, headers=headers), 404, "not_found_error")
    _anthropic(httpx.post(url, json={**ok, "max_tokens": None}, headers=headers), 400, "invalid_request_error")
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
    _anthropic(httpx.post(url, json={**ok, "messages": [image]}, headers=headers), 400, "invalid_request_error")
    huge = {**ok, "system": "x" * (4 * 2**20)}
    _anthropic(httpx.post(url, json=huge, headers=headers, timeout=60), 413, "request_too_large")
    thinking = {**ok, "thinking": {"type": "enabled", "budget_tokens": 2}}  # this base model does not reason
    _anthropic(httpx.post(url, json=thinking, headers=headers), 400, "invalid_request_error")
    response = platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": 1}})
    assert response.status_code == 200, response.text
    statuses = [httpx.post(url, json=ok, headers=headers, timeout=60).status_code for _ in range(3)]
    assert 429 in statuses
    limited = httpx.post(url, json=ok, headers=headers, timeout=60)
    _anthropic(limited, 429, "rate_limit_error")
    with pytest.raises(anthropic.RateLimitError):
        claude(platform, tenant.key).messages.create(**ok)
    # Refused before the engine: nothing billed; the one that ran is one row.
    rows = platform.usage_rows(tenant)
    assert all(row["status"] in ("ok", "length") for row in rows)
