"""n-gram speculative decoding in the engine, on the demo model (trained: its greedy answers repeat themselves, as
copy-heavy outputs do): greedy output is token for token the engine's without speculation, for base and LoRA rows
in one batch, with chunked prefill, preemption and the prefix cache on; proposals are verified and mostly kept; a
step without room speculates nothing; rows of every sampling kind (penalties, logprobs, min_tokens, seeded sampling,
grammars) speculate and answer as without it; rows with logits processors do not speculate."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _support.speculation import DEMO, GREEDY, PROMPTS, UPPER

from loraplex.engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from loraplex.engine.core.request import Request
from loraplex.engine.core.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.unit

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def demo(**options: Any) -> LLM:
    """The demo model; with speculation, deciding from acceptance and room alone (not the clock), so how much is
    proposed and kept does not depend on this machine's load."""
    if "speculative_config" in options:
        options.setdefault("speculative_use_clock", False)
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


NAME = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 48}}, "required": ["name"]}
GRAMMAR_PROMPT = 'Repeat it: {"name": "the for statement"} {"name": "the for statement"} {"name": "the'
KINDS = {
    "penalties": SamplingParams(
        temperature=0.0,
        max_tokens=40,
        ignore_eos=True,
        repetition_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
    ),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3),
    "min_tokens": SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30),
    "seeded sampling": SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_tokens=40, ignore_eos=True, seed=7),
    "seeded min_p, penalties, logprobs": SamplingParams(
        temperature=0.9, min_p=0.05, max_tokens=40, ignore_eos=True, seed=11, presence_penalty=0.4, logprobs=2
    ),
    "grammar": SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=NAME)),
    "seeded grammar": SamplingParams(
        temperature=0.8, max_tokens=40, seed=3, structured_outputs=StructuredOutputsParams(json=NAME)
    ),
}


def answers(outputs: list[Any]) -> list[tuple[list[int], str | None, list[tuple[int, float]] | None]]:
    """Each answer's tokens, finish reason and (rounded) logprobs of its tokens."""
    result = []
    for o in outputs:
        c = o.outputs[0]
        logprobs = (
            None
            if c.logprobs is None
            else [
                (token, round(position[token].logprob, 3))
                for token, position in zip(c.token_ids, c.logprobs, strict=True)
            ]
        )
        result.append((list(c.token_ids), c.finish_reason, logprobs))
    return result


def test_rows_of_every_sampling_kind_speculate_and_answer_as_without_it() -> None:
    """Penalties, logprobs, min_tokens, seeded sampling (top-p, top-k, min-p) and grammars, in one batch with greedy
    base and LoRA rows: each answer is the engine's without speculation, token for token (a seeded row draws every
    position from that position's own generator), logprobs included, and every kind verified proposals."""
    prompts = [*PROMPTS[:4], GRAMMAR_PROMPT, GRAMMAR_PROMPT, PROMPTS[4]]
    params = list(KINDS.values())
    lora = LoRARequest("upper", str(UPPER))
    loras = [lora if i % 3 == 1 else None for i in range(len(prompts))]
    speculative = demo(speculative_config=NGRAM, speculative_knee_tokens=96)
    got = speculative.generate(prompts, params, lora_request=loras)
    expected = demo().generate(prompts, params, lora_request=loras)
    assert answers(got) == answers(expected)
    assert json.loads(got[5].outputs[0].text)["name"]  # the grammar held on speculated tokens
    # Each kind speculated: alone in the engine, its row verified proposals.
    for name, kind in KINDS.items():
        alone = demo(speculative_config=NGRAM, speculative_knee_tokens=96)
        prompt = GRAMMAR_PROMPT if kind.structured_outputs is not None else PROMPTS[0]
        assert answers(alone.generate(prompt, kind)) == answers(demo().generate(prompt, kind)), name
        assert totals(alone)[0] > 0, name


def test_a_seeded_answer_does_not_depend_on_the_batch_around_it() -> None:
    """With speculation the steps a row speculates in depend on the batch (its room); its answer does not."""
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=42)
    alone = demo(speculative_config=NGRAM, speculative_knee_tokens=96).generate(PROMPTS[0], params)
    crowded = demo(speculative_config=NGRAM, speculative_knee_tokens=8).generate(PROMPTS, params)
    assert crowded[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_rows_with_logits_processors_do_not_speculate() -> None:
    seen: list[int] = []

    def count(output_ids: list[int], logits: Any) -> Any:
        seen.append(len(output_ids))
        return logits

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logits_processors=[count])
    llm = demo(speculative_config=NGRAM, speculative_knee_tokens=64)
    llm.generate(PROMPTS[0], params)
    assert totals(llm) == (0, 0)
    assert seen == list(range(16))  # the processor saw each position once, in order


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


# How a verifying row's positions are sampled (EngineCore.row_sampler), on crafted logits: position j sees the first j
# proposals as its own output.


def sample_positions(params: SamplingParams, proposal: list[int], favoured: list[tuple[int, float]]) -> list[int]:
    """What a row with one output token so far draws at each position of `proposal` + 1, where every position's
    logits are 0 but for `favoured` (token, logit)."""
    engine = demo().engine
    request = Request("r", [5, 6, 7], params, max_tokens=16, output_token_ids=[9])
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(len(proposal) + 1, vocab)
    for token, value in favoured:
        logits[:, token] = value
    (drawn,) = engine.row_sampler.sample([request], [proposal], logits)
    return [token for token, _ in drawn]


def test_a_position_is_penalized_for_the_proposals_before_it() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    # Token 20 leads by 0.5; once it was proposed (and so would be in the output), its penalty puts 21 first.
    assert sample_positions(params, [20, 20], [(20, 1.0), (21, 0.5)]) == [20, 21, 21]


def test_min_tokens_counts_the_proposals_before_a_position() -> None:
    eos = min(demo().engine.eos_token_ids)
    params = SamplingParams(temperature=0.0, min_tokens=3)
    # One token out: EOS is forbidden at positions 0 and 1 (outputs of 1 and 2 tokens), allowed at position 2.
    assert sample_positions(params, [30, 30], [(eos, 2.0), (30, 1.0)]) == [30, 30, eos]


def test_a_seeded_position_draws_what_it_would_draw_alone() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    favoured = [(t, 1.0) for t in range(40, 60)]
    together = sample_positions(params, [40, 41, 42], favoured)
    engine = demo().engine
    vocab = engine.model_config.vocab_size
    logits = torch.zeros(1, vocab)
    for token, value in favoured:
        logits[:, token] = value
    for j, token in enumerate(together):
        request = Request("r", [5, 6, 7], params, max_tokens=16, output_token_ids=[9, 40, 41, 42][: j + 1])
        ((alone, _),) = engine.row_sampler.sample([request], [[]], logits)[0]
        assert alone == token
