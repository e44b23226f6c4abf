"""The batched sampler: greedy, temperature, top-k / top-p / min-p supports and distributions, seeds that ignore the
batch, raw logprobs, forbidden tokens and logits processors.

Statistical tests draw with fixed generators, so they are deterministic; their bounds sit many standard
deviations away from the right answer and far closer to it than any wrong answer tried while writing them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from loraplex.engine.core.sampler import Sampler, SamplerOutput, SamplingMetadata, inverse_cdf
from loraplex.engine.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    generators: Sequence[torch.Generator | None] | None = None,
    forbidden: Sequence[frozenset[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seed: int = 0,
) -> SamplerOutput:
    """One sampler step; unseeded rows draw from a default generator seeded with `seed`."""
    num_rows = logits.shape[0]
    default = torch.Generator().manual_seed(seed)
    metadata = SamplingMetadata.build(
        params,
        generators if generators is not None else [None] * num_rows,
        outputs if outputs is not None else [[] for _ in range(num_rows)],
        device=logits.device,
        forbidden_token_ids=forbidden,
        default_generator=default,
    )
    return Sampler().sample(logits, metadata)


def draw(logits_row: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0) -> list[int]:
    """`num_draws` independent samples from one row: the row repeated, one step."""
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()
    return sample(logits, [params] * num_draws, seed=seed).token_ids


def from_probs(
    probs: Sequence[float], vocab: int | None = None, positions: Sequence[int] | None = None
) -> torch.Tensor:
    """A logits row whose softmax puts probs[i] on token positions[i] (default i) and ~0 elsewhere."""
    vocab = vocab or len(probs)
    positions = positions or list(range(len(probs)))
    row = torch.full((vocab,), -1e4)
    for position, p in zip(positions, probs, strict=True):
        row[position] = math.log(p)
    return row


def chi_square(counts: Counter[int], probs: torch.Tensor, num_draws: int) -> float:
    expected = probs * num_draws
    observed = torch.zeros_like(probs)
    for token, count in counts.items():
        observed[token] = count
    keep = expected > 0
    assert float(observed[~keep].sum()) == 0, "a token of probability 0 was drawn"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def chi_square_bound(degrees: int) -> float:
    """Far in the tail of chi-square(degrees): about 8 standard deviations above its mean."""
    return degrees + 8 * math.sqrt(2 * degrees) + 10


class TestGreedy:
    def test_equals_argmax(self) -> None:
        logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
        out = sample(logits, [SamplingParams(temperature=0)] * 16)
        assert out.token_ids == logits.argmax(dim=-1).tolist()
        assert out.logprobs is None

    def test_ties_go_to_the_lowest_index(self) -> None:
        logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
        assert sample(logits, [SamplingParams(temperature=0)] * 2).token_ids == [1, 0]

    def test_temperature_zero_ignores_filters_and_seed(self) -> None:
        logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
        params = SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9, seed=5)
        generators = [torch.Generator().manual_seed(5) for _ in range(8)]
        out = sample(logits, [params] * 8, generators=generators)
        assert out.token_ids == logits.argmax(dim=-1).tolist()

    def test_mixed_batch_keeps_greedy_rows_greedy(self) -> None:
        logits = torch.randn(12, 400, generator=torch.Generator().manual_seed(3))
        params = [SamplingParams(temperature=0) if i % 3 == 0 else SamplingParams(top_k=2) for i in range(12)]
        out = sample(logits, params)
        top2 = logits.topk(2, dim=-1).indices
        for i, token in enumerate(out.token_ids):
            if i % 3 == 0:
                assert token == int(logits[i].argmax())
            else:
                assert token in top2[i].tolist()


class TestTemperature:
    def test_draws_follow_softmax_of_scaled_logits(self) -> None:
        row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
        num_draws = 20_000
        for temperature in (0.7, 1.0, 1.8):
            counts = Counter(draw(row, SamplingParams(temperature=temperature), num_draws))
            expected = (row / temperature).softmax(dim=-1)
            assert chi_square(counts, expected, num_draws) < chi_square_bound(5), temperature

    def test_wrong_temperature_is_detected(self) -> None:
        """The bound above is tight enough to tell temperature 0.7 from 1.0 (so the test above can fail)."""
        row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
        counts = Counter(draw(row, SamplingParams(temperature=0.7), 20_000))
        assert chi_square(counts, row.softmax(dim=-1), 20_000) > 10 * chi_square_bound(5)

    def test_large_vocab_spanning_blocks(self) -> None:
        """Tokens spread over several of the inverse CDF's blocks, vocab not a multiple of the block."""
        row = torch.randn(300, generator=torch.Generator().manual_seed(4)) * 0.7
        num_draws = 30_000
        counts = Counter(draw(row, SamplingParams(), num_draws, seed=1))
        assert chi_square(counts, row.softmax(dim=-1), num_draws) < chi_square_bound(299)

    def test_forbidden_heavy_tokens_in_one_block(self) -> None:
        """Most mass in the last block and on the last token: edges of the block search."""
        probs = [0.05, 0.05, 0.3, 0.6]
        row = from_probs(probs, vocab=259, positions=[0, 127, 256, 258])
        num_draws = 20_000
        counts = Counter(draw(row, SamplingParams(), num_draws, seed=2))
        assert set(counts) <= {0, 127, 256, 258}
        expected = torch.zeros(259)
        expected[[0, 127, 256, 258]] = torch.tensor(probs)
        assert chi_square(counts, expected, num_draws) < chi_square_bound(3)


