"""Speculative verification keeps the target's distribution, token for token for greedy rows and in law for random
ones (a chi-square test on a tiny vocabulary, with drafts from another distribution and from a deterministic
proposer), and depends only on the uniforms it is given. The engine's form for deterministic proposers (sample every
position, keep proposals while they match) is the same rule: in law for random rows, token for token for greedy
ones."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.core.rejection_sampler import accepted_prefix, verify

pytestmark = pytest.mark.unit

VOCAB = 5
# The 0.999 quantile of chi-square with VOCAB - 1 = 4 degrees of freedom: a correct sampler fails 1 run in 1000.
CHI2_4_999 = 18.47


def one_hot(ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).to(torch.float32)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).to(torch.float64)
    expected = probs.to(torch.float64) * samples.shape[0]
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_rows_keep_the_argmax_prefix_and_then_emit_the_argmax() -> None:
    # Target argmaxes per position: 3, 1, 4, 0.
    target = one_hot([3, 1, 4, 0])[None].repeat(3, 1, 1)
    drafts = torch.tensor([[3, 1, 4], [3, 2, 4], [0, 1, 4]])
    result = verify(
        target,
        drafts,
        torch.tensor([3, 3, 2]),
        accept_uniforms=torch.rand(3, 3),
        draw_uniforms=torch.rand(3),
    )
    assert result.num_accepted.tolist() == [3, 1, 0]
    assert result.token_ids.tolist() == [[3, 1, 4, 0], [3, 1, -1, -1], [3, -1, -1, -1]]


def test_a_row_without_proposals_samples_its_next_token_as_usual() -> None:
    target = torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0], [0.2] * 5]])
    result = verify(target, torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0]), torch.rand(1, 1), torch.rand(1))
    assert result.num_accepted.tolist() == [0]
    assert result.token_ids.tolist() == [[2, -1]]


@pytest.mark.parametrize("drafts", ["draft model", "deterministic"])
def test_random_rows_emit_the_targets_distribution(drafts: str) -> None:
    generator = torch.Generator().manual_seed(1234)
    num_rows, max_k = 40_000, 2
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.1, 0.1, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2], [0.1, 0.1, 0.6, 0.1, 0.1]])
    target = p[None].repeat(num_rows, 1, 1)
    if drafts == "draft model":
        draft_probs = q[None].repeat(num_rows, 1, 1)
        proposals = torch.stack([torch.multinomial(q[j], num_rows, True, generator=generator) for j in range(2)], 1)
    else:  # n-gram lookup: always the same guesses, q one-hot at them
        draft_probs = None
        proposals = torch.tensor([[0, 4]]).repeat(num_rows, 1)
    result = verify(
        target,
        proposals,
        torch.full((num_rows,), max_k),
        accept_uniforms=torch.rand(num_rows, max_k, generator=generator),
        draw_uniforms=torch.rand(num_rows, generator=generator),
        draft_probs=draft_probs,
    )
    first = result.token_ids[:, 0]
    assert chi_square(first, p[0]) < CHI2_4_999
    # Given the first proposal was kept, the second token is the target's p[1], and so on.
    kept_first = result.num_accepted >= 1
    assert chi_square(result.token_ids[kept_first, 1], p[1]) < CHI2_4_999
    kept_both = result.num_accepted == 2
    assert chi_square(result.token_ids[kept_both, 2], p[2]) < CHI2_4_999
    # The acceptance rate is what the theory says: sum over tokens of min(p, q).
    if draft_probs is not None:
        expected = float(torch.minimum(p[0], q[0]).sum())
        assert abs(float(kept_first.to(torch.float32).mean()) - expected) < 0.01


def test_the_result_depends_only_on_the_uniforms() -> None:
    generator = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(8, 4, VOCAB, generator=generator), dim=-1)
    proposals = torch.randint(0, VOCAB, (8, 3), generator=generator)
    num_draft = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])
    u, v = torch.rand(8, 3, generator=generator), torch.rand(8, generator=generator)
    first = verify(target, proposals, num_draft, u, v)
    again = verify(target.clone(), proposals.clone(), num_draft.clone(), u.clone(), v.clone())
    assert torch.equal(first.token_ids, again.token_ids)
    # A row's answer does not change with the rows around it.
    alone = verify(target[3:4], proposals[3:4], num_draft[3:4], u[3:4], v[3:4])
    assert torch.equal(alone.token_ids[0], first.token_ids[3])
    emitted = first.num_accepted + 1
    assert all(int((row >= 0).sum()) == n for row, n in zip(first.token_ids, emitted, strict=True))


def test_shapes_are_checked() -> None:
    target = torch.full((2, 3, VOCAB), 1 / VOCAB)
    with pytest.raises(ValueError, match="rows, max_k"):
        verify(target, torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 1]), torch.rand(2, 2), torch.rand(2))
    with pytest.raises(ValueError, match="one entry per row"):
        verify(target, torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1]), torch.rand(2, 2), torch.rand(2))


def test_matching_drawn_tokens_is_verify_on_one_hot_targets() -> None:
    generator = torch.Generator().manual_seed(9)
    for _ in range(200):
        k = int(torch.randint(1, 5, (), generator=generator))
        argmax = torch.randint(0, 3, (k + 1,), generator=generator)
        proposal = torch.randint(0, 3, (k,), generator=generator)
        expected = verify(
            one_hot(argmax.tolist(), 3)[None], proposal[None], torch.tensor([k]), torch.rand(1, k), torch.rand(1)
        )
        kept = accepted_prefix(proposal.tolist(), argmax.tolist())
        assert kept == int(expected.num_accepted[0])
        assert [*proposal.tolist()[:kept], argmax.tolist()[kept]] == expected.token_ids[0, : kept + 1].tolist()


def test_matching_drawn_tokens_emits_the_targets_distribution_as_verify_does() -> None:
    """Sequences of 3 tokens on a 3-token vocabulary whose next-token law depends on the previous token: the engine's
    form (draw each position from p given the proposals before it, keep while the draws match) against plain
    sampling of the target, on the 27 possible sequences."""
    generator = torch.Generator().manual_seed(77)
    transition = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.3, 0.5, 0.2]])  # p(next | previous)
    start = torch.tensor([0.5, 0.3, 0.2])
    proposal = [0, 2]  # a fixed guess for the first two tokens, as n-gram lookup makes: sometimes right, sometimes not
    num_runs = 30_000
    counts = torch.zeros(27, dtype=torch.float64)
    for _ in range(num_runs):
        out: list[int] = []
        while len(out) < 3:
            guess = proposal[len(out) :]
            # Position j's law given out + guess[:j] (as the engine's virtual rows see it).
            contexts = [out + guess[:j] for j in range(len(guess) + 1)]
            laws = [start if not c else transition[c[-1]] for c in contexts]
            drawn = [int(torch.multinomial(law, 1, generator=generator)) for law in laws]
            kept = accepted_prefix(guess, drawn)
            out += [*guess[:kept], drawn[kept]]
        counts[out[0] * 9 + out[1] * 3 + out[2]] += 1
    expected = torch.tensor(
        [float(start[a] * transition[a, b] * transition[b, c]) for a in range(3) for b in range(3) for c in range(3)],
        dtype=torch.float64,
    )
    expected *= num_runs
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < 54.05  # the 0.999 quantile of chi-square with 26 degrees of freedom


def test_accepted_prefix_needs_one_drawn_token_more_than_proposals() -> None:
    with pytest.raises(ValueError, match="3 drawn tokens"):
        accepted_prefix([1, 2], [1, 2])
