"""OpenAI's Responses API on the engine server (issue 36, point 1, stateless), through the `openai` SDK's
`responses.create`, `responses.stream` and `responses.parse`, on a random Qwen3 checkpoint with a Qwen3-style
template (Hermes tools, a think block): the output is the chat's answer to the same conversation, token for token;
streams carry the typed events in order, numbered, and add up to the same response; function calls made
deterministic by `tool_choice` round-trip as function_call / function_call_output items; reasoning items hold the
think block of the effort's budget; `text.format` gives JSON of the schema; what the engine server cannot do (stored
state, images, built-in tools) is a 400 in OpenAI's envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from _support.checkpoints import make_checkpoint
from _support.engine_server import running_engine_server
from _support.family_chat import write_family_tokenizer
from litestar import Litestar
from pydantic import BaseModel

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app

pytestmark = pytest.mark.unit

MODEL = "qwen3-tiny"
BUDGETS = {"none": 0, "minimal": 2, "low": 4, "medium": 6, "high": 8}
QUESTION = "What is the weather in Oslo?"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    score: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3") / "m", "qwen3")
    write_family_tokenizer(path, "qwen3")

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

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


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_response_is_the_chats_answer(servers: dict[str, str]) -> None:
    sdk = client(servers["plain"])
    response = sdk.responses.create(
        model=MODEL, instructions="Be brief.", input=QUESTION, max_output_tokens=12, temperature=0
    )
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_completion_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    # The same conversation as items, with parts.
    items = sdk.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=12,
        temperature=0,
    )
    assert items.output_text == response.output_text
    assert items.usage is not None and items.usage.input_tokens_details.cached_tokens > 0  # the prefix cache


def test_the_stream_numbers_its_typed_events_and_adds_up(servers: dict[str, str]) -> None:
    sdk = client(servers["plain"])
    ask: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 10, "temperature": 0}
    whole = sdk.responses.create(**ask)
    with sdk.responses.stream(**ask) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]  # an incomplete response ends with response.incomplete
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == whole.output_text == final.output_text
    assert final.usage is not None and final.usage.output_tokens == 10


def test_function_calls_round_trip_as_items(servers: dict[str, str]) -> None:
    sdk = client(servers["plain"])
    called = sdk.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow_up: list[Any] = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    answer = sdk.responses.create(model=MODEL, input=follow_up, tools=[WEATHER], max_output_tokens=6)  # type: ignore[list-item]
    assert answer.output and answer.usage is not None and answer.usage.input_tokens > called.usage.input_tokens  # type: ignore[union-attr]
    # A named function streams its arguments as deltas that add up to the call's.
    with sdk.responses.stream(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert pieces == streamed.arguments and json.loads(pieces)["city"]
    assert "response.function_call_arguments.done" in [e.type for e in events]


def test_namespaced_tools_and_built_in_ones_as_codex_sends_them(servers: dict[str, str]) -> None:
    """Codex CLI groups tools in namespaces and lists built-in ones (web search) the engine does not run: the
    namespace's functions are the model's, a call of one names its namespace, and the built-in tool is left out
    (echoed in the response's tools, never called)."""
    inner = {key: value for key, value in WEATHER.items() if key != "strict"}
    tools: list[Any] = [{"type": "namespace", "name": "weather_v1", "description": "Weather.", "tools": [inner]}]
    tools.append({"type": "web_search"})
    response = client(servers["plain"]).responses.create(
        model=MODEL,
        input=QUESTION,
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.namespace == "weather_v1"
    assert json.loads(call.arguments)["city"]
    assert [tool.type for tool in response.tools] == ["namespace", "web_search"]


def test_reasoning_items_hold_the_efforts_think_block(servers: dict[str, str]) -> None:
    sdk = client(servers["url"])
    ask: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 40, "temperature": 0}
    response = sdk.responses.create(**ask, reasoning={"effort": "low"})
    chat = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=40,
        temperature=0,
        reasoning_effort="low",
    )
    [reasoning] = [item for item in response.output if item.type == "reasoning"]
    assert reasoning.content is not None
    assert reasoning.content[0].text == (chat.choices[0].message.model_extra or {})["reasoning_content"]
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens >= BUDGETS["low"]
    with sdk.responses.stream(**ask, reasoning={"effort": "low"}) as stream:
        thought = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert thought == reasoning.content[0].text


def test_text_format_and_the_parse_helper(servers: dict[str, str]) -> None:
    sdk = client(servers["plain"])
    parsed = sdk.responses.parse(model=MODEL, input=QUESTION, text_format=Verdict, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Verdict)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response = sdk.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "count", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": ""}, None),
    ],
)
def test_what_the_engine_server_cannot_do_is_a_400(
    servers: dict[str, str], fields: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(servers["plain"]).responses.create(model=MODEL, **{"input": QUESTION, **fields})
    error = caught.value.body
    assert isinstance(error, dict) and error["message"]
    if param is not None:
        assert error["param"] == param


def test_top_logprobs_come_with_the_output_text(servers: dict[str, str]) -> None:
    sdk = client(servers["plain"])
    response = sdk.responses.create(
        model=MODEL,
        input=QUESTION,
        max_output_tokens=5,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    [message] = [item for item in response.output if item.type == "message"]
    logprobs = message.content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == 5
    assert "".join(entry.token for entry in logprobs) == response.output_text
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs)
    # Greedy: each token is its position's most likely one.
    assert all(entry.logprob == max(top.logprob for top in entry.top_logprobs) for entry in logprobs)
    with sdk.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=5, temperature=0, top_logprobs=2
    ) as stream:
        events = list(stream)
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]  # type: ignore[union-attr]
    assert [e.token for e in streamed] == [e.token for e in logprobs]
    final = events[-1].response  # type: ignore[union-attr]
    assert [e.token for e in final.output[0].content[0].logprobs] == [e.token for e in logprobs]
