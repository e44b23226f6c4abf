"""The Speculator: which decoding rows speculate in a step, with which proposed tokens, and the books of how it went.

Each step, after the scheduler has scheduled its own tokens, the speculator asks the proposer for every eligible
decoding row's candidates, lets the load-adaptive policy (speculation_policy.py) pick how many of them each row
verifies in the step's free room, and returns them; the scheduler grows those rows' KV by that many tokens (never
preempting for it). After the forward, the engine verifies (rejection_sampler.py), emits what was kept plus one
token, and books each row's outcome here (its acceptance estimate and the counters /metrics reads).

Eligible rows, for now: greedy, with no penalties, logits processors, grammar, logprobs or pending min_tokens
(logit_bias is fine: it is the same at every position). For them the target at each proposed position is the
argmax of the raw logits plus their bias, so verification is exact token for token. The other rows decode one token
per step as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.engine.core.ngram_proposer import NgramProposer
from loraplex.engine.core.request import Request
from loraplex.engine.core.sampling_params import GREEDY_TEMPERATURE
from loraplex.engine.core.speculation_policy import StepCostModel, free_tokens, plan_speculative_lengths
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


class Speculator:
    def __init__(self, config: SpeculativeConfig, *, knee_tokens: int) -> None:
        if config.method != "ngram":
            raise ValueError("only the ngram speculative method is served so far; draft_model is not yet")
        if knee_tokens < 1:
            raise ValueError("the speculation knee must be at least one token")
        self.config = config
        self.knee_tokens = knee_tokens
        self.proposer = NgramProposer(config)
        self.stats = SpeculationStats()
        self.cost = StepCostModel()  # the engine's measured step times: what a speculative token costs here

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether the row's verification is exact with the argmax of its biased logits (the module's docstring)."""
        params = request.sampling_params
        return (
            params.temperature < GREEDY_TEMPERATURE
            and not params.logits_processors
            and params.presence_penalty == 0
            and params.frequency_penalty == 0
            and params.repetition_penalty == 1
            and params.logprobs is None
            and request.grammar is None
            and len(request.output_token_ids) >= params.min_tokens
        )

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Book a decode step's size (rows plus their proposals) and how long it took (schedule to outputs)."""
        self.cost.observe(num_tokens, seconds)

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
        rates = [request.acceptance.rate for request in rows]
        min_gain = self.cost.min_gain(num_tokens=scheduled_tokens, num_rows=max(1, num_sampling_rows))
        ranked = sorted((i for i, rate in enumerate(rates) if rate >= min_gain), key=lambda i: -rates[i])
        candidates = ranked[:room]
        proposals: list[list[int]] = []
        for i in candidates:
            request = rows[i]
            # The row emits its kept proposals and one token more: never past its max_tokens.
            limit = request.max_tokens - len(request.output_token_ids) - 1
            if request.ngram_index is None:
                request.ngram_index = self.proposer.index()
            tokens = request.prompt_token_ids + request.output_token_ids
            proposals.append(self.proposer.propose(request.ngram_index, tokens, limit))
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
