"""Think blocks in the engine (offline `LLM`): budgets hold under speculative decoding with the same tokens as
without it, an output grammar starts after the block whether the template or the model opened it, a zero budget
keeps a model from opening one, and deepseek_r1 reads an output as reasoning from its first token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from _support.checkpoints import tiny_spec, write_thinking_tokenizer

from loraplex.engine import LLM, RequestError, SamplingParams, SpeculativeConfig, StructuredOutputsParams
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.tools.demo import DEFAULT_CHAT_TEMPLATE, write_random_model

pytestmark = pytest.mark.unit

CLOSING = " Enough."
MESSAGES: list[Any] = [{"role": "user", "content": "one two three one two three one two three"}]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose template opens the think block in the prompt."""
    path = write_random_model(tmp_path_factory.mktemp("opened") / "m", tiny_spec(max_position_embeddings=512))
    return write_thinking_tokenizer(path)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of model with a plain ChatML template: the output itself may open a block."""
    path = write_random_model(tmp_path_factory.mktemp("plain") / "m", tiny_spec(max_position_embeddings=512))
    return write_thinking_tokenizer(path, chat_template=DEFAULT_CHAT_TEMPLATE)


def llm(path: Path, parser: str = "qwen3", **options: Any) -> LLM:
    return LLM(
        str(path),
        kv_budget=2**23,
        num_threads=2,
        reasoning=ReasoningConfig(parser=parser, closing_text=CLOSING),
        **options,
    )


def forced_length(engine: LLM) -> int:
    return len(engine.get_tokenizer().encode(CLOSING, add_special_tokens=False)) + 1


def test_speculation_keeps_the_tokens_and_the_budget(opened: Path) -> None:
    params = [SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=b) for b in (0, 4, 9, 25)]
    plain_engine = llm(opened)
    expected = [out.outputs[0] for out in plain_engine.chat([MESSAGES] * len(params), params)]
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}')
    speculating = llm(opened, speculative_config=spec, speculative_use_clock=False)
    got = [out.outputs[0] for out in speculating.chat([MESSAGES] * len(params), params)]
    for budget, want, have in zip((0, 4, 9, 25), expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert have.reasoning == want.reasoning
        assert want.reasoning is not None and want.reasoning.num_tokens == (
            budget + forced_length(plain_engine) if budget else 1
        )
    stats = speculating.engine.state().speculation
    assert sum(counts.num_proposed for _, counts in stats) > 0, "speculation verified proposals in these rows"


@pytest.mark.parametrize("budget", [3, 10])
def test_a_grammar_constrains_the_answer_after_a_block_the_template_opened(opened: Path, budget: int) -> None:
    engine = llm(opened)
    grammar = StructuredOutputsParams(json=SCHEMA)
    for seed in range(3):
        params = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=120, thinking_token_budget=budget, structured_outputs=grammar
        )
        out = engine.chat(MESSAGES, params)[0].outputs[0]
        assert out.reasoning is not None and out.reasoning.num_tokens == budget + forced_length(engine)
        assert out.reasoning.end is not None
        jsonschema.validate(json.loads(out.text[out.reasoning.end :]), SCHEMA)


def test_a_grammar_row_may_open_a_block_itself(plain: Path) -> None:
    engine = llm(plain)
    think = engine.get_tokenizer().token_to_id("<think>")
    assert think is not None
    grammar = StructuredOutputsParams(json=SCHEMA)
    # Pushed to open the block (and to repeat <think> inside it, which the budget then ends); the answer is JSON.
    pushed = SamplingParams(
        temperature=0, max_tokens=120, thinking_token_budget=6, structured_outputs=grammar, logit_bias={think: 100}
    )
    out = engine.chat(MESSAGES, pushed)[0].outputs[0]
    assert out.token_ids[0] == think
    assert out.reasoning is not None and out.reasoning.num_tokens == 6 + forced_length(engine)
    assert out.reasoning.end is not None
    jsonschema.validate(json.loads(out.text[out.reasoning.end :]), SCHEMA)
    # Left alone, it answers at once: no block, and the grammar held from the first token.
    free = SamplingParams(temperature=0, max_tokens=120, thinking_token_budget=6, structured_outputs=grammar)
    out = engine.chat(MESSAGES, free)[0].outputs[0]
    assert out.reasoning is not None and (out.reasoning.num_tokens, out.reasoning.end) == (0, 0)
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_zero_budget_keeps_a_model_from_opening_a_block(plain: Path) -> None:
    engine = llm(plain)
    think = engine.get_tokenizer().token_to_id("<think>")
    assert think is not None
    params = SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=0, logit_bias={think: 100})
    out = engine.chat(MESSAGES, params)[0].outputs[0]
    assert out.token_ids[0] != think
    assert out.reasoning is not None and out.reasoning.num_tokens == 0 and out.reasoning.end == 0
    # With a budget the same push opens one.
    params = SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=2, logit_bias={think: 100})
    out = engine.chat(MESSAGES, params)[0].outputs[0]
    assert (
        out.token_ids[0] == think
        and out.reasoning is not None
        and out.reasoning.num_tokens == 2 + forced_length(engine)
    )


def test_deepseek_r1_reads_reasoning_from_the_first_token(plain: Path) -> None:
    engine = llm(plain, parser="deepseek_r1")
    out = engine.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40, thinking_token_budget=5))[0].outputs[0]
    assert out.reasoning is not None and out.reasoning.num_tokens == 5 + forced_length(engine)
    assert out.reasoning.end is not None and out.text[: out.reasoning.end].endswith("</think>")


def test_without_a_budget_the_block_runs_to_the_limit(opened: Path) -> None:
    engine = llm(opened)
    params = SamplingParams(temperature=0, max_tokens=30, reasoning=True, ignore_eos=True)
    out = engine.chat(MESSAGES, params)[0].outputs[0]
    assert out.finish_reason == "length"
    assert out.reasoning is not None and (out.reasoning.num_tokens, out.reasoning.end) == (30, None)


def test_a_budget_needs_a_reasoning_engine(opened: Path) -> None:
    engine = LLM(str(opened), kv_budget=2**23, num_threads=2)
    with pytest.raises(RequestError, match="reasoning-parser"):
        engine.chat(MESSAGES, SamplingParams(max_tokens=4, thinking_token_budget=3))


def test_stop_strings_end_the_answer_not_the_think_block(opened: Path) -> None:
    engine = llm(opened)
    free = SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=8)
    whole = engine.chat(MESSAGES, free)[0].outputs[0]
    assert whole.reasoning is not None and whole.reasoning.end is not None
    block, answer = whole.text[: whole.reasoning.end], whole.text[whole.reasoning.end :]
    in_block = next(ch for ch in block if ch.isalnum())  # a character the block writes (before its end)
    stop = next((ch for ch in answer if ch.isalnum() and ch != in_block), None)
    assert stop is not None, (block, answer)
    params = SamplingParams(temperature=0, max_tokens=60, thinking_token_budget=8, stop=[in_block, stop])
    out = engine.chat(MESSAGES, params)[0].outputs[0]
    assert out.reasoning is not None and out.reasoning.end == whole.reasoning.end
    assert (
        out.stop_reason in (in_block, stop)
        and out.text == whole.text[: whole.text.index(out.stop_reason, whole.reasoning.end)]
    )
