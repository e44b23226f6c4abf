"""What the engine hands back, shaped like vLLM's RequestOutput so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One position's log-probabilities: the sampled token and the top-n alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True, slots=True)
class ReasoningOutput:
    """A reasoning request's think block so far (reasoning.py)."""

    num_tokens: int  # output tokens of the block: its markers, the model's thinking and any forced closing text
    # Characters of `text` the block takes, markers included: 0 when the output has none; None while it is open
    # (all text so far is the block's) or while the output may still open one (`deciding`).
    end: int | None
    deciding: bool = False  # the output's first tokens may be the opening marker: none of its text is known yet


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # everything generated so far (held back: a tail that may still become a stop string)
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS or length
    reasoning: ReasoningOutput | None = None  # a reasoning request's think block; None for other requests

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    lora_name: str | None = None
    error: str | None = None  # why it finished with finish_reason "error"
    queue_time_s: float | None = None  # from entering the engine to its first scheduling; None until it first ran
    embedding: list[float] | None = None  # an embedding request's vector, once finished (core/pooling.py)
