"""The Speculator: which decoding rows speculate in a step, with which proposed tokens, and the books of how it went.

Each step, after the scheduler has scheduled its own tokens, the speculator asks the proposer for every eligible
decoding row's candidates, lets the load-adaptive policy (speculation_policy.py) pick how many of them each row
verifies in the step's free room, and returns them; the scheduler grows those rows' KV by that many tokens (never
preempting for it). After the forward, the engine verifies (rejection_sampler.py), emits what was kept plus one
token, and books each row's outcome here (its acceptance estimate and the counters /metrics reads).

Eligible rows, for now: greedy, with no logit_bias, penalties, logits processors, grammar, logprobs or pending
min_tokens. For them the target's distribution at each proposed position is its raw argmax, so verification is
exact token for token. The other rows decode one token per step as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.engine.core.ngram_proposer import NgramProposer
from loraplex.engine.core.request import Request
from loraplex.engine.core.sampling_params import GREEDY_TEMPERATURE
from loraplex.engine.core.speculation_policy import free_tokens, plan_speculative_lengths
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

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether the row's verification is exact with its raw argmax (see the module's docstring)."""
        params = request.sampling_params
        return (
            params.temperature < GREEDY_TEMPERATURE
            and not params.logit_bias
            and not params.logits_processors
            and params.presence_penalty == 0
            and params.frequency_penalty == 0
            and params.repetition_penalty == 1
            and params.logprobs is None
            and request.grammar is None
            and len(request.output_token_ids) >= params.min_tokens
        )

    def plan(self, rows: Sequence[Request], *, scheduled_tokens: int, token_budget: int) -> list[list[int]]:
        """The proposed tokens each decoding row verifies this step ([] for none). `rows` are eligible rows that
        decode one token this step; `scheduled_tokens` is the step's size before speculation."""
        proposals: list[list[int]] = []
        for request in rows:
            # The row emits its kept proposals and one token more: never past its max_tokens.
            room = request.max_tokens - len(request.output_token_ids) - 1
            tokens = request.prompt_token_ids + request.output_token_ids
            proposals.append(self.proposer.propose(tokens, room) if room > 0 else [])
        room = free_tokens(scheduled_tokens=scheduled_tokens, token_budget=token_budget, knee_tokens=self.knee_tokens)
        lengths = plan_speculative_lengths(
            [request.acceptance.rate for request in rows], [len(p) for p in proposals], free_tokens=room
        )
        chosen = []
        for request, proposal, k in zip(rows, proposals, lengths, strict=True):
            if k == 0:
                request.acceptance.rest()
            chosen.append(proposal[:k])
        return chosen

    def verified(self, request: Request, *, proposed: int, accepted: int, emitted: int) -> None:
        """Book a row's verified step: `accepted` of `proposed` kept, `emitted` tokens out (fewer than accepted + 1
        when a stop ended the row inside them)."""
        request.acceptance.observe(proposed, accepted)
        adapter = request.adapter.ref.name if request.adapter is not None else ""
        self.stats.add(adapter, proposed=proposed, accepted=accepted, emitted=emitted)
