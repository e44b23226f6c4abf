"""A request's think block, followed token by token: where it is, how many tokens it has spent, and what the sampler
must force or forbid next so that it stays within its thinking-token budget.

The markers are token sequences (`<think>` and `</think>` encoded by the model's tokenizer): one token each for the
models the parsers are named after, several for a tokenizer without them as added tokens (the demo model's). A row
moves through four phases:

- OPENING: the output may open a think block with its first tokens (qwen3, when the prompt did not open one). The
  start marker's tokens are followed; the first token that leaves it makes the row DONE with no reasoning at all.
  With a budget of 0 the marker's first token is forbidden, so the row answers directly.
- THINKING: every token is a reasoning token. The row is watched for the end marker (DONE when it is complete); its
  stop and EOS tokens are forbidden while it has a budget, so it answers after thinking instead of ending inside
  the block. When it has spent its budget it moves to CLOSING.
- CLOSING: the closing text and the end marker are forced, one token a step (`forced`); with a budget of 0 only the
  end marker is, so `none` closes the block before the first token.
- DONE: the think block is over (or never was): what follows is the answer, which an output grammar constrains.

So a row's reasoning tokens are at most its budget plus the forced tokens. The state is a few integers; `after`
advances a copy, which is how a speculating row's later positions know what they must force.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from loraplex.engine.core.reasoning_config import THINK_END, THINK_START, ReasoningConfig

# How many of a prompt's last tokens `ReasoningMarkers.initial_phase` reads.
PROMPT_TAIL = 64


class Phase(enum.IntEnum):
    OPENING = 0
    THINKING = 1
    CLOSING = 2
    DONE = 3


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    """An engine's think markers and closing text, as its tokenizer encodes them."""

    parser: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    closing_ids: tuple[int, ...]  # the closing text, forced before the end marker when a budget runs out

    @classmethod
    def of(cls, config: ReasoningConfig, encode: Callable[[str], list[int]]) -> ReasoningMarkers:
        """The markers as `encode` (the tokenizer, without special tokens) writes them."""
        start, end = encode(THINK_START), encode(THINK_END)
        if not start or not end:
            raise ValueError("the tokenizer encodes the think markers to nothing")
        return cls(config.parser, tuple(start), tuple(end), tuple(encode(config.closing_text)))

    def initial_phase(self, prompt_token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> Phase:
        """Where a request with this prompt starts: THINKING when the prompt left a think block open (a template
        that opens it), DONE when the prompt ends with a closed one (Qwen3's `enable_thinking: false`), else the
        parser's reading of an output that starts without one: qwen3 may open it (OPENING), deepseek_r1's output is
        reasoning from its first token. Only the prompt's last PROMPT_TAIL tokens are read: a template opens or
        closes the block right after the generation prompt, and a marker further back is an earlier turn's (this
        runs on the engine thread, once per request, however long the prompt)."""
        tail = prompt_token_ids[-PROMPT_TAIL:]
        last_start = _last_index(tail, self.start_ids)
        last_end = _last_index(tail, self.end_ids)
        if last_start > last_end:
            return Phase.THINKING
        if last_end >= 0:
            after = tail[last_end + len(self.end_ids) :]
            if not after or not decode(after).strip():
                return Phase.DONE
        return Phase.OPENING if self.parser == "qwen3" else Phase.THINKING


def _last_index(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Where the last occurrence of `marker` starts in `tokens`, or -1."""
    n = len(marker)
    first = marker[0]
    for index in range(len(tokens) - n, -1, -1):
        if tokens[index] == first and list(tokens[index : index + n]) == list(marker):
            return index
    return -1


@dataclass(frozen=True, slots=True)
class ReasoningState:
    """One request's place in its think block (see the module doc); immutable, so a position ahead is a copy."""

    markers: ReasoningMarkers
    budget: int | None  # most tokens the row may choose inside the block; None: no limit
    phase: Phase
    matched: int = 0  # OPENING: start-marker tokens seen; THINKING: end-marker tokens at the tail; CLOSING: forced
    num_tokens: int = 0  # reasoning tokens so far: the block's output tokens, markers and forced ones included

    @classmethod
    def start(cls, markers: ReasoningMarkers, budget: int | None, phase: Phase) -> ReasoningState:
        return cls(markers, budget, phase)._checked()

    @property
    def is_open(self) -> bool:
        """The block may still be open: the answer (and its grammar) has not begun."""
        return self.phase is not Phase.DONE

    @property
    def forced_ids(self) -> tuple[int, ...]:
        """What CLOSING forces: the closing text, then the end marker (the end marker alone for a budget of 0)."""
        m = self.markers
        return m.end_ids if not self.budget else m.closing_ids + m.end_ids

    def forced(self, *, complete_marker: bool = False) -> int | None:
        """The token the row must take next, or None. With `complete_marker` (a row with an output grammar, which
        must not leave a half-written marker as the start of its answer), an opening marker once begun is finished."""
        if self.phase is Phase.CLOSING:
            return self.forced_ids[self.matched]
        if complete_marker and self.phase is Phase.OPENING and self.matched:
            return self.markers.start_ids[self.matched]
        return None

    def forbids_marker(self) -> int | None:
        """A token the row may not take next: the start marker's first token when it may not think at all."""
        if self.phase is Phase.OPENING and self.matched == 0 and self.budget == 0:
            return self.markers.start_ids[0]
        return None

    @property
    def forbids_stop(self) -> bool:
        """Stop and EOS tokens are forbidden: the row thinks under a budget and must answer after it."""
        return self.phase is Phase.THINKING and self.budget is not None

    def after(self, token_id: int) -> ReasoningState:
        """The state once `token_id` is the row's next output token."""
        phase, matched, num_tokens = self.phase, self.matched, self.num_tokens
        m = self.markers
        if phase is Phase.OPENING:
            if token_id == m.start_ids[matched]:
                matched += 1
                num_tokens += 1
                if matched == len(m.start_ids):
                    phase, matched = Phase.THINKING, 0
            else:  # the output did not open a block: everything is the answer
                phase, matched, num_tokens = Phase.DONE, 0, 0
        elif phase is Phase.THINKING:
            num_tokens += 1
            if token_id == m.end_ids[matched]:
                matched += 1
            else:
                matched = 1 if token_id == m.end_ids[0] else 0
            if matched == len(m.end_ids):
                phase, matched = Phase.DONE, 0
        elif phase is Phase.CLOSING:
            num_tokens += 1
            matched += 1
            if matched == len(self.forced_ids):
                phase, matched = Phase.DONE, 0
        return replace(self, phase=phase, matched=matched, num_tokens=num_tokens)._checked()

    def _checked(self) -> ReasoningState:
        """A thinking row that has spent its budget starts closing."""
        if self.phase is Phase.THINKING and self.budget is not None and self.num_tokens >= self.budget:
            return replace(self, phase=Phase.CLOSING, matched=0)
        return self
