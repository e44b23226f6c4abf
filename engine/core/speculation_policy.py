"""How many speculative tokens each row verifies in a step: from its measured acceptance and the step's room.

The economics. Verifying k proposed tokens of a row makes the step process k more tokens for that row; with a
per-token acceptance rate a (the chance a proposal is accepted given the ones before it were), the j-th proposed
token is kept with probability a**j. Below the batch size at which a step turns compute-bound (the knee: a decode
step reads all the weights whatever its size, so a few more tokens cost almost nothing), extra tokens are nearly
free and any proposal likely to be kept pays. Past the knee every token costs its share of the step, and a token
kept with probability a**j < 1 costs more than it brings: speculation there only slows the batch. So the policy
spends the step's free room (tokens left before the knee and within the token budget) on the proposals most likely
to be kept, and nothing once the room is gone; when the batch shrinks, the room and the speculation come back.

Semantics (`plan_speculative_lengths`), with gains g[i][j] = rate[i] ** j for j = 1..max_k[i]:
    chosen = the `free_tokens` largest gains that are >= min_gain (ties: lower row, then lower j first)
    k[i] = number of chosen gains of row i
Gains fall with j in each row, so the chosen ones are a prefix of each row: k[i] proposals, the first k[i].

`AcceptanceEstimate` is each row's online estimate of its rate: counts of kept and refused proposals under a
geometric model (a step that proposed k and kept m < k saw m successes and one failure; m = k, k successes),
forgotten at a constant rate so the estimate follows the text, and pulled back to a prior while the row does not
speculate, so a row switched off is tried again later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_MIN_GAIN = 0.3  # a proposal kept less often than this is not worth its verification even in free room
PRIOR_RATE = 0.5  # what a row is assumed to accept before it has speculated
PRIOR_WEIGHT = 2.0  # how many proposals' worth of evidence the prior counts for
FORGET = 0.9  # each step's evidence counts this much less in the next step's estimate


@dataclass(slots=True)
class AcceptanceEstimate:
    """A row's per-token acceptance rate, learned from its own verified steps. One per request."""

    kept: float = 0.0  # forgotten counts of accepted proposals
    refused: float = 0.0  # forgotten counts of rejections (at most one per step)

    @property
    def rate(self) -> float:
        """The estimated chance that a proposal is kept, in [0, 1]."""
        prior_kept = PRIOR_RATE * PRIOR_WEIGHT
        return (self.kept + prior_kept) / (self.kept + self.refused + PRIOR_WEIGHT)

    def observe(self, proposed: int, accepted: int) -> None:
        """Book a verified step: `proposed` tokens were checked and the first `accepted` of them kept."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted ({accepted}) must be between 0 and proposed ({proposed})")
        self.kept = self.kept * FORGET + accepted
        self.refused = self.refused * FORGET + (1 if accepted < proposed else 0)

    def rest(self) -> None:
        """A step in which the row did not speculate: its evidence fades toward the prior."""
        self.kept *= FORGET
        self.refused *= FORGET


@dataclass(slots=True)
class StepCostModel:
    """The engine's step time as a + b * tokens, fitted online to the steps it ran (least squares with forgetting,
    so it follows the machine's load). `b` is what one more token costs a step, `a` what a step costs anyway."""

    forget: float = 0.98
    _w: float = 0.0
    _t: float = 0.0  # weighted sums of tokens, seconds, tokens^2, tokens * seconds
    _s: float = 0.0
    _tt: float = 0.0
    _ts: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._w = self._w * self.forget + 1.0
        self._t = self._t * self.forget + num_tokens
        self._s = self._s * self.forget + seconds
        self._tt = self._tt * self.forget + num_tokens * num_tokens
        self._ts = self._ts * self.forget + num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) seconds, or None until steps of different sizes were seen."""
        if self._w < 2:
            return None
        mean_t, mean_s = self._t / self._w, self._s / self._w
        var_t = self._tt / self._w - mean_t * mean_t
        if var_t < 1.0:  # every step about the same size: the slope is not known
            return None
        b = max(0.0, (self._ts / self._w - mean_t * mean_s) / var_t)
        return max(0.0, mean_s - b * mean_t), b

    def min_gain(self, *, num_tokens: int, num_rows: int) -> float:
        """The least chance of being kept a proposal needs to pay in a step of `num_tokens` tokens that emits a
        token for each of `num_rows` rows: its extra token's cost in emitted tokens, b * rows / step time. Near 0
        while a step costs the same whatever its size; near 1 (never) once each token costs its share."""
        fitted = self.fit()
        if fitted is None:
            return DEFAULT_MIN_GAIN
        a, b = fitted
        step = a + b * num_tokens
        return 1.0 if step <= 0 else min(1.0, max(DEFAULT_MIN_GAIN, b * num_rows / step))


def free_tokens(*, scheduled_tokens: int, token_budget: int, knee_tokens: int) -> int:
    """The step's room for speculative tokens: what is left of the token budget and of the tokens below the knee
    (the step size past which each token costs its share) once the step's own tokens are scheduled."""
    return max(0, min(token_budget, knee_tokens) - scheduled_tokens)


