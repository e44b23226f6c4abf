"""Turns sampled tokens into text and finish decisions: stop tokens, stop strings, length limits, logprobs.

Stop tokens (EOS unless ignore_eos, and stop_token_ids) end a request without being emitted; so does a stop token
its grammar allows, and a grammar that is complete and allows nothing more ends it with the token that completed it
(finish reason "stop", no stop reason). Stop strings end it too: the text is cut before the stop string (after it
with include_stop_str_in_output), and while a request runs, the last `longest stop string - 1` characters are held
back from its visible text, since they might still become a stop string. A reasoning row's think block is not its
answer: its grammar starts after the block, and its stop strings are looked for after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.core.outputs import CompletionOutput, Logprob, PositionLogprobs, ReasoningOutput, RequestOutput
from loraplex.engine.core.reasoning import Phase, ReasoningState
from loraplex.engine.core.request import Request, RequestStatus
from loraplex.engine.core.sampler import TokenLogprobs
from loraplex.engine.model.detokenizer import IncrementalDetokenizer
from loraplex.engine.model.tokenizer import Tokenizer


@dataclass(slots=True)
class _Stream:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    hold_back: int = 0  # characters withheld from a running request's visible text
    reasoning_end: int | None = None  # characters of `text` its think block takes, once it is over (0: none)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._streams: dict[str, _Stream] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        self._streams[request.request_id] = _Stream(
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            hold_back=max((len(s) for s in params.stop), default=1) - 1,
            reasoning_end=0 if request.reasoning is not None and not request.reasoning.is_open else None,
        )

    def remove(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def forbidden_tokens(self, request: Request, *, ahead: int = 0) -> frozenset[int]:
        """Tokens the request may not sample yet (stop and EOS tokens before min_tokens); with `ahead`, at the
        position that many tokens further on (a speculative proposal's)."""
        params = request.sampling_params
        if len(request.output_token_ids) + ahead >= params.min_tokens:
            return frozenset()
        stops = frozenset(params.stop_token_ids or ())
        return stops if params.ignore_eos else stops | self.eos_token_ids

    def reasoning_forbidden(self, request: Request, state: ReasoningState) -> frozenset[int]:
        """Tokens a reasoning row may not sample where its think block is `state`: its stop and EOS tokens while it
        thinks under a budget (it must answer after thinking), the opening marker when it may not think at all."""
        banned: set[int] = set()
        if state.forbids_stop:
            params = request.sampling_params
            banned.update(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(self.eos_token_ids)
        marker = state.forbids_marker()
        if marker is not None:
            banned.add(marker)
        return frozenset(banned)

    def process_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> RequestStatus | None:
        """Record a sampled token; return the finished status when this token ends the request."""
        params = request.sampling_params
        stream = self._streams[request.request_id]
        if token_id in (params.stop_token_ids or ()):
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED

        request.output_token_ids.append(token_id)
        before = request.reasoning
        answer = before is None or not before.is_open  # this token is part of the answer, not of a think block
        closed_at: int | None = None  # where the block ends in the text, if this token ends it
        if before is not None and before.is_open:
            after = before.after(token_id)
            request.reasoning = after
            if not after.is_open:
                if before.phase is Phase.OPENING:  # the output did not open a block: this token starts the answer
                    answer, closed_at = True, 0
                else:
                    closed_at = -1  # after this token's text
        grammar_done = False
        if request.grammar is not None and answer:
            if not request.grammar.accept(token_id):
                request.error = f"token {token_id} does not fit the request's output grammar"
                return RequestStatus.FINISHED_ERROR
            grammar_done = request.grammar.is_finished()
        if logprobs is not None and stream.logprobs is not None:
            stream.logprobs.append(self._position_logprobs(logprobs))
            stream.cumulative_logprob = (stream.cumulative_logprob or 0.0) + logprobs.logprob
        before_chars = len(stream.text)
        stream.text += stream.detokenizer.add([token_id])
        if closed_at is not None:
            stream.reasoning_end = len(stream.text) if closed_at < 0 else closed_at

        if params.stop and (request.reasoning is None or not request.reasoning.is_open):
            # A reasoning row's stop strings end its answer, never its think block: they are looked for after it.
            window_start = max(0, before_chars - stream.hold_back, stream.reasoning_end or 0)
            hit = _first_stop(stream.text, params.stop, window_start)
            if hit is not None:
                index, stop = hit
                stream.text = (
                    stream.text[: index + len(stop)] if params.include_stop_str_in_output else stream.text[:index]
                )
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
        if grammar_done:  # the grammar allows nothing more: the output is complete
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_output(self, request: Request) -> RequestOutput:
        stream = self._streams[request.request_id]
        finished = request.status.is_finished
        if finished and not isinstance(request.stop_reason, str):
            # The end may land inside a multi-byte character: emit what the detokenizer holds (a stop string
            # already cut the text where it belongs).
            stream.text += stream.detokenizer.flush()
        text = stream.text
        if not finished and stream.hold_back:
            text = text[: max(0, len(text) - stream.hold_back)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=stream.cumulative_logprob,
            logprobs=list(stream.logprobs) if stream.logprobs is not None else None,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            reasoning=self._reasoning(request, stream, len(text), finished),
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            lora_name=request.adapter.ref.name if request.adapter is not None else None,
            error=request.error,
            queue_time_s=request.queue_time_s,
            embedding=request.pooling.embedding if request.pooling is not None else None,
        )

    @staticmethod
    def _reasoning(request: Request, stream: _Stream, num_chars: int, finished: bool) -> ReasoningOutput | None:
        state = request.reasoning
        if state is None:
            return None
        if state.phase is Phase.OPENING:
            # A finished output that never completed the opening marker has no think block: its text is the answer.
            return ReasoningOutput(0, 0) if finished else ReasoningOutput(state.num_tokens, None, deciding=True)
        end = stream.reasoning_end
        if end is not None and end > num_chars:
            # Running, the block's end is in the tail held back for stop strings: as far as the text shown goes, the
            # block is open. Finished, a stop string cut the text inside the block: it ends with the text.
            end = num_chars if finished else None
        return ReasoningOutput(state.num_tokens, end)

    def _position_logprobs(self, logprobs: TokenLogprobs) -> PositionLogprobs:
        decode = self.tokenizer.decode
        entries: PositionLogprobs = {}
        for rank, (token, value) in enumerate(logprobs.top, start=1):
            entries[token] = Logprob(value, rank, decode([token], skip_special_tokens=False))
        if logprobs.token_id not in entries:
            entries[logprobs.token_id] = Logprob(
                logprobs.logprob, logprobs.rank, decode([logprobs.token_id], skip_special_tokens=False)
            )
        return entries


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