class TestInverseCdfEdges:
    """The draw from one uniform never lands on a zero-weight token, whatever the uniform."""

    @pytest.mark.parametrize("uniform", [0.0, 1e-12, 0.5, 1.0 - 2**-24])
    def test_zero_weight_tokens_are_never_drawn(self, uniform: float) -> None:
        weights = torch.zeros(4, 300)
        weights[0, [1, 299]] = torch.tensor([0.25, 0.75])  # zero first token, last token in a padded block
        weights[1, 130] = 1.0  # a single token, blocks of zeros before and after
        weights[2, [0, 127, 128, 255]] = torch.tensor([1e-30, 0.5, 0.5, 1e-30])
        weights[3] = torch.rand(300, generator=torch.Generator().manual_seed(0)) * (torch.arange(300) % 2)
        drawn = inverse_cdf(weights, torch.full((4,), uniform)).tolist()
        for row, token in enumerate(drawn):
            assert weights[row, token] > 0, (row, token)

    def test_uniform_picks_the_interval(self) -> None:
        weights = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5]])
        picks = [int(inverse_cdf(weights, torch.tensor([u]))[0]) for u in (0.0, 0.19, 0.21, 0.49, 0.51, 0.99)]
        assert picks == [1, 1, 3, 3, 4, 4]


def support(logits_row: torch.Tensor, params: SamplingParams, num_draws: int = 4000) -> set[int]:
    return set(draw(logits_row, params, num_draws))


class TestTopK:
    def test_keeps_exactly_the_k_largest(self) -> None:
        row = torch.tensor([0.0, 5.0, 1.0, 4.0, 2.0, 3.0])
        # A high temperature flattens the kept tokens so that every one of them shows up.
        assert support(row, SamplingParams(top_k=3, temperature=5.0)) == {1, 3, 5}
        assert support(row, SamplingParams(top_k=1, temperature=5.0)) == {1}

    def test_ties_at_the_kth_value_are_kept(self) -> None:
        row = torch.tensor([3.0, 2.0, 1.0, 2.0, 0.0])
        assert support(row, SamplingParams(top_k=2, temperature=5.0)) == {0, 1, 3}

    @pytest.mark.parametrize("top_k", [0, -1, 6, 1000])
    def test_no_limit_or_k_past_the_vocab_keeps_all(self, top_k: int) -> None:
        row = torch.tensor([0.0, 5.0, 1.0, 4.0, 2.0, 3.0])
        assert support(row, SamplingParams(top_k=top_k, temperature=20.0)) == set(range(6))

    def test_rows_with_different_k(self) -> None:
        row = torch.tensor([0.0, 5.0, 1.0, 4.0, 2.0, 3.0])
        logits = row.repeat(3000, 1)
        ks = [1, 2, 0]
        out = sample(logits, [SamplingParams(top_k=ks[i % 3], temperature=5.0) for i in range(3000)])
        supports = [{t for i, t in enumerate(out.token_ids) if i % 3 == r} for r in range(3)]
        assert supports == [{1}, {1, 3}, set(range(6))]

    def test_draws_follow_the_renormalized_top_k(self) -> None:
        probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
        num_draws = 20_000
        counts = Counter(draw(probs.log(), SamplingParams(top_k=2), num_draws))
        expected = torch.tensor([4 / 7, 3 / 7, 0.0, 0.0])
        assert chi_square(counts, expected, num_draws) < chi_square_bound(1)


