"""OpenAI's Responses API through the platform (issue 36, point 1), driven by the `openai` SDK with a tenant's key
against the platform on a real socket: real Postgres, Redis and S3, the embedded engine on a random Qwen3
checkpoint in Qwen3's chat format. A response on an endpoint with the tenant's adapter is transformers + peft's
greedy answer; it is stored (`store`, the default) and can be retrieved, listed by its input items, continued with
`previous_response_id` (the second turn's prompt is the whole conversation, its prefix read from the cache) and
deleted; another tenant's ids are 404 and never content; each response is one usage row keyed by its id."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from _support.adapters import make_peft_adapter
from _support.checkpoints import make_checkpoint
from _support.family_chat import write_family_tokenizer
from _support.waiting import wait_for

from loraplex.engine.core.reasoning_config import ReasoningConfig

from .embedded_platform import embedded_fixtures
from .test_completions import Platform, hf_greedy

pytestmark = pytest.mark.integration

QUESTION = "Triage this ticket: the nightly export failed twice."
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
    write_family_tokenizer(path, "qwen3")
    return path


settings, platform = embedded_fixtures("qwen3")


def test_a_stored_conversation_on_an_adapter_endpoint(platform: Platform, qwen3: Path, tmp_path: Path) -> None:
    adapter_dir = make_peft_adapter(
        qwen3, tmp_path / "adapter", seed=4, r=8, lora_alpha=64, target_modules="all-linear"
    )
    tenant = platform.make_tenant()
    adapter = platform.upload_adapter(tenant, adapter_dir, "triage")
    platform.make_endpoint(tenant, "triage-bot", platform.base_model, adapter["id"])
    sdk = platform.client(tenant.key)
    first = sdk.responses.create(model="triage-bot", input=QUESTION, max_output_tokens=8, temperature=0)
    prompt_ids = platform.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    assert first.output_text == hf_greedy(qwen3, adapter_dir, prompt_ids, 8, platform.tokenizer)
    assert first.model == "triage-bot" and first.store is True and first.usage is not None
    assert first.usage.input_tokens == len(prompt_ids)
    assert sdk.responses.retrieve(first.id).output_text == first.output_text
    [item] = sdk.responses.input_items.list(first.id).data
    assert item.type == "message" and item.content[0].text == QUESTION  # type: ignore[union-attr]
    # The next turn continues the stored conversation: its prompt is all of it, its prefix read from the cache.
    second = sdk.responses.create(
        model="triage-bot",
        input="And the billing one?",
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
    )
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the billing one?"},
    ]
    assert second.usage is not None and second.usage.input_tokens == len(platform.tokenizer.encode_chat(conversation))
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.previous_response_id == first.id
    # Streamed and stored: what the stream ends with is what is stored.
    with sdk.responses.stream(
        model="triage-bot",
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=200,  # type: ignore[list-item]
    ) as stream:
        final = stream.get_final_response()
    [call] = [o for o in final.output if o.type == "function_call"]
    assert json.loads(call.arguments)["city"]
    [kept] = [o for o in sdk.responses.retrieve(final.id).output if o.type == "function_call"]
    assert (kept.call_id, kept.arguments) == (call.call_id, call.arguments)
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 3 else None)
    assert {row["request_id"] for row in rows} == {first.id, second.id, final.id}
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)


def test_unstored_responses_and_other_tenants_ids_are_not_found(platform: Platform) -> None:
    owner, other = platform.make_tenant(), platform.make_tenant()
    mine, theirs = platform.client(owner.key), platform.client(other.key)
    unstored = mine.responses.create(model=platform.base_model, input=QUESTION, max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)
    kept = mine.responses.create(model=platform.base_model, input=QUESTION, max_output_tokens=2)
    missing = "resp_" + "0" * 24
    for attempt in (
        lambda: theirs.responses.retrieve(kept.id),
        lambda: theirs.responses.input_items.list(kept.id),
        lambda: theirs.responses.delete(kept.id),
        lambda: theirs.responses.create(model=platform.base_model, input="hi", previous_response_id=kept.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert QUESTION not in str(caught.value.body)
    # Exactly what an id that exists nowhere gets.
    theirs_text = httpx.get(f"{platform.url}/v1/responses/{kept.id}", headers=other.headers).text
    nobody_text = httpx.get(f"{platform.url}/v1/responses/{missing}", headers=other.headers).text
    assert theirs_text == nobody_text.replace(missing, kept.id)
    assert mine.responses.retrieve(kept.id).id == kept.id  # untouched


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"model": "nobody"}, "model"),
    ],
)
def test_refusals_are_openais_envelope(platform: Platform, fields: dict[str, Any], param: str) -> None:
    tenant = platform.make_tenant()
    body = {"model": platform.base_model, "input": QUESTION, "max_output_tokens": 2, **fields}
    response = httpx.post(f"{platform.url}/v1/responses", json=body, headers=tenant.headers, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert platform.usage_rows(tenant) == []


def test_every_refusal_is_in_openais_envelope(platform: Platform) -> None:
    """401, 413 and 429 as the openai SDK reads them; nothing refused is billed or stored."""
    tenant = platform.make_tenant()
    url = f"{platform.url}/v1/responses"
    ok = {"model": platform.base_model, "input": QUESTION, "max_output_tokens": 2}

    def refused(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
        assert response.status_code == status, response.text
        error: dict[str, Any] = response.json()["error"]
        assert error["type"] == kind and error["message"], error
        return error

    refused(httpx.post(url, json=ok, headers={"Authorization": "Bearer lpx_nope_nope"}), 401, "invalid_request_error")
    with pytest.raises(openai.AuthenticationError):
        platform.client("lpx_nope_nope").responses.create(**ok)
    huge = {**ok, "instructions": "x" * (4 * 2**20)}
    error = refused(httpx.post(url, json=huge, headers=tenant.headers, timeout=60), 413, "invalid_request_error")
    assert error["code"] == "request_too_large"
    response = platform.admin("PATCH", f"/admin/tenants/{tenant.id}", json={"limits": {"requests_per_minute": 1}})
    assert response.status_code == 200, response.text
    statuses = [httpx.post(url, json=ok, headers=tenant.headers, timeout=60).status_code for _ in range(3)]
    assert statuses.count(200) <= 1 and 429 in statuses
    limited = refused(httpx.post(url, json=ok, headers=tenant.headers, timeout=60), 429, "rate_limit_error")
    assert limited["code"]
    with pytest.raises(openai.RateLimitError):
        platform.client(tenant.key).responses.create(**ok)
    with pytest.raises(openai.RateLimitError):  # a background response is refused at once, never queued
        platform.client(tenant.key).responses.create(**ok, background=True)
    assert len(platform.usage_rows(tenant)) == statuses.count(200)


def test_sealed_reasoning_for_stateless_clients(platform: Platform) -> None:
    """As Codex CLI runs: store false, reasoning asked back sealed; sent back it opens, altered or another tenant's
    it is a 400. (The base model is made a reasoning model for this test, and plain again after it.)"""
    path = f"/admin/base-models/{platform.base_model}"
    thinking = ReasoningConfig(parser="qwen3", budgets={"low": 4}).to_dict()
    response = platform.admin("PATCH", path, json={"reasoning_config": thinking})
    assert response.status_code == 200, response.text
    try:
        owner, other = platform.make_tenant(), platform.make_tenant()
        ask: dict[str, Any] = {"model": platform.base_model, "max_output_tokens": 30, "temperature": 0}
        first = platform.client(owner.key).responses.create(
            **ask, input=QUESTION, store=False, include=["reasoning.encrypted_content"], reasoning={"effort": "low"}
        )
        [reasoning] = [item for item in first.output if item.type == "reasoning"]
        assert reasoning.encrypted_content and reasoning.encrypted_content.startswith("lpx1.")
        assert QUESTION not in reasoning.encrypted_content and reasoning.content
        assert reasoning.content[0].text not in reasoning.encrypted_content
        turn: list[Any] = [
            {"role": "user", "content": QUESTION},
            reasoning.model_dump(exclude_none=True),
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And the billing one?"},
        ]
        again = platform.client(owner.key).responses.create(**ask, input=turn, store=False)
        assert again.status in ("completed", "incomplete")
        token = reasoning.encrypted_content
        altered = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        for client, sealed in ((platform.client(owner.key), altered), (platform.client(other.key), token)):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(**ask, input=[*turn[:1], {**turn[1], "encrypted_content": sealed}, *turn[2:]])
            assert caught.value.body["code"] == "invalid_encrypted_content"  # type: ignore[index]
            assert caught.value.body["param"] == "input[1].encrypted_content"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            platform.client(owner.key).responses.retrieve(first.id)  # store: false
    finally:
        response = platform.admin("PATCH", path, json={"reasoning_config": None})
        assert response.status_code == 200, response.text


def test_an_agents_sdk_tool_loop(platform: Platform) -> None:
    """The OpenAI Agents SDK's Runner on the platform's Responses API: the first turn must call the tool (tool_choice
    required; constrained decoding makes the random model write a valid call), the SDK runs it and sends its output
    back as a function_call_output item, and (tool_choice reset to auto, as the SDK does) the model answers in its
    output type (text.format json_schema: the grammar also ends the random model's answer)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel

    class Triage(BaseModel):
        urgent: Literal["yes", "no"]

    set_tracing_disabled(True)  # no traces sent to OpenAI
    tenant = platform.make_tenant()
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    model = OpenAIResponsesModel(
        model=platform.base_model,
        openai_client=openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key=tenant.key, max_retries=0),
    )
    agent = Agent(
        name="triage",
        instructions="Answer briefly.",
        model=model,
        tools=[get_weather],
        output_type=Triage,
        model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
    )
    result = Runner.run_sync(agent, QUESTION, max_turns=4)
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, Triage)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 2 else None)
    assert all(row["request_id"].startswith("resp_") for row in rows)


