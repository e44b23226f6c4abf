"""Reasoning effort tiers on the engine server, through the `openai` SDK, with a templated checkpoint: a Qwen3-style
template that opens the think block in the prompt, and a tokenizer with `<think>` and `</think>` as tokens.

A random model never closes its think block by itself, so every tier with a budget reaches it: its reasoning tokens
are exactly the budget plus the forced closing text and end marker, and an answer follows. `none` closes the block
in the template (Qwen3's enable_thinking) and has no reasoning at all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from _support.checkpoints import tiny_spec, write_thinking_tokenizer
from _support.engine_server import running_engine_server
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.tools.demo import write_random_model

pytestmark = pytest.mark.unit

MODEL = "tiny-thinker"
BUDGETS = {"none": 0, "minimal": 2, "low": 5, "medium": 12, "high": 30}
CLOSING = " Enough."
MESSAGES: list[Any] = [{"role": "user", "content": "How many legs has a spider?"}]
TIERS = ("none", "minimal", "low", "medium", "high")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A reasoning engine (qwen3 parser, the budgets above) and the same model served without a parser."""
    path = write_random_model(tmp_path_factory.mktemp("thinker") / "m", tiny_spec(max_position_embeddings=1024))
    write_thinking_tokenizer(path)

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    def config(reasoning: ReasoningConfig | None) -> EngineConfig:
        return EngineConfig(
            model=path, device="cpu", kv_budget=2**22, served_model_name=MODEL, num_threads=2, reasoning=reasoning
        )

    reasoning = ReasoningConfig(parser="qwen3", budgets=BUDGETS, default_effort="low", closing_text=CLOSING)
    tokenizer = Tokenizer.from_dir(path)
    forced = len(tokenizer.encode(CLOSING, add_special_tokens=False)) + 1  # the closing text and </think>
    with (
        running_engine_server(config(reasoning), app) as (url, _),
        running_engine_server(config(None), app) as (
            plain,
            _,
        ),
    ):
        yield {"url": url, "plain": plain, "forced": forced}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def ask(url: str, **fields: Any) -> Any:
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_completion_tokens": 80}
    return client(url).chat.completions.create(**(request | fields))


def reasoning_of(message: Any) -> str | None:
    value: str | None = (message.model_extra or {}).get("reasoning_content")
    return value


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_thinks_within_its_budget_then_answers(servers: dict[str, Any], tier: str) -> None:
    chat = ask(servers["url"], reasoning_effort=tier)
    choice, usage = chat.choices[0], chat.usage
    reasoning_tokens = usage.completion_tokens_details.reasoning_tokens
    if tier == "none":
        assert reasoning_tokens == 0 and reasoning_of(choice.message) is None
    else:
        # A random model never closes the block: it runs to the budget, then the closing text and marker are forced.
        assert reasoning_tokens == BUDGETS[tier] + servers["forced"]
        assert reasoning_of(choice.message), "the think block's text is reasoning_content"
        assert CLOSING.strip() in (reasoning_of(choice.message) or "")
    assert not (reasoning_of(choice.message) or "").endswith("</think>"), "the markers are not reasoning"
    assert not (choice.message.content or "").startswith("</think>")
    assert usage.completion_tokens > reasoning_tokens, "an answer follows the think block"
    assert choice.message.content, "an answer follows the think block"


def test_a_request_without_a_tier_gets_the_default_one(servers: dict[str, Any]) -> None:
    chat = ask(servers["url"])
    assert chat.usage.completion_tokens_details.reasoning_tokens == BUDGETS["low"] + servers["forced"]


def test_thinking_token_budget_overrides_the_tier(servers: dict[str, Any]) -> None:
    chat = ask(servers["url"], reasoning_effort="high", extra_body={"thinking_token_budget": 3})
    assert chat.usage.completion_tokens_details.reasoning_tokens == 3 + servers["forced"]
    # 0 closes the block the template opened at once: only the end marker, and no reasoning to show.
    chat = ask(servers["url"], extra_body={"thinking_token_budget": 0})
    assert chat.usage.completion_tokens_details.reasoning_tokens == 1
    assert reasoning_of(chat.choices[0].message) is None and chat.choices[0].message.content


