"""n-gram speculative decoding in the engine, on the demo model (trained: its greedy answers repeat themselves, as
copy-heavy outputs do): greedy output is token for token the engine's without speculation, for base and LoRA rows
in one batch, with chunked prefill, preemption and the prefix cache on; proposals are verified and mostly kept; a
step without room speculates nothing; rows whose sampling is not plain greedy do not speculate yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "demo" / "model"
UPPER = REPO / "demo" / "adapters" / "upper"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [
    'The "for" statement is used to iterate over the elements of a sequence. The "for" statement',
    'Tell me about the "json" module.',
    'The "if" statement is used for conditional execution: The "if"',
    "What is the difference between a list and a tuple?",
    'The "while" statement is used for repeated execution as long as an expression is true. The "while"',
    'Tell me about the "try" statement.',
]


def demo(**options: Any) -> LLM:
    return LLM(DEMO, device="cpu", dtype="float32", **options)


def run(llm: LLM, loras: list[LoRARequest | None]) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


def totals(llm: LLM) -> tuple[int, int]:
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    counts = speculator.stats.by_adapter.values()
    return sum(c.num_proposed for c in counts), sum(c.num_accepted for c in counts)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 32},  # prompts prefilled in chunks
        {"kv_budget": 8 * 64 * 2**10, "max_model_len": 96},  # 8 pages: requests are preempted and recomputed
    ],
    ids=["plain", "chunked-prefill", "preemption"],
)
def test_greedy_output_is_the_engines_without_speculation(options: dict[str, Any]) -> None:
    lora = LoRARequest("upper", str(UPPER))
    loras = [lora if i % 2 else None for i in range(len(PROMPTS))]
    plain = demo(**options)
    expected = run(plain, loras)
    speculative = demo(speculative_config=NGRAM, speculative_knee_tokens=64, **options)
    assert run(speculative, loras) == expected
    proposed, accepted = totals(speculative)
    assert proposed > 0
    assert accepted > proposed / 3  # the demo model repeats itself: most proposals are kept
    speculator = speculative.engine.scheduler.speculator
    assert speculator is not None
    if "kv_budget" not in options:  # a full pool leaves some rows no room to grow for proposals
        assert set(speculator.stats.by_adapter) == {"", "upper"}
    else:
        assert speculative.engine.num_preemptions > 0
        assert plain.engine.num_preemptions > 0


def test_prompts_that_continue_earlier_answers_find_them_cached_and_answer_the_same() -> None:
    """Only verified tokens reach the prefix cache: what a second request finds there is what it would compute."""
    llm = demo(speculative_config=NGRAM, speculative_knee_tokens=64)
    first = llm.generate(PROMPTS, GREEDY)
    again: list[Any] = [
        {"prompt_token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:24]} for o in first
    ]
    second = llm.generate(again, GREEDY)
    expected = demo().generate(again, GREEDY)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in expected]
    assert all(o.num_cached_tokens > 0 for o in second)


def test_a_step_without_room_speculates_nothing() -> None:
    """Six decoding rows and a knee of six tokens: no room, nothing proposed, the output unchanged. A lone row
    with the same knee has room, and speculates."""
    llm = demo(speculative_config=SpeculativeConfig.parse(NGRAM), speculative_knee_tokens=len(PROMPTS))
    assert run(llm, [None] * len(PROMPTS)) == run(demo(), [None] * len(PROMPTS))
    assert totals(llm) == (0, 0)
    llm.generate(PROMPTS[0], GREEDY)
    assert totals(llm)[0] > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=1),
    ],
    ids=["penalty", "logprobs", "sampling"],
)
def test_rows_whose_sampling_is_not_plain_greedy_do_not_speculate_yet(params: SamplingParams) -> None:
    llm = demo(speculative_config=NGRAM, speculative_knee_tokens=64)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert got == [o.outputs[0].token_ids for o in demo().generate(PROMPTS[:2], params)]
    assert totals(llm) == (0, 0)


def test_logit_bias_holds_on_speculated_tokens() -> None:
    tokenizer = demo().get_tokenizer()
    banned = tokenizer.encode(" statement", add_special_tokens=False)[0]
    favoured = tokenizer.encode(" the", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logit_bias={banned: -100, favoured: 2.5})
    llm = demo(speculative_config=NGRAM, speculative_knee_tokens=64)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == [o.outputs[0].token_ids for o in demo().generate(PROMPTS, params)]
    assert all(banned not in tokens for tokens in got)
    assert totals(llm)[0] > 0


def test_stop_strings_and_max_tokens_hold_inside_speculated_tokens() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=37, stop=['"except"'])
    llm = demo(speculative_config=NGRAM, speculative_knee_tokens=64)
    got = llm.generate(PROMPTS, params)
    expected = demo().generate(PROMPTS, params)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == [
        (o.outputs[0].text, o.outputs[0].finish_reason) for o in expected
    ]
    assert all(len(o.outputs[0].token_ids) <= 37 for o in got)
