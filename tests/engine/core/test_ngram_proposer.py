"""Prompt lookup proposes what followed the most recent earlier occurrence of the longest recurring suffix."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.core.ngram_proposer import NgramIndex, NgramProposer, propose_ngram
from loraplex.engine.core.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.unit


def reference(tokens: list[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """The module docstring's loop, as written."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = [i for i in range(length - n) if tokens[i : i + n] == tokens[length - n :]]
        if starts:
            s = max(starts)
            return tokens[s + n : s + n + k]
    return []


def test_a_copied_passage_is_proposed_from_the_prompt() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    output = [1, 5, 6, 7]  # the model started copying the passage
    assert propose_ngram(prompt + output, min_n=2, max_n=4, k=3) == [8, 9, 10]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]
    # "1 2 3" occurred at 0 (followed by 4); "2 3" more recently at 5 (followed by 7): the longer one decides.
    assert propose_ngram(tokens, min_n=2, max_n=3, k=2) == [4, 9]
    assert propose_ngram(tokens, min_n=2, max_n=2, k=2) == [7, 1]


def test_nothing_recurs_nothing_is_proposed_and_the_end_shortens_a_proposal() -> None:
    assert propose_ngram([1, 2, 3, 4], min_n=1, max_n=3, k=4) == []
    assert propose_ngram([], min_n=1, max_n=3, k=4) == []
    assert propose_ngram([7], min_n=1, max_n=3, k=4) == []
    assert propose_ngram([3, 4, 3], min_n=1, max_n=2, k=4) == [4, 3]  # only two tokens follow the match
    assert propose_ngram([3, 4, 3], min_n=1, max_n=2, k=0) == []


def test_matches_the_reference_loop_on_random_sequences() -> None:
    rng = random.Random(7)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        assert propose_ngram(tokens, min_n=min_n, max_n=max_n, k=k) == reference(
            tokens, min_n=min_n, max_n=max_n, k=k
        ), (tokens, min_n, max_n, k)


def test_the_index_proposes_what_the_scan_does_as_a_sequence_grows() -> None:
    rng = random.Random(11)
    for _ in range(100):
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        index = NgramIndex(min_n=min_n, max_n=max_n)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        for _ in range(30):
            k = rng.randrange(0, 6)
            assert index.propose(tokens, k) == propose_ngram(tokens, min_n=min_n, max_n=max_n, k=k), tokens
            tokens = tokens + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_the_proposer_caps_at_the_configured_length() -> None:
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1))
    assert proposer.propose_one(proposer.index(), [1, 2, 3, 4, 1], k=8) == [2, 3]
    with pytest.raises(ValueError, match="ngram"):
        NgramProposer(SpeculativeConfig(method="draft_model", model=__import__("pathlib").Path("d")))
