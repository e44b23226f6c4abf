"""Anthropic's Messages API on the engine server (issue 36, point 2), through the `anthropic` SDK, on a random Qwen3
checkpoint with a Qwen3-style template (Hermes tools, a think block) served as a reasoning model: the answer is the
chat's answer to the same conversation, token for token; streams carry every event type and add up to the same
message; tool_use -> tool_result loops run with calls made deterministic by `tool_choice` any/tool; thinking is held
to its budget; `output_config.format` gives JSON of the schema; prefix-cache hits show as cache_read_input_tokens;
every error is Anthropic's envelope with its status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from _support.checkpoints import make_checkpoint
from _support.engine_server import running_engine_server
from _support.family_chat import write_family_tokenizer
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.protocols import messages
from loraplex.engine.serve.server import create_engine_app

pytestmark = pytest.mark.unit

MODEL = "qwen3-tiny"
KEY = "engine-key"
BUDGETS = {"none": 0, "minimal": 2, "low": 4, "medium": 6, "high": 8}
USER: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3") / "m", "qwen3")
    write_family_tokenizer(path, "qwen3")

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, api_key=KEY)

    def config(reasoning: ReasoningConfig | None) -> EngineConfig:
        return EngineConfig(
            model=path, device="cpu", kv_budget=2**22, served_model_name=MODEL, num_threads=2, reasoning=reasoning
        )

    thinking = ReasoningConfig(parser="qwen3", budgets=BUDGETS, default_effort="low")
    with (
        running_engine_server(config(thinking), app) as (url, _),
        running_engine_server(config(None), app) as (
            plain,
            _,
        ),
    ):
        yield {"url": url, "plain": plain}


def claude(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def gpt(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_a_message_is_the_chats_answer_with_anthropics_usage(servers: dict[str, str]) -> None:
    url = servers["plain"]
    message = claude(url).messages.create(model=MODEL, max_tokens=12, messages=USER, system="Be brief.")
    chat = gpt(url).chat.completions.create(
        model=MODEL,
        max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, *USER],
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text  # sampled: compared by usage below, greedily in the next test
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert chat.usage is not None
    total_input = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert total_input == chat.usage.prompt_tokens
    assert message.usage.cache_creation_input_tokens == 0
    counted = claude(url).messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_greedy_answers_equal_chat_and_the_stream_adds_up_to_them(servers: dict[str, str]) -> None:
    url = servers["plain"]
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "messages": USER, "extra_body": {"temperature": 0}}
    message = claude(url).messages.create(**ask)
    chat = gpt(url).chat.completions.create(model=MODEL, max_tokens=16, messages=USER, temperature=0)
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens" and chat.choices[0].finish_reason == "length"
    with claude(url).messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == message.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == message.usage.output_tokens
    # The same prompt again reads it from the prefix cache, in Anthropic's fields.
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )


def test_raw_stream_events_in_order(servers: dict[str, str]) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": USER, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{servers['plain']}/v1/messages", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["request-id"].startswith("req_")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 6


def test_a_tool_use_and_tool_result_loop(servers: dict[str, str]) -> None:
    client = claude(servers["plain"])
    asked = client.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=USER,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert asked.stop_reason == "tool_use"
    calls = [block for block in asked.content if block.type == "tool_use"]
    assert calls and all(call.name == "get_weather" for call in calls)
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    follow_up: list[Any] = [
        *USER,
        {"role": "assistant", "content": [block.model_dump() for block in asked.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"} for call in calls],
        },
    ]
    answered = client.messages.create(model=MODEL, max_tokens=8, messages=follow_up, tools=[WEATHER])  # type: ignore[list-item]
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # A named tool streams its input as input_json_delta pieces that add up to valid arguments.
    with client.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=USER,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:
        pieces = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]  # type: ignore[union-attr]
        final = stream.get_final_message()
    [call] = [block for block in final.content if block.type == "tool_use"]
    assert json.loads("".join(pieces)) == call.input and final.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_thinking_is_held_to_its_budget_and_streams_as_thinking(servers: dict[str, str]) -> None:
    client = claude(servers["url"])
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "messages": USER, "extra_body": {"temperature": 0}}
    thought = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 5})
    kinds = [block.type for block in thought.content]
    assert kinds[0] == "thinking" and thought.content[0].thinking  # type: ignore[union-attr]
    chat = gpt(servers["url"]).chat.completions.create(
        model=MODEL, max_tokens=40, messages=USER, temperature=0, extra_body={"thinking_token_budget": 5}
    )
    assert thought.content[0].thinking == (chat.choices[0].message.model_extra or {})["reasoning_content"]  # type: ignore[union-attr]
    with client.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 5}) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].thinking == thought.content[0].thinking  # type: ignore[union-attr]
    off = client.messages.create(**ask, thinking={"type": "disabled"})
    assert [block.type for block in off.content] == ["text"]
    effort = client.messages.create(**ask, output_config={"effort": "max"})  # the engine's largest tier: high
    chat_high = gpt(servers["url"]).chat.completions.create(
        model=MODEL, max_tokens=40, messages=USER, temperature=0, reasoning_effort="high"
    )
    assert effort.content[0].thinking == (chat_high.choices[0].message.model_extra or {})["reasoning_content"]  # type: ignore[union-attr]


def test_output_config_format_gives_json_of_the_schema(servers: dict[str, str]) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    message = claude(servers["plain"]).messages.create(
        model=MODEL, max_tokens=60, messages=USER, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]


def test_models_list_in_anthropics_shape(servers: dict[str, str]) -> None:
    models = claude(servers["plain"]).models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].type == "model"
    plain = httpx.get(f"{servers['plain']}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert plain["object"] == "list"  # without anthropic-version: OpenAI's


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"messages": USER}, 400, "invalid_request_error"),  # max_tokens is required
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
        ),
        (
            {"max_tokens": 5, "messages": [*USER, {"role": "assistant", "content": "Sure"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 4}},
            400,
            "invalid_request_error",
        ),
        ({"max_tokens": 5, "messages": USER, "model": "nope"}, 404, "not_found_error"),
    ],
)
def test_errors_are_anthropics_envelope(servers: dict[str, str], body: dict[str, Any], status: int, kind: str) -> None:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    response = httpx.post(f"{servers['plain']}/v1/messages", json={"model": MODEL, **body}, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]
    assert response.headers["request-id"].startswith("req_")


def test_the_sdks_errors_for_a_bad_key_and_a_thinking_budget_past_max_tokens(servers: dict[str, str]) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude(servers["plain"], key="wrong").messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude(servers["url"]).messages.create(
            model=MODEL, max_tokens=4, messages=USER, thinking={"type": "enabled", "budget_tokens": 8}
        )


def test_the_openapi_document_lists_the_messages_routes(servers: dict[str, str]) -> None:
    paths = httpx.get(f"{servers['plain']}/schema/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(paths)


@pytest.mark.parametrize(
    ("status", "kind", "raised"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (401, "authentication_error", anthropic.AuthenticationError),
        (403, "permission_error", anthropic.PermissionDeniedError),
        (404, "not_found_error", anthropic.NotFoundError),
        (413, "request_too_large", anthropic.RequestTooLargeError),
        (429, "rate_limit_error", anthropic.RateLimitError),
        (500, "api_error", anthropic.InternalServerError),
        (529, "overloaded_error", anthropic.OverloadedError),
    ],
)
def test_each_status_is_the_error_type_and_sdk_exception_anthropic_documents(
    status: int, kind: str, raised: type[anthropic.APIStatusError]
) -> None:
    """Every status the platform and the engine answer is written as Anthropic's error type for it (403 included,
    which no request reaches today: another tenant's object is a 404), and the SDK raises its class for it."""
    code, body = messages.error_body(status, "why")
    assert code == status and body == {"type": "error", "error": {"type": kind, "message": "why"}}
    request = httpx.Request("POST", "http://engine/v1/messages")
    error = anthropic.Anthropic(api_key="k")._make_status_error(
        "why", body=body, response=httpx.Response(code, json=body, request=request)
    )
    assert type(error) is raised
