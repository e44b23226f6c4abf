"""The load-adaptive policy: speculation fills the step's free room with the proposals most likely to be kept, and
stops when the room is gone; each row's acceptance estimate follows what its verifications saw; the gate turns
speculation off at a batch size where speculating steps were measured slower, and keeps checking."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import pytest

from loraplex.engine.core.request import Request
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.speculation_policy import (
    DEFAULT_MIN_GAIN,
    PRIOR_RATE,
    AcceptanceEstimate,
    SpeculationGate,
    StepCostModel,
    batch_bucket,
    free_tokens,
    plan_speculative_lengths,
)
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.core.speculator import Speculator

pytestmark = pytest.mark.unit


def reference(rates: list[float], max_k: list[int], free: int, min_gain: float) -> list[int]:
    """The module docstring's semantics, as a loop."""
    gains = [(-(rate**j), i, j) for i, rate in enumerate(rates) for j in range(1, max_k[i] + 1)]
    chosen = [g for g in sorted(gains)[: max(free, 0)] if -g[0] >= min_gain]
    return [sum(1 for _, i, _ in chosen if i == row) for row in range(len(rates))]


def test_a_lone_row_with_room_speculates_as_far_as_it_is_likely_kept() -> None:
    assert plan_speculative_lengths([0.8], [4], free_tokens=100) == [4]  # 0.8**4 = 0.41 >= 0.3
    assert plan_speculative_lengths([0.6], [4], free_tokens=100) == [2]  # 0.6**2 = 0.36, 0.6**3 = 0.22
    assert plan_speculative_lengths([0.2], [4], free_tokens=100) == [0]  # not worth its verification


def test_a_compute_bound_step_speculates_nothing() -> None:
    rates, caps = [0.9] * 64, [4] * 64
    assert plan_speculative_lengths(rates, caps, free_tokens=0) == [0] * 64
    # 64 decoding rows past a knee of 48 tokens: no room at all.
    room = free_tokens(scheduled_tokens=64, token_budget=4096, knee_tokens=48)
    assert room == 0
    assert plan_speculative_lengths(rates, caps, free_tokens=room) == [0] * 64


def test_little_room_goes_to_the_rows_most_likely_to_keep_it() -> None:
    counts = plan_speculative_lengths([0.9, 0.5, 0.95], [4, 4, 4], free_tokens=5)
    assert counts == [1, 0, 4]  # gains .95 .9025 .9 .857 .8145 beat .81 and .5
    assert sum(counts) == 5


def test_caps_hold_and_room_is_what_the_budget_and_the_knee_leave() -> None:
    assert plan_speculative_lengths([1.0, 1.0], [1, 3], free_tokens=100) == [1, 3]
    assert free_tokens(scheduled_tokens=10, token_budget=4096, knee_tokens=32) == 22
    assert free_tokens(scheduled_tokens=10, token_budget=16, knee_tokens=32) == 6
    assert free_tokens(scheduled_tokens=40, token_budget=4096, knee_tokens=32) == 0


def test_matches_the_reference_on_a_grid() -> None:
    rates = [0.0, 0.3, 0.55, 0.55, 0.8, 1.0]
    for caps in itertools.product([0, 2, 4], repeat=3):
        for free in (0, 1, 3, 7, 100):
            for min_gain in (0.1, 0.3, 0.9):
                rows = rates[: len(caps)]
                assert plan_speculative_lengths(rows, list(caps), free_tokens=free, min_gain=min_gain) == reference(
                    rows, list(caps), free, min_gain
                ), (rows, caps, free, min_gain)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        plan_speculative_lengths([0.5, 0.5], [4], free_tokens=3)
    with pytest.raises(ValueError, match="min_gain"):
        plan_speculative_lengths([0.5], [4], free_tokens=3, min_gain=0)
    assert plan_speculative_lengths([], [], free_tokens=3) == []


def test_the_estimate_follows_what_verification_saw_and_rests_back_to_the_prior() -> None:
    estimate = AcceptanceEstimate()
    assert estimate.rate == PRIOR_RATE
    for _ in range(30):
        estimate.observe(proposed=4, accepted=4)
    assert estimate.rate > 0.95
    for _ in range(30):
        estimate.observe(proposed=4, accepted=0)
    assert estimate.rate < 0.25
    low = estimate.rate
    for _ in range(60):  # switched off: its evidence fades, so it is tried again one day
        estimate.rest()
    assert low < estimate.rate and abs(estimate.rate - PRIOR_RATE) < 0.05
    # One in two proposals kept, stopping at the first refusal: the estimate settles near a half.
    estimate = AcceptanceEstimate()
    for _ in range(200):
        estimate.observe(proposed=2, accepted=1)
    assert 0.45 < estimate.rate < 0.55
    with pytest.raises(ValueError, match="between 0 and proposed"):
        estimate.observe(proposed=2, accepted=3)


def test_the_step_cost_model_learns_what_a_token_costs() -> None:
    model = StepCostModel()
    assert model.fit() is None
    assert model.min_gain(num_tokens=8, num_rows=8) == DEFAULT_MIN_GAIN  # nothing known: the floor
    for _ in range(3):
        model.observe(16, 0.01)
    assert model.fit() is None  # one step size only: the slope is unknown
    model = StepCostModel()
    for tokens in [1, 4, 16, 64, 128, 2, 32, 8] * 5:
        model.observe(tokens, 0.004 + 0.0001 * tokens)
    fitted = model.fit()
    assert fitted is not None
    a, b = fitted
    assert a == pytest.approx(0.004, rel=1e-6) and b == pytest.approx(0.0001, rel=1e-6)
    # Four decoding rows: a step of 4 tokens costs 4.4 ms, one more token 0.1 ms, worth 4 / 4.4 * 0.1 of a token.
    assert model.min_gain(num_tokens=4, num_rows=4) == DEFAULT_MIN_GAIN
    # 64 rows: each token costs 0.1 ms of a 10.4 ms step that emits 64 tokens: a proposal needs a 62% chance.
    assert model.min_gain(num_tokens=64, num_rows=64) == pytest.approx(0.0001 * 64 / 0.0104)