class TestTopP:
    PROBS = (0.5, 0.25, 0.15, 0.1)

    @pytest.mark.parametrize(
        ("top_p", "kept"),
        [(0.3, {0}), (0.5, {0}), (0.7, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
    )
    def test_keeps_the_smallest_most_likely_set_reaching_top_p(self, top_p: float, kept: set[int]) -> None:
        # The tokens sit far apart and out of index order, in different blocks of a 600-token vocab.
        positions = [411, 3, 270, 599]
        row = from_probs(self.PROBS, vocab=600, positions=positions)
        assert support(row, SamplingParams(top_p=top_p)) == {positions[i] for i in kept}

    def test_tiny_top_p_keeps_the_most_likely_token(self) -> None:
        row = torch.randn(500, generator=torch.Generator().manual_seed(5))
        assert support(row, SamplingParams(top_p=1e-9), num_draws=500) == {int(row.argmax())}

    def test_flat_distribution_keeps_at_least_one(self) -> None:
        assert len(support(torch.zeros(1000), SamplingParams(top_p=1e-6), num_draws=200)) >= 1

    def test_ties_at_the_edge_are_kept(self) -> None:
        row = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
        assert support(row, SamplingParams(top_p=0.5)) == {0, 1, 2, 3}

    def test_applies_to_the_top_k_renormalized_distribution(self) -> None:
        # After top_k=2: [4/7, 3/7]. The mass above token 1 is 4/7 >= 0.5, so only token 0 stays; on the
        # full distribution token 1 would stay (0.4 < 0.5).
        row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
        assert support(row, SamplingParams(top_k=2, top_p=0.5)) == {0}
        assert support(row, SamplingParams(top_p=0.5)) == {0, 1}

    def test_draws_follow_the_renormalized_nucleus(self) -> None:
        """Rejection sampling must not bias the kept tokens."""
        num_draws = 20_000
        counts = Counter(draw(torch.tensor(self.PROBS).log(), SamplingParams(top_p=0.8), num_draws))
        expected = torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9
        assert chi_square(counts, expected, num_draws) < chi_square_bound(2)

    def test_matches_a_sorted_reference_on_random_rows(self) -> None:
        generator = torch.Generator().manual_seed(6)
        num_rows, vocab, repeats = 16, 300, 200
        rows = torch.randn(num_rows, vocab, generator=generator) * 2
        top_ps = [0.2 + 0.05 * i for i in range(num_rows)]
        logits = rows.repeat_interleave(repeats, dim=0)
        params = [SamplingParams(top_p=p, temperature=0.8) for p in top_ps for _ in range(repeats)]
        tokens = sample(logits, params).token_ids
        for r in range(num_rows):
            probs, order = (rows[r] / 0.8).softmax(dim=-1).sort(descending=True)
            mass_before = probs.cumsum(dim=-1) - probs
            nucleus = set(order[mass_before < top_ps[r]].tolist())
            drawn = set(tokens[r * repeats : (r + 1) * repeats])
            assert drawn <= nucleus
            assert int(order[0]) in drawn


class TestMinP:
    def test_drops_tokens_below_min_p_times_the_max(self) -> None:
        row = torch.tensor([0.05, 0.5, 0.2, 0.1, 0.15]).log()
        # threshold 0.3 * 0.5 = 0.15: keeps 0.5, 0.2 and 0.15.
        assert support(row, SamplingParams(min_p=0.3)) == {1, 2, 4}
        assert support(row, SamplingParams(min_p=1.0)) == {1}
        assert support(row, SamplingParams(min_p=0.0)) == {0, 1, 2, 3, 4}

    def test_applies_after_temperature(self) -> None:
        row = torch.tensor([0.5, 0.2, 0.3]).log()
        # At temperature 0.5, p is proportional to [0.25, 0.04, 0.09]: 0.04 < 0.2 * 0.25 is dropped.
        assert support(row, SamplingParams(min_p=0.2, temperature=0.5)) == {0, 2}
        assert support(row, SamplingParams(min_p=0.2)) == {0, 1, 2}

    def test_combined_with_top_k_and_top_p(self) -> None:
        row = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.07]).log()
        assert support(row, SamplingParams(top_k=4, top_p=0.99, min_p=0.5)) == {0, 1, 2}
        # After top_k=4 the kept mass is 0.85; the mass above token 2 is 0.55 / 0.85 = 0.65.
        assert support(row, SamplingParams(top_k=4, top_p=0.6, min_p=0.1)) == {0, 1}
        assert support(row, SamplingParams(top_k=4, top_p=0.7, min_p=0.1)) == {0, 1, 2}
        assert support(row, SamplingParams(top_k=2, top_p=0.99, min_p=0.1)) == {0, 1}


