"""Each new family's chat as its checkpoints ship it (issue 35, point 1), on the engine server with the `openai` SDK:
a random checkpoint of the family written by transformers, with a tokenizer in the family's chat format
(_support/family_chat.py). The prompt the server builds is the one transformers' tokenizer renders; a reply ends at
the family's end-of-turn token, which only generation_config.json lists (tokenizer_config.json names another end);
generation_config's sampling defaults are taken; Qwen3's Hermes tool calls are found by the parser its template
calls for, and its think block is split off by the qwen3 reasoning parser (and left out with enable_thinking
false)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from _support.checkpoints import make_checkpoint
from _support.engine_server import running_engine_server
from _support.family_chat import FAMILIES, write_family_tokenizer
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.serve.tool_calls import detect_parser

pytestmark = pytest.mark.unit

CONVERSATION: list[Any] = [
    {"role": "system", "content": "You triage support tickets."},
    {"role": "user", "content": "The nightly export failed."},
    {"role": "assistant", "content": "Which job?"},
    {"role": "user", "content": "The billing one."},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}"\}\}</tool_call>'


def _checkpoint(root: Path, family: str) -> Path:
    path = make_checkpoint(root / family, family)
    write_family_tokenizer(path, family)
    return path


def _server(path: Path, name: str, reasoning: ReasoningConfig | None = None) -> Any:
    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    config = EngineConfig(
        model=path, device="cpu", kv_budget=4 * 2**20, served_model_name=name, num_threads=2, reasoning=reasoning
    )
    return running_engine_server(config, app)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: _checkpoint(root, family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_prompt_is_transformers_and_the_reply_ends_at_the_end_of_turn(
    checkpoints: dict[str, Path], family: str
) -> None:
    from transformers import AutoTokenizer

    path = checkpoints[family]
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    end_of_turn = ours.token_to_id(FAMILIES[family].end_of_turn)
    assert end_of_turn is not None and ours.eos_token != FAMILIES[family].end_of_turn
    assert end_of_turn in ours.eos_token_ids
    expected = theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert ours.encode_chat(CONVERSATION) == list(expected)
    with _server(path, family) as (url, _):
        # min_tokens holds the end back for two tokens; the bias then makes it the third.
        chat = _client(url).chat.completions.create(
            model=family,
            messages=CONVERSATION,
            max_tokens=20,
            temperature=0,
            logit_bias={str(end_of_turn): 100},
            extra_body={"min_tokens": 2},
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "stop" and chat.usage is not None
        assert chat.usage.prompt_tokens == len(expected) and chat.usage.completion_tokens == 2  # the end: not text
        assert FAMILIES[family].end_of_turn not in (choice.message.content or "")


def test_generation_configs_sampling_defaults_are_the_requests(checkpoints: dict[str, Path]) -> None:
    for family, spec in FAMILIES.items():
        assert Tokenizer.from_dir(checkpoints[family]).sampling_defaults == spec.sampling, family


def test_qwen3_calls_tools_in_hermes_and_thinks_in_its_block(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["qwen3"]
    assert detect_parser(Tokenizer.from_dir(path).chat_template) == "hermes"
    ask: dict[str, Any] = {"model": "qwen3", "messages": CONVERSATION[1:2], "max_tokens": 150, "temperature": 0}
    with _server(path, "qwen3", ReasoningConfig("qwen3")) as (url, _):
        client = _client(url)
        # A random model never writes a call itself; a regex holds its answer to one, so the parser meets real text.
        called = client.chat.completions.create(
            **ask,
            tools=[WEATHER],  # type: ignore[list-item]
            extra_body={"guided_regex": CALL_REGEX, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert called.choices[0].finish_reason == "tool_calls"
        [call] = called.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
        thought = client.chat.completions.create(**ask, extra_body={"thinking_token_budget": 4})
        extra = thought.choices[0].message.model_extra or {}
        assert extra.get("reasoning_content"), "the think block is reasoning_content"
        assert thought.usage is not None and thought.usage.completion_tokens_details is not None
        assert thought.usage.completion_tokens_details.reasoning_tokens >= 4
        plain = client.chat.completions.create(
            **ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 4}
        )
        assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")