def plan_speculative_lengths(
    rates: Sequence[float] | np.ndarray,
    max_k: Sequence[int] | np.ndarray,
    *,
    free_tokens: int,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> list[int]:
    """Each row's number of speculative tokens this step (see the module's semantics). `max_k[i]` caps row i: the
    configured maximum, its proposal's length, and the tokens it may still produce."""
    if not 0 < min_gain <= 1:
        raise ValueError("min_gain must be in (0, 1]")
    rate = np.clip(np.asarray(rates, dtype=np.float64), 0.0, 1.0)
    cap = np.asarray(max_k, dtype=np.int64)
    if rate.shape != cap.shape or rate.ndim != 1:
        raise ValueError("rates and max_k need one entry per row")
    num_rows = rate.shape[0]
    if num_rows == 0 or free_tokens <= 0:
        return [0] * num_rows
    width = int(cap.max(initial=0))
    if width <= 0:
        return [0] * num_rows
    depth = np.arange(1, width + 1)
    gains = rate[:, None] ** depth[None, :]  # [rows, width]
    gains[depth[None, :] > cap[:, None]] = -1.0  # beyond a row's cap: never chosen
    flat = gains.ravel()
    # Stable order by falling gain: ties go to the lower row and depth (flat index order), so the result is a
    # prefix of each row even where a row's gains tie (rate 1: every depth gains 1).
    order = np.argsort(-flat, kind="stable")
    chosen = order[: min(free_tokens, order.shape[0])]
    chosen = chosen[flat[chosen] >= min_gain]
    counts = np.bincount(chosen // width, minlength=num_rows)
    return [int(c) for c in counts]


def batch_bucket(num_rows: int) -> int:
    """The gate's bucket of a step with `num_rows` decoding rows: exact up to 4 rows, then half octaves (5, 6-8,
    9-11, 12-16, 17-22, ...), so the steps compared in a bucket have about the same size."""
    if num_rows <= 4:
        return num_rows
    return 4 + int(np.ceil(2 * np.log2(num_rows / 4) - 1e-9))


@dataclass(slots=True)
class _GateBucket:
    rate_on: float = 0.0  # forgotten mean emitted tokens per second of decode steps that verified proposals
    rate_off: float = 0.0  # the same for decode steps that did not
    num_on: int = 0
    num_off: int = 0
    interval: int = 0  # steps between checks of the side not chosen (0: not set yet)
    until_check: int = 0  # decisions left before the next check
    checking: bool = False  # the last decision was a check; its step's outcome is the next observation
    favoured: bool = True  # the side chosen before the check (True: speculate)


@dataclass(slots=True)
class SpeculationGate:
    """Whether to speculate at all in a step, from what speculation measured at this batch size.

    The per-row policy (`plan_speculative_lengths` with the cost model's min_gain) predicts what a proposal brings;
    the gate checks the prediction against the clock. Per bucket of decoding rows (`batch_bucket`) it keeps the
    emitted tokens per second of decode steps that verified proposals and of those that did not (means that forget,
    so they follow the load), and speculates where the first is higher. Each side is measured `warmup` times before
    they are compared; then the side not chosen is checked again after `explore_every` steps, and after twice as
    many each time a check leaves the choice as it was (up to `max_interval`), back to `explore_every` when a check
    changes it. So a bucket that turned against speculation (or for it) is noticed, and a settled one pays for
    checks less and less often: the losing side's cost falls below one step in `max_interval`.
    """

    explore_every: int = 16
    max_interval: int = 256
    warmup: int = 3
    forget: float = 0.7
    buckets: dict[int, _GateBucket] = field(default_factory=dict)

    def _bucket(self, num_rows: int) -> _GateBucket:
        return self.buckets.setdefault(batch_bucket(num_rows), _GateBucket())

    def allows(self, num_rows: int) -> bool:
        """Whether a decode step of `num_rows` rows may speculate (counts as the bucket's decision for the step)."""
        bucket = self._bucket(num_rows)
        if bucket.num_on < self.warmup:
            return True
        if bucket.num_off < self.warmup:
            return False
        favoured = bucket.rate_on >= bucket.rate_off
        if bucket.interval == 0:
            bucket.interval = bucket.until_check = self.explore_every
        bucket.until_check -= 1
        if bucket.until_check > 0:
            return favoured
        bucket.checking, bucket.favoured = True, favoured
        return not favoured

    def observe(self, num_rows: int, *, speculated: bool, num_emitted: int, seconds: float) -> None:
        """Book a decode step of `num_rows` rows that emitted `num_emitted` tokens in `seconds`, and whether it verified
        any proposal."""
        if seconds <= 0:
            return
        bucket = self._bucket(num_rows)
        rate = num_emitted / seconds
        if speculated:
            bucket.rate_on = rate if bucket.num_on == 0 else self.forget * bucket.rate_on + (1 - self.forget) * rate
            bucket.num_on += 1
        else:
            bucket.rate_off = rate if bucket.num_off == 0 else self.forget * bucket.rate_off + (1 - self.forget) * rate
            bucket.num_off += 1
        if bucket.checking:
            bucket.checking = False
            same = (bucket.rate_on >= bucket.rate_off) == bucket.favoured
            bucket.interval = min(2 * bucket.interval, self.max_interval) if same else self.explore_every
            bucket.until_check = bucket.interval

    def ratio(self, num_rows: int) -> float | None:
        """Measured speculating / not tokens per second at this batch size (None until both were measured)."""
        bucket = self.buckets.get(batch_bucket(num_rows))
        if bucket is None or bucket.num_on == 0 or bucket.num_off == 0 or bucket.rate_off <= 0:
            return None
        return bucket.rate_on / bucket.rate_off