LONG = {
    "type": "object",
    "properties": {"t": {"type": "string", "minLength": 400}},
    "required": ["t"],
    "additionalProperties": False,
}


def _polled(sdk: openai.OpenAI, response_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        response = sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_background_responses_run_after_the_answer_and_can_be_cancelled(platform: Platform) -> None:
    tenant, other = platform.make_tenant(), platform.make_tenant()
    sdk = platform.client(tenant.key)
    ask: dict[str, Any] = {"model": platform.base_model, "input": QUESTION, "temperature": 0}
    started = sdk.responses.create(**ask, max_output_tokens=8, background=True)
    assert started.status in ("queued", "in_progress") and started.background is True and started.output == []
    done = _polled(sdk, started.id)
    assert done.status == "incomplete" and done.usage is not None and done.usage.output_tokens == 8
    assert done.output_text == sdk.responses.create(**ask, max_output_tokens=8).output_text  # as answered at once
    # A long one, cancelled while it runs: it stops, reads cancelled, and is billed for what it ran.
    # (a grammar that needs 400 characters keeps the random model from ending early)
    text = {"format": {"type": "json_schema", "name": "long", "schema": LONG, "strict": True}}
    long = sdk.responses.create(**ask, max_output_tokens=460, background=True, text=text)
    with pytest.raises(openai.NotFoundError):
        platform.client(other.key).responses.cancel(long.id)
    cancelled = sdk.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert sdk.responses.retrieve(long.id).status == "cancelled" and sdk.responses.cancel(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="ended"):
        sdk.responses.cancel(done.id)
    rows = wait_for(lambda: found if len(found := platform.usage_rows(tenant)) >= 3 else None)
    by_id = {row["request_id"]: row for row in rows}
    assert by_id[started.id]["completion_tokens"] == 8 and by_id[long.id]["status"] == "cancelled"
    for fields, param in (({"store": False}, "store"), ({"stream": True}, "stream")):
        body = {**ask, "max_output_tokens": 2, "background": True, **fields}
        response = httpx.post(f"{platform.url}/v1/responses", json=body, headers=tenant.headers, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
