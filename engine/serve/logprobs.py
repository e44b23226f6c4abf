"""The OpenAI shapes of log-probabilities: the legacy completions API's parallel lists and the chat API's
per-token entries, made from the engine's per-position logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from loraplex.engine.core.outputs import PositionLogprobs


def _by_rank(position: PositionLogprobs) -> list[tuple[str, float]]:
    """(decoded token, logprob) of one position's entries, most likely first."""
    ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
    return [(lp.decoded_token or "", lp.logprob) for lp in ranked]


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    @classmethod
    def of(
        cls, token_ids: Sequence[int], positions: Sequence[PositionLogprobs], text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """The logprobs of `token_ids`, whose text starts at `text_offset`; returns them and the next offset."""
        result = cls()
        for token_id, position in zip(token_ids, positions, strict=True):
            sampled = position.get(token_id)
            token = (sampled.decoded_token or "") if sampled is not None else ""
            result.tokens.append(token)
            result.token_logprobs.append(sampled.logprob if sampled is not None else None)
            # vLLM's shape: the top alternatives plus the sampled token, so logprobs=0 still names it.
            top: dict[str, float] = {}
            for text, logprob in _by_rank(position):
                top.setdefault(text, logprob)  # two ids may decode alike: keep the likelier
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result, text_offset


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int) -> ChoiceLogprobs:
        """Chat logprobs of `token_ids`: each with its `top_n` most likely alternatives, most likely first."""
        content: list[TokenLogprob] = []
        for token_id, position in zip(token_ids, positions, strict=True):
            sampled = position.get(token_id)
            token = (sampled.decoded_token or "") if sampled is not None else ""
            top = [
                TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))
                for text, logprob in _by_rank(position)[:top_n]
            ]
            # The engine always reports the sampled token; the fallback only keeps the shape if it did not.
            logprob = sampled.logprob if sampled is not None else -9999.0
            content.append(TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top))
        return cls(content=content)