def test_where_every_token_costs_its_share_no_proposal_pays() -> None:
    model = StepCostModel()
    for tokens in [1, 8, 64, 256] * 5:
        model.observe(tokens, 0.001 * tokens)  # no fixed cost at all
    assert model.min_gain(num_tokens=32, num_rows=32) == pytest.approx(1.0)
    assert plan_speculative_lengths([0.99], [4], free_tokens=100, min_gain=1.0) == [0]


def run_gate(gate: SpeculationGate, num_rows: int, steps: int, rate_on: float, rate_off: float) -> list[bool]:
    """`steps` decisions of a gate whose speculating steps emit `rate_on` tokens a second and the others `rate_off`."""
    decisions = []
    for _ in range(steps):
        on = gate.allows(num_rows)
        decisions.append(on)
        gate.observe(num_rows, speculated=on, num_emitted=num_rows, seconds=num_rows / (rate_on if on else rate_off))
    return decisions


def test_the_gate_measures_both_ways_then_takes_the_faster_and_checks_less_and_less() -> None:
    gate = SpeculationGate(explore_every=10, max_interval=40, warmup=3)
    first = run_gate(gate, 64, 6, rate_on=90.0, rate_off=100.0)
    assert first == [True] * 3 + [False] * 3  # each side measured three times
    later = run_gate(gate, 64, 150, rate_on=90.0, rate_off=100.0)
    # Slower to speculate: only the checks, after 10, 20, 40, 40, 40 steps.
    assert [i + 1 for i, on in enumerate(later) if on] == [10, 30, 70, 110, 150]
    assert gate.ratio(64) == pytest.approx(0.9)
    # The load changes and speculation pays again: the next check sees it, and the gate turns back for good.
    turned = run_gate(gate, 64, 80, rate_on=150.0, rate_off=100.0)
    first_on = turned.index(True)
    assert first_on < 40
    assert all(turned[first_on : first_on + 10])
    assert sum(turned[first_on:]) >= len(turned) - first_on - 2


def test_buckets_keep_batch_sizes_apart() -> None:
    gate = SpeculationGate(explore_every=10, max_interval=40, warmup=2)
    run_gate(gate, 1, 30, rate_on=200.0, rate_off=100.0)
    run_gate(gate, 64, 30, rate_on=80.0, rate_off=100.0)
    assert sum(run_gate(gate, 64, 40, rate_on=80.0, rate_off=100.0)) <= 2
    assert sum(run_gate(gate, 1, 40, rate_on=200.0, rate_off=100.0)) >= 38
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 64)] == [1, 2, 3, 4, 5, 6, 6, 6, 7, 8, 9, 12]


class _FixedProposer:
    """Proposes the same four tokens for every row."""

    pays_per_token = False

    def propose(self, rows: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [[5, 6, 7, 8][:limit] for limit in limits]

    def release(self, request: Request) -> None:
        pass


def lone_row() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64), max_tokens=64)


@pytest.mark.parametrize("use_clock", [True, False])
def test_without_the_clock_the_gate_and_the_step_cost_are_not_consulted(use_clock: bool) -> None:
    """Steps measured both ways, speculating ones three times slower: with the clock the speculator stops proposing
    (but for its checks); without it, it proposes as the room and the row's acceptance say, every step."""
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    speculator = Speculator(config, knee_tokens=64, proposer=_FixedProposer(), use_clock=use_clock)
    for step in range(40):
        speculated = step % 2 == 0
        # Every token costs a step its full share (the cost model's min_gain is then 1), and speculating is slower.
        tokens = 5 if speculated else 1
        speculator.observe_step(tokens, 0.003 * tokens, num_rows=1, num_emitted=1, speculated=speculated)
    plans = [
        speculator.plan([lone_row()], scheduled_tokens=1, token_budget=256, num_sampling_rows=1)[0] for _ in range(10)
    ]
    if use_clock:
        assert sum(1 for plan in plans if plan) <= 1
    else:
        assert plans == [[5]] * 10  # the prior rate (0.5) keeps one proposal above the 0.3 floor


class _EmptyProposer(_FixedProposer):
    """Asked, it spends (as a draft catching up would) and proposes nothing."""

    def propose(self, rows: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [[] for _ in rows]


def test_a_step_that_asked_the_proposer_counts_as_speculating_even_if_nothing_came_back() -> None:
    """Its cost is speculation's: the gate books it on the speculating side, and the step-cost model (what a target
    token costs) leaves it out."""
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    speculator = Speculator(config, knee_tokens=64, proposer=_EmptyProposer())
    assert speculator.plan([lone_row()], scheduled_tokens=1, token_budget=256, num_sampling_rows=1) == [[]]
    assert speculator.asked
    before = dataclasses.replace(speculator.cost)
    speculator.observe_step(1, 0.05, num_rows=1, num_emitted=1, speculated=speculator.asked)
    bucket = speculator.gate.buckets[batch_bucket(1)]
    assert (bucket.num_on, bucket.num_off) == (1, 0)
    assert speculator.cost == before
    speculator.observe_step(1, 0.05, num_rows=1, num_emitted=1, speculated=False)
    assert speculator.cost != before  # an ordinary step is a target's step
    # No room: the proposer is not asked, and the step is an ordinary one.
    speculator.plan([lone_row()], scheduled_tokens=64, token_budget=256, num_sampling_rows=1)
    assert not speculator.asked
