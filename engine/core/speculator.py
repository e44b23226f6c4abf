"""The Speculator: which decoding rows speculate in a step, with which proposed tokens, and the books of how it went.

Each step, after the scheduler has scheduled its own tokens, the speculator asks the proposer for every eligible
decoding row's candidates, lets the load-adaptive policy (speculation_policy.py) pick how many of them each row
verifies in the step's free room, and returns them; the scheduler grows those rows' KV by that many tokens (never
preempting for it). After the forward, the engine verifies (rejection_sampler.py), emits what was kept plus one
token, and books each row's outcome here (its acceptance estimate and the counters /metrics reads).

Every row speculates but one with logits processors (a processor is the caller's code, which may keep state and
must see each position once, in order) and one with an output grammar still inside its think block. A verifying
row's positions are sampled as the sampler samples any row (row_sampler.py), each as if the proposals before
it were kept (penalties, grammar mask, min_tokens, a think block's forced tokens), so greedy rows are token for
token what they would be without speculation, random rows keep the target's distribution (rejection_sampler.py),
and logprobs are the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.core.ngram_proposer import NgramProposer
from loraplex.engine.core.request import Request
from loraplex.engine.core.speculation_policy import (
    DEFAULT_MIN_GAIN,
    SpeculationGate,
    StepCostModel,
    free_tokens,
    plan_speculative_lengths,
)
from loraplex.engine.core.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class SpeculationCounts:
    """Totals since start, for one adapter (or the base model)."""

    num_steps: int = 0  # row-steps that verified at least one proposal
    num_proposed: int = 0  # proposed tokens verified
    num_accepted: int = 0  # of them, kept
    num_emitted: int = 0  # tokens those row-steps emitted (kept + one each)


@dataclass(slots=True)
class SpeculationStats:
    """The speculator's books, per adapter name ("" for the base model)."""

    by_adapter: dict[str, SpeculationCounts] = field(default_factory=dict)

    def add(self, adapter: str, *, proposed: int, accepted: int, emitted: int) -> None:
        counts = self.by_adapter.setdefault(adapter, SpeculationCounts())
        counts.num_steps += 1
        counts.num_proposed += proposed
        counts.num_accepted += accepted
        counts.num_emitted += emitted


