"""logit_bias, the presence / frequency / repetition penalties and grammar masks: the batched sampler's adjustments
against a plain loop over rows and tokens that states each rule as OpenAI and vLLM define it."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.core.sampler import Sampler, SamplingMetadata, adjusted_logits
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.structured_output import GrammarMasks, pack, unpack
from loraplex.engine.errors import RequestError

pytestmark = pytest.mark.unit

VOCAB = 300


def reference(
    raw: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """The rules one row and one token at a time."""
    out = raw.clone()
    for row, p in enumerate(params):
        for token, bias in p.logit_bias:
            out[row, token] += bias
        for token in range(VOCAB):
            count = outputs[row].count(token)
            out[row, token] -= p.frequency_penalty * count + p.presence_penalty * (1 if count else 0)
            if token in prompts[row] or token in outputs[row]:
                x = float(out[row, token])
                out[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    return out


def metadata(
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    grammar: GrammarMasks | None = None,
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params, [None] * len(params), outputs, device="cpu", prompt_token_ids=prompts, grammar=grammar
    )


def test_penalties_and_bias_match_the_reference() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    settings = [
        {},
        {"presence_penalty": 0.7},
        {"frequency_penalty": 0.3},
        {"presence_penalty": -0.5, "frequency_penalty": 1.5},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8, "presence_penalty": 0.2},
        {"logit_bias": {"5": 100, 7: -100, 250: 3.5}},
        {"logit_bias": {1: -2.0}, "frequency_penalty": 2.0, "repetition_penalty": 2.0},
    ]
    params = [SamplingParams(**kw) for kw in settings]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))] for _ in params]
    outputs = [[rng.randrange(20) for _ in range(rng.randint(0, 30))] for _ in params]  # repeats are likely
    raw = torch.randn(len(params), VOCAB) * 4
    got = adjusted_logits(raw, metadata(params, prompts, outputs))
    torch.testing.assert_close(got, reference(raw, params, prompts, outputs), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got[0], raw[0])  # a row without adjustments is untouched


def test_rows_without_adjustments_cost_nothing() -> None:
    raw = torch.randn(3, VOCAB)
    md = metadata([SamplingParams()] * 3, [[1]] * 3, [[2]] * 3)
    assert md.penalty_rows is None and md.bias_rows is None and md.grammar is None
    assert adjusted_logits(raw, md) is raw  # not even a copy


def test_bias_of_plus_100_forces_and_minus_100_bans() -> None:
    torch.manual_seed(1)
    raw = torch.randn(64, VOCAB) * 5
    forced = [SamplingParams(temperature=1.0, logit_bias={42: 100})] * 64
    out = Sampler().sample(raw, SamplingMetadata.build(forced, [None] * 64, [[] for _ in range(64)], device="cpu"))
    assert set(out.token_ids) == {42}
    greedy_banned = [SamplingParams(temperature=0, logit_bias={int(t): -100}) for t in raw.argmax(dim=-1)]
    out = Sampler().sample(
        raw, SamplingMetadata.build(greedy_banned, [None] * 64, [[] for _ in range(64)], device="cpu")
    )
    assert all(token != int(t) for token, t in zip(out.token_ids, raw.argmax(dim=-1), strict=True))


def test_penalties_change_greedy_choice_as_the_reference_says() -> None:
    raw = torch.zeros(1, VOCAB)
    raw[0, 10], raw[0, 11] = 2.0, 1.5
    params = [SamplingParams(temperature=0, frequency_penalty=0.3)]
    md = metadata(params, [[0]], [[10, 10]])  # 2.0 - 0.6 = 1.4 < 1.5
    assert Sampler().sample(raw, md).token_ids == [11]
    md = metadata([SamplingParams(temperature=0, frequency_penalty=0.2)], [[0]], [[10, 10]])  # 1.6 > 1.5
    assert Sampler().sample(raw, md).token_ids == [10]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("logit_bias", {"x": 1}, "logit_bias"),
        ("logit_bias", {"3": 101}, "logit_bias[3]"),
        ("logit_bias", {-1: 1}, "logit_bias"),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert caught.value.param == message


def test_pack_and_unpack_follow_xgrammar_layout() -> None:
    import xgrammar

    allowed = torch.rand(3, 96) > 0.5
    packed = pack(allowed)
    assert packed.shape == xgrammar.allocate_token_bitmask(3, 96).shape
    assert torch.equal(unpack(packed, 96), allowed)
    # xgrammar's own CPU kernel reads the same layout: it leaves exactly the allowed logits finite.
    logits = torch.zeros(3, 96)
    xgrammar.apply_token_bitmask_inplace(logits, packed)
    assert torch.equal(torch.isfinite(logits), allowed)


def test_grammar_mask_applies_to_its_rows_only() -> None:
    raw = torch.randn(3, 64)
    allowed = torch.zeros(3, 64, dtype=torch.bool)
    allowed[1, [3, 9]] = True
    masks = GrammarMasks(rows=torch.tensor([1]), bitmask=pack(allowed))
    md = SamplingMetadata.build(
        [SamplingParams(temperature=0)] * 3, [None] * 3, [[], [], []], device="cpu", grammar=masks
    )
    got = adjusted_logits(raw, md)
    torch.testing.assert_close(got[[0, 2]], raw[[0, 2]])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [3, 9]
    assert Sampler().sample(raw, md).token_ids[1] == (3 if raw[1, 3] >= raw[1, 9] else 9)
