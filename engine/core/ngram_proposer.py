"""Prompt-lookup (n-gram) proposals: a row's candidate tokens come from its own prompt and output.

Semantics, for one row with tokens t[0..L) (prompt then output) and at most k proposals:
    for n from min(max_n, L - 1) down to min_n:
        starts = [i for i in range(L - n) if t[i:i+n] == t[L-n:L]]   # earlier occurrences of the last n tokens
        if starts: return t[s+n : s+n+k] with s = max(starts)         # what followed the most recent one
    return []
The longest matching n wins (a longer context predicts better); among its occurrences the most recent, whose
continuation is what the text was doing last (an edit copying a passage is further along there). The proposal may be
shorter than k where the sequence ends sooner. Nothing here is a model call: it is cheap enough to run on every
decoding row of every step, and the policy decides how many of its tokens are verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from loraplex.engine.core.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # request.py imports this module (a request keeps its NgramIndex)
    from loraplex.engine.core.request import Request


def propose_ngram(token_ids: Sequence[int] | np.ndarray, *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` proposed tokens for the row (see the module's semantics); [] when no n-gram recurs."""
    if k < 1 or min_n < 1 or max_n < min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows of t[:L-1] start at 0..L-1-n, so each has a following token and the suffix itself is left out.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(token) for token in tokens[start : start + k]]
    return []


class NgramIndex:
    """`propose_ngram` for one growing sequence in O(1) per call: for each n, the most recent start of every n-gram
    that has a following token, extended as the sequence grows (sequences only grow: outputs are appended, and a
    preempted request keeps its output). What it proposes is exactly `propose_ngram`'s."""

    def __init__(self, *, min_n: int, max_n: int) -> None:
        self._min_n = min_n
        self._max_n = max_n
        self._starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._length = 0  # tokens indexed: every n-gram starting before length - n is in the maps

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        length = len(token_ids)
        for end in range(max(self._length, 1), length):  # n-grams whose follower is token `end`
            for n, starts in self._starts.items():
                start = end - n
                if start >= 0:
                    starts[tuple(token_ids[start:end])] = start
        self._length = max(self._length, length)
        if k < 1:
            return []
        for n in range(min(self._max_n, length - 1), self._min_n - 1, -1):
            found = self._starts[n].get(tuple(token_ids[length - n :]))
            if found is not None:
                return list(token_ids[found + n : found + n + k])
        return []


class NgramProposer:
    """The n-gram method of a SpeculativeConfig. A row's index lives on its request (`Request.ngram_index`, made on
    first use), so it goes with the request and there is nothing to release."""

    pays_per_token = False  # a lookup: the speculator may ask for as many tokens as a row could verify

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs an ngram speculative config, not {config.method!r}")
        self._min_n = config.prompt_lookup_min
        self._max_n = config.prompt_lookup_max
        self._max_k = config.num_speculative_tokens

    def index(self) -> NgramIndex:
        """A new request's index (the speculator keeps one per request)."""
        return NgramIndex(min_n=self._min_n, max_n=self._max_n)

    def propose_one(self, index: NgramIndex, token_ids: Sequence[int], k: int) -> list[int]:
        """At most min(k, num_speculative_tokens) tokens for a row whose tokens so far are `token_ids`."""
        return index.propose(token_ids, min(k, self._max_k))

    def propose(self, rows: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """The speculator's interface: `propose_one` for each row, at most limits[i] tokens for row i."""
        proposals: list[list[int]] = []
        for request, limit in zip(rows, limits, strict=True):
            if request.ngram_index is None:
                request.ngram_index = self.index()
            tokens = request.prompt_token_ids + request.output_token_ids
            proposals.append(self.propose_one(request.ngram_index, tokens, limit))
        return proposals

    def release(self, request: Request) -> None:
        """Nothing to drop: the request's index goes with it."""