class TestSeeds:
    VOCAB = 500

    def step_logits(self, step: int) -> torch.Tensor:
        return torch.randn(self.VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 2

    def run(self, seed: int, layout: str, steps: int = 40) -> list[int]:
        """Generate `steps` tokens for one seeded request placed in a batch of the given layout."""
        params = SamplingParams(seed=seed, temperature=0.9, top_p=0.9, top_k=100)
        own = torch.Generator().manual_seed(seed)
        tokens = []
        for step in range(steps):
            batch_params: list[SamplingParams] = []
            generators: list[torch.Generator | None] = []
            rows: list[torch.Tensor] = []
            position = -1
            for kind in layout:
                if kind == "S":
                    position = len(rows)
                    batch_params.append(params)
                    generators.append(own)
                    rows.append(self.step_logits(step))
                    continue
                other = torch.randn(self.VOCAB, generator=torch.Generator().manual_seed(step * 31 + len(rows)))
                if kind == "g":
                    batch_params.append(SamplingParams(temperature=0))
                    generators.append(None)
                elif kind == "u":
                    batch_params.append(SamplingParams(top_p=0.3, min_p=0.05))
                    generators.append(None)
                else:  # "o": another seeded request
                    batch_params.append(SamplingParams(seed=len(rows), top_p=0.5))
                    generators.append(torch.Generator().manual_seed(len(rows) + step))
                rows.append(other)
            out = sample(torch.stack(rows), batch_params, generators=generators, seed=step * 7 + len(layout))
            tokens.append(out.token_ids[position])
        return tokens

    def test_independent_of_batch_composition_and_position(self) -> None:
        alone = self.run(seed=1234, layout="S")
        for layout in ("Suuu", "uuuS", "guSo", "ooooSgggu", "uoguoguoS", "Su" + "u" * 30):
            assert self.run(seed=1234, layout=layout) == alone, layout

    def test_another_seed_gives_other_tokens(self) -> None:
        assert self.run(seed=1234, layout="S") != self.run(seed=4321, layout="S")

    def test_the_generator_advances_between_steps(self) -> None:
        logits = torch.zeros(1, 1000)
        generator = torch.Generator().manual_seed(9)
        tokens = [sample(logits, [SamplingParams(seed=9)], generators=[generator]).token_ids[0] for _ in range(10)]
        assert len(set(tokens)) > 5

    def test_unseeded_rows_use_the_default_generator(self) -> None:
        logits = torch.zeros(64, 1000)
        params = [SamplingParams()] * 64
        assert sample(logits, params, seed=1).token_ids == sample(logits, params, seed=1).token_ids
        assert sample(logits, params, seed=1).token_ids != sample(logits, params, seed=2).token_ids


class TestForbiddenTokens:
    def test_never_sampled_even_when_most_likely(self) -> None:
        row = torch.zeros(200)
        row[7] = 30.0
        row[150] = 29.0
        num_rows = 2000
        logits = row.repeat(num_rows, 1)
        params = [SamplingParams(temperature=0) if i % 4 == 0 else SamplingParams() for i in range(num_rows)]
        forbidden = [frozenset({7, 150}) if i % 2 == 0 else frozenset() for i in range(num_rows)]
        tokens = sample(logits, params, forbidden=forbidden).token_ids
        assert all(t not in (7, 150) for t in tokens[0::2])
        assert tokens[0] == 0  # greedy: the lowest of the remaining ties
        assert set(tokens[1::2]) <= {7, 150}
        assert tokens[1::2].count(7) > tokens[1::2].count(150)

    def test_ids_past_the_vocab_are_ignored(self) -> None:
        logits = torch.tensor([[0.0, 5.0, 1.0]])
        out = sample(logits, [SamplingParams(temperature=0)], forbidden=[frozenset({1, 99})])
        assert out.token_ids == [2]

    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(top_k=5, logits_processors=[lambda ids, row: row.mul_(2)]),
            SamplingParams(top_k=5, top_p=0.3, min_p=0.1),
            SamplingParams(temperature=0.5, top_p=0.3, logprobs=2),
            SamplingParams(temperature=0),
        ],
    )
    def test_caller_logits_are_unchanged(self, params: SamplingParams) -> None:
        logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(7))
        before = logits.clone()
        sample(logits, [params] * 3, forbidden=[frozenset({1, 2}), frozenset(), frozenset()])
        sample(logits, [params] * 3)
        assert torch.equal(logits, before)


