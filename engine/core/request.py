"""A request's state inside the engine: its tokens, how many have KV in the cache, and its blocks.

Its fields are written by the scheduler (status, computed tokens, preemptions, cached tokens, first scheduling) and
the output processor (output tokens, stop reason, the grammar's state) only; its KV blocks are the memory package's
`SequenceBlocks`, which the KV cache manager alone writes. It is a `KVSequence`: what the memory package reads of a
sequence."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from loraplex.engine.core.ngram_proposer import NgramIndex
from loraplex.engine.core.pooling import PoolingState
from loraplex.engine.core.reasoning import ReasoningState
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.speculation_policy import AcceptanceEstimate
from loraplex.engine.core.structured_output import GrammarState
from loraplex.engine.lora.manager import AdapterEntry
from loraplex.engine.memory.sequence import SequenceBlocks


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. its adapter failed to load

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: min(params.max_tokens, room left in the context)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)  # its KV blocks (the KV cache manager's)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (at the first admission)
    # time.monotonic() at its first admission, like `arrival_time`; None until then. A restart after preemption keeps
    # it: the queue time it gives (`queue_time_s`) is vLLM's, from arrival to the first scheduling.
    first_scheduled_time: float | None = None
    cache_salt: str | None = None  # set by a trusted caller (the platform: per tenant); part of block 0's hash
    adapter: AdapterEntry | None = None  # None: the base model
    error: str | None = None  # why it finished with FINISHED_ERROR
    grammar: GrammarState | None = None  # its output grammar's matcher (advanced by the output processor)
    # Its think block (reasoning.py), advanced by the output processor; None when it does not reason. The output
    # grammar applies once the block is over.
    reasoning: ReasoningState | None = None
    # Another choice of the same prompt: this one starts once that one's prompt is prefilled, so that it takes the
    # prompt's blocks from the prefix cache instead of computing them again (n > 1).
    prefill_after: Request | None = None
    # Fair share (the scheduler's VTC): whose request it is, and that key's weight; and how urgent it is (vLLM's
    # priority: lower first).
    fairness_key: str = ""
    fairness_weight: float = 1.0
    priority: int = 0
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # its speculation's measured rate
    ngram_index: NgramIndex | None = None  # its tokens' n-grams, for prompt-lookup proposals (made on first use)
    # LongRoPE checkpoints: every token of it rotates with the long factors (its prompt is past the original context;
    # decision 0045). Its blocks are kept apart from short-factor ones in the prefix cache (by its cache salt).
    long_rope: bool = False
    # An embedding request (core/pooling.py): its prompt's hidden states are pooled as they are computed, and it
    # finishes when the prompt is done, with no token generated. None: a generation request.
    pooling: PoolingState | None = None

    @property
    def takes_prefix_hits(self) -> bool:
        """Whether cached blocks may stand in for its prompt: not for an embedding request that pools every token
        (mean) or the first (CLS), whose hidden states a hit would skip."""
        return self.pooling is None or self.pooling.mode == "last"

    @property
    def is_prefilled(self) -> bool:
        """Its prompt has K/V (or it finished, so nothing waits on it any more)."""
        return self.status.is_finished or self.num_computed_tokens >= len(self.prompt_token_ids)

    @property
    def queue_time_s(self) -> float | None:
        """Seconds from entering the engine to its first scheduling; None while it has never run."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def adapter_digest(self) -> str | None:
        return self.adapter.ref.digest if self.adapter is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
