"""Tool calling on the engine server through the `openai` SDK: tools reach a Hermes-style chat template; `required`
and a named function constrain the output to calls whose arguments validate; `auto` parses the model's
<tool_call> text into `message.tool_calls`, streamed or not; tool turns are accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _support.checkpoints import HERMES_CHAT_TEMPLATE, VOCAB, tiny_spec
from _support.engine_server import running_engine_server
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.serve.tool_calls import detect_parser
from loraplex.engine.tools.demo import write_random_model, write_tokenizer

pytestmark = pytest.mark.unit

MODEL = "tiny-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
# A random model never writes a call by itself; a regex holds it to one, so `auto`'s parser meets real output.
CALL_REGEX = (
    r'I will check\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}", "unit": "c"\}\}'
    r"</tool_call>"
)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_random_model(tmp_path_factory.mktemp("tools-model") / "m", tiny_spec(max_position_embeddings=1024))
    write_tokenizer(path, vocab_size=VOCAB, chat_template=HERMES_CHAT_TEMPLATE)

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    config = EngineConfig(model=path, device="cpu", kv_budget=2**20, served_model_name=MODEL, num_threads=2)
    with running_engine_server(config, app) as (server_url, _):
        yield server_url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def test_required_calls_validate_against_their_functions(url: str) -> None:
    names: set[str] = set()
    for seed in range(6):
        chat = client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=480,  # a random model decides at each "," or "]" whether to call again
        )  # fmt: skip
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert calls
        assert len({call.id for call in calls}) == len(calls)
        for call in calls:
            assert call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore[union-attr]
            names.add(call.function.name)  # type: ignore[union-attr]
    assert names <= set(SCHEMAS)


def test_no_parallel_calls_means_one(url: str) -> None:
    for seed in range(4):
        chat = client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        assert len(chat.choices[0].message.tool_calls or []) == 1


def test_a_named_function_is_called_with_valid_arguments(url: str) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 1.0,
        "seed": 3,
        "max_tokens": 50,
    }
    for stream in (False, True):
        if stream:
            with client(url).chat.completions.stream(**ask) as events:
                chat: Any = events.get_final_completion()
        else:
            chat = client(url).chat.completions.create(**ask)
        [call] = chat.choices[0].message.tool_calls
        assert call.id.startswith("call_")
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
        assert chat.choices[0].finish_reason == "tool_calls"


def test_a_named_functions_arguments_stream_as_openais_deltas(url: str) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "stream": True,
        "max_tokens": 50,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    pieces = [c["delta"]["tool_calls"][0] for e in events for c in e["choices"] if "tool_calls" in c["delta"]]
    assert len(pieces) > 1
    first, *rest = pieces
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_time"
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
    jsonschema.validate(json.loads("".join(p["function"]["arguments"] for p in pieces)), SCHEMAS["get_time"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_parses_the_models_tool_call_streamed_or_not(url: str) -> None:
    ask: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0}
    ask["extra_body"] = {"guided_regex": CALL_REGEX}
    chat = client(url).chat.completions.create(**ask)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, SCHEMAS["get_weather"])
    with client(url).chat.completions.stream(**ask) as stream:
        content = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    assert content == "I will check."
    [streamed] = final.choices[0].message.tool_calls or []
    assert streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == arguments  # greedy: the same call
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_plain_content(url: str) -> None:
    chat = client(url).chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40, extra_body={"guided_regex": "No tools needed"}
    )
    assert chat.choices[0].message.content == "No tools needed"
    assert not chat.choices[0].message.tool_calls
    assert chat.choices[0].finish_reason == "stop"


def test_a_conversation_with_calls_and_results_is_accepted(url: str) -> None:
    messages: list[Any] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
            }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snow"},
    ]  # fmt: skip
    chat = client(url).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_tools_and_calls_reach_the_template(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m", tiny_spec())
    write_tokenizer(path, vocab_size=VOCAB, chat_template=HERMES_CHAT_TEMPLATE)
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "cold"},
    ]  # fmt: skip
    text = Tokenizer.from_dir(path).apply_chat_template(messages, tools=[WEATHER])
    assert '"name": "get_weather"' in text and "The weather in a city" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>\ncold\n</tool_response>" in text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
        ({"messages": [{"role": "tool", "content": "x"}]}, None),  # no tool_call_id
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools",
        ),  # a keyword the grammar cannot enforce
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "text"}}}, None),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"guided_json": 5}, "guided_json"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 5}}]}
                ]
            },
            None,
        ),
    ],
)
def test_malformed_tool_requests_are_400(url: str, extra: dict[str, Any], param: str | None) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_a_turn_that_must_call_a_tool_leaves_the_response_format_for_later(url: str) -> None:
    """tool_choice required with a response_format (an agent sends both on every turn, as the Agents SDK does with an
    output type): this turn's output is calls, which no response format shapes, as OpenAI's API answers."""
    chat = client(url).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        response_format={"type": "json_object"},
        max_tokens=120,
    )
    assert chat.choices[0].finish_reason == "tool_calls"
    [call] = chat.choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore[union-attr]


def test_the_parser_follows_the_template() -> None:
    assert detect_parser(HERMES_CHAT_TEMPLATE) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{{ messages }}") is None