class TestLogitsProcessors:
    def test_applied_to_their_own_row_with_its_output_ids(self) -> None:
        seen: list[list[int]] = []

        def ban_argmax(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            seen.append(list(output_token_ids))
            banned = logits.clone()
            banned[int(logits.argmax())] = float("-inf")
            return banned

        logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(8))
        params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logits_processors=[ban_argmax])] * 2
        out = sample(logits.repeat(2, 1)[:4], params, outputs=[[1], [2, 3], [4], [5]])
        second_best = logits.topk(2, dim=-1).indices[:, 1]
        assert out.token_ids == [
            int(logits[0].argmax()),
            int(second_best[1]),
            int(logits[2].argmax()),
            int(second_best[0]),
        ]
        assert seen == [[2, 3], [5]]

    def test_in_place_processors_chain_in_order(self) -> None:
        def boost_last(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[-1] += 100.0
            return logits

        def ban_last(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[-1] = float("-inf")
            return logits

        logits = torch.zeros(2, 10)
        out = sample(
            logits,
            [
                SamplingParams(temperature=0, logits_processors=[boost_last]),
                SamplingParams(temperature=0, logits_processors=[boost_last, ban_last]),
            ],
        )
        assert out.token_ids == [9, 0]

    def test_forbidden_tokens_win_over_processors(self) -> None:
        def boost(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            return logits + torch.nn.functional.one_hot(torch.tensor(3), 10) * 100

        out = sample(
            torch.zeros(1, 10),
            [SamplingParams(temperature=0, logits_processors=[boost])],
            forbidden=[frozenset({3})],
        )
        assert out.token_ids == [0]


class TestLogprobs:
    def test_raw_logprobs_top_n_and_rank(self) -> None:
        generator = torch.Generator().manual_seed(9)
        logits = torch.randn(6, 400, generator=generator) * 3
        params = [
            SamplingParams(logprobs=5, temperature=0.5, top_k=20),
            SamplingParams(logprobs=0),
            SamplingParams(),
            SamplingParams(logprobs=20, temperature=0),
            SamplingParams(logprobs=3, top_p=0.5, logits_processors=[lambda ids, row: row.flip(0)]),
            SamplingParams(logprobs=1, temperature=2.0),
        ]
        forbidden = [frozenset(), frozenset({int(logits[1].argmax())})] + [frozenset()] * 4
        out = sample(logits, params, forbidden=forbidden)
        assert out.logprobs is not None
        assert out.logprobs[2] is None
        raw = logits.log_softmax(dim=-1)
        for i, entry in enumerate(out.logprobs):
            num_top = params[i].logprobs
            if num_top is None:
                continue
            assert entry is not None
            token = out.token_ids[i]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(raw[i, token]), abs=1e-5)
            assert entry.rank == int((raw[i] > raw[i, token]).sum()) + 1
            assert len(entry.top) == num_top
            values = [value for _, value in entry.top]
            assert values == sorted(values, reverse=True)
            expected = raw[i].topk(num_top)
            assert [token for token, _ in entry.top] == expected.indices.tolist()
            assert values == pytest.approx(expected.values.tolist(), abs=1e-5)
        assert out.logprobs[3] is not None
        assert out.logprobs[3].rank == 1
        # The forbidden argmax of row 1 and the processor of row 4 do not change the logprobs: they are raw.
        assert out.logprobs[1] is not None
        assert out.logprobs[1].rank >= 2

    def test_none_when_no_row_asks(self) -> None:
        assert sample(torch.randn(3, 10), [SamplingParams()] * 3).logprobs is None

    def test_more_logprobs_than_vocab(self) -> None:
        out = sample(torch.tensor([[1.0, 2.0, 3.0]]), [SamplingParams(temperature=0, logprobs=20)])
        assert out.logprobs is not None
        entry = out.logprobs[0]
        assert entry is not None
        assert [token for token, _ in entry.top] == [2, 1, 0]


class TestShapes:
    def test_empty_batch(self) -> None:
        assert sample(torch.empty(0, 10), []).token_ids == []

    def test_rows_must_match_the_metadata(self) -> None:
        metadata = SamplingMetadata.build([SamplingParams()], [None], [[]], device="cpu")
        with pytest.raises(ValueError, match="logits must be"):
            Sampler().sample(torch.zeros(2, 10), metadata)

    def test_build_wants_one_entry_per_row(self) -> None:
        with pytest.raises(ValueError, match="one entry per row"):
            SamplingMetadata.build([SamplingParams()] * 2, [None], [[], []], device="cpu")

    def test_token_ids_are_python_ints(self) -> None:
        out = sample(torch.randn(4, 10), [SamplingParams(), SamplingParams(temperature=0)] * 2)
        assert all(type(t) is int for t in out.token_ids)