def test_chat_template_kwargs_reach_the_template(servers: dict[str, Any]) -> None:
    chat = ask(servers["url"], reasoning_effort="high", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    assert reasoning_of(chat.choices[0].message) is None


def test_the_completion_limit_counts_reasoning_tokens(servers: dict[str, Any]) -> None:
    chat = ask(servers["url"], reasoning_effort="high", max_completion_tokens=10)
    choice = chat.choices[0]
    assert choice.finish_reason == "length" and chat.usage.completion_tokens == 10
    assert chat.usage.completion_tokens_details.reasoning_tokens == 10
    assert reasoning_of(choice.message) and not choice.message.content


@pytest.mark.parametrize("tier", ["minimal", "medium"])
def test_streamed_and_whole_answers_agree(servers: dict[str, Any], tier: str) -> None:
    whole = ask(servers["url"], reasoning_effort=tier, n=2, seed=5, temperature=1.0)
    stream = ask(
        servers["url"], reasoning_effort=tier, n=2, seed=5, temperature=1.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    reasoning = ["", ""]
    content = ["", ""]
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            assert not (delta.content and (delta.model_extra or {}).get("reasoning_content")), "one kind per delta"
            reasoning[choice.index] += (delta.model_extra or {}).get("reasoning_content") or ""
            content[choice.index] += delta.content or ""
    for choice in whole.choices:
        assert reasoning[choice.index] == reasoning_of(choice.message)
        assert content[choice.index] == choice.message.content
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_structured_output_applies_to_the_answer_after_the_block(servers: dict[str, Any]) -> None:
    schema = {
        "type": "object",
        "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 99}, "name": {"enum": ["spider", "ant"]}},
        "required": ["legs", "name"],
        "additionalProperties": False,
    }
    for seed in range(3):
        chat = ask(
            servers["url"], reasoning_effort="low", temperature=1.0, seed=seed, max_completion_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )  # fmt: skip
        choice = chat.choices[0]
        assert chat.usage.completion_tokens_details.reasoning_tokens == BUDGETS["low"] + servers["forced"]
        reasoning = reasoning_of(choice.message) or ""
        with pytest.raises(json.JSONDecodeError, match=r"\w"):
            json.loads(reasoning)  # the think block is free text: the grammar did not hold it
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_a_budget_needs_a_reasoning_engine(servers: dict[str, Any]) -> None:
    response = httpx.post(
        f"{servers['plain']}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "thinking_token_budget": 5},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "thinking_token_budget"
    # A tier alone is a template hint there, as vLLM takes it: no reasoning is split off or counted.
    chat = ask(servers["plain"], reasoning_effort="high", max_completion_tokens=8)
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    assert reasoning_of(chat.choices[0].message) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"), ({"reasoning_effort": "max"}, None),
     ({"thinking_token_budget": -1}, None)],
)  # fmt: skip
def test_bad_reasoning_fields_are_400(servers: dict[str, Any], fields: dict[str, Any], param: str | None) -> None:
    response = httpx.post(
        f"{servers['url']}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **fields}, timeout=30
    )
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_the_sdk_parse_helper_reads_the_answer_after_the_block(servers: dict[str, Any]) -> None:
    from pydantic import BaseModel, Field

    class Legs(BaseModel):
        legs: int = Field(ge=0, le=99)

    parsed = client(servers["url"]).chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Legs, reasoning_effort="minimal", temperature=1.0, seed=1,
        max_completion_tokens=120,
    )  # fmt: skip
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Legs)
    assert reasoning_of(message)


def test_metrics_count_reasoning_tokens(servers: dict[str, Any]) -> None:
    def counted() -> float:
        text = httpx.get(f"{servers['url']}/metrics", timeout=30).text
        line = next(line for line in text.splitlines() if line.startswith("loraplex_engine_reasoning_tokens_total"))
        return float(line.split()[-1])

    before = counted()
    chat = ask(servers["url"], reasoning_effort="minimal")
    assert counted() - before == chat.usage.completion_tokens_details.reasoning_tokens > 0


WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A random model never writes a call by itself: a regex holds the answer after the block to one.
CALL_REGEX = r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}"\}\}</tool_call>'


def test_tool_calls_are_read_from_the_answer_after_the_block(servers: dict[str, Any]) -> None:
    ask: dict[str, Any] = {
        "model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "max_completion_tokens": 120, "temperature": 0,
        "reasoning_effort": "minimal", "extra_body": {"guided_regex": CALL_REGEX},
    }  # fmt: skip
    chat = client(servers["url"]).chat.completions.create(**ask)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert reasoning_of(choice.message)
    with client(servers["url"]).chat.completions.stream(**ask) as stream:
        content = "".join(event.delta for event in stream if event.type == "content.delta")
        final = stream.get_final_completion()
    assert content == "Checking."
    [streamed] = final.choices[0].message.tool_calls or []
    assert streamed.function.arguments == call.function.arguments  # type: ignore[union-attr]
    assert reasoning_of(final.choices[0].message) == reasoning_of(choice.message)