class Proposer(Protocol):
    """Where proposed tokens come from: the n-gram lookup (ngram_proposer.py) or a draft model (draft_model.py)."""

    # True when proposing costs per token (a model call per position): the speculator then asks each row for no more
    # tokens than the policy would let it verify; False (a lookup) asks for as many as the row may verify at all.
    pays_per_token: bool

    def propose(self, rows: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """Proposed tokens for each row, at most limits[i] (and the method's num_speculative_tokens) for row i;
        [] for none. A row's tokens are its prompt and output as they are now."""
        ...

    def release(self, request: Request) -> None:
        """A request left the engine: drop whatever the proposer keeps of it."""
        ...


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        knee_tokens: int,
        proposer: Proposer | None = None,
        use_clock: bool = True,
    ) -> None:
        """`proposer` defaults to the n-gram lookup of an ngram config; a draft_model config needs its
        DraftModelProposer (EngineCore builds it: it needs the model loaded and the page pool). Without `use_clock`
        the plan ignores measured step times (EngineConfig.speculative_use_clock)."""
        if knee_tokens < 1:
            raise ValueError("the speculation knee must be at least one token")
        if proposer is None:
            if config.method != "ngram":
                raise ValueError("a draft_model speculator needs its DraftModelProposer")
            proposer = NgramProposer(config)
        self.config = config
        self.knee_tokens = knee_tokens
        self.proposer: Proposer = proposer
        self.stats = SpeculationStats()
        self.cost = StepCostModel()  # the engine's measured step times: what a speculative token costs here
        self.gate = SpeculationGate()  # whether speculating steps emit faster than the others, per batch size
        self.use_clock = use_clock
        self.asked = False  # the last plan asked the proposer (the step pays for it even if nothing is verified)

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether the row may verify proposals (the module's docstring: all but rows with logits processors, and
        rows with an output grammar whose think block is not over: where the grammar starts depends on what is
        kept)."""
        if request.sampling_params.logits_processors or request.pooling is not None:
            return False
        return request.grammar is None or request.reasoning is None or not request.reasoning.is_open

    def observe_step(
        self, num_tokens: int, seconds: float, *, num_rows: int, num_emitted: int, speculated: bool
    ) -> None:
        """Book a decode step: its size (rows plus their proposals), how long it took (schedule to outputs), its
        rows, the tokens they emitted, and whether it speculated: asked the proposer, even if no proposal came back
        to verify. A draft's catch-up of rows it has not followed while the gate kept speculation off is paid in a
        step that may verify nothing; booked as a step without speculation, it would make those look slower."""
        if not speculated or num_tokens > num_rows:  # a step that asked and verified nothing: not a target's step
            self.cost.observe(num_tokens, seconds)
        self.gate.observe(num_rows, speculated=speculated, num_emitted=num_emitted, seconds=seconds)

    def plan(
        self, rows: Sequence[Request], *, scheduled_tokens: int, token_budget: int, num_sampling_rows: int
    ) -> list[list[int]]:
        """The proposed tokens each decoding row verifies this step ([] for none). `rows` are eligible rows that
        decode one token this step; `scheduled_tokens` is the step's size before speculation, in which
        `num_sampling_rows` rows emit a token. A proposal must be likely enough to be kept to pay for its token at
        this step size, as the measured step cost says (StepCostModel.min_gain).

        Proposals are only looked up where they could be used: none at all without room, and otherwise for the
        rows most likely to keep a first proposal, as many as the room holds (the policy gives a row a j-th
        proposal only after its first), so a busy step pays nothing for speculation."""
        chosen: list[list[int]] = [[] for _ in rows]
        room = free_tokens(scheduled_tokens=scheduled_tokens, token_budget=token_budget, knee_tokens=self.knee_tokens)
        measured = self.use_clock and room > 0
        if measured and not self.gate.allows(max(1, num_sampling_rows)):  # measured not to pay at this batch size
            room = 0
        rates = [request.acceptance.rate for request in rows]
        min_gain = (
            self.cost.min_gain(num_tokens=scheduled_tokens, num_rows=max(1, num_sampling_rows))
            if self.use_clock
            else DEFAULT_MIN_GAIN
        )
        ranked = sorted((i for i, rate in enumerate(rates) if rate >= min_gain), key=lambda i: -rates[i])
        candidates = ranked[:room]
        # The row emits its kept proposals and one token more: never past its max_tokens.
        limits = [rows[i].max_tokens - len(rows[i].output_token_ids) - 1 for i in candidates]
        if self.proposer.pays_per_token:  # what the policy would verify of full-length proposals, no more
            full = [min(limit, self.config.num_speculative_tokens) for limit in limits]
            limits = plan_speculative_lengths([rates[i] for i in candidates], full, free_tokens=room, min_gain=min_gain)
        self.asked = bool(candidates)
        proposals = self.proposer.propose([rows[i] for i in candidates], limits) if candidates else []
        lengths = plan_speculative_lengths(
            [rates[i] for i in candidates], [len(p) for p in proposals], free_tokens=room, min_gain=min_gain
        )
        for i, proposal, k in zip(candidates, proposals, lengths, strict=True):
            chosen[i] = proposal[:k]
        for request, proposal in zip(rows, chosen, strict=True):
            if not proposal:
                request.acceptance.rest()
        return chosen

    def verified(self, request: Request, *, proposed: int, accepted: int, emitted: int) -> None:
        """Book a row's verified step: `accepted` of `proposed` kept, `emitted` tokens out (fewer than accepted + 1
        when a stop ended the row inside them)."""
        request.acceptance.observe(proposed, accepted)
        adapter = request.adapter.ref.name if request.adapter is not None else ""
        self.stats.add(adapter, proposed=proposed, accepted=accepted, emitted=emitted)
