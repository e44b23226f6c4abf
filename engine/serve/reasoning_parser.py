"""A chat output's text as OpenAI's reasoning models return it: `reasoning_content` (the think block, without its
markers) apart from `content` (the answer).

The engine has already found where the block ends (`ReasoningOutput.end`, in characters of the text): the parser
named by --reasoning-parser (deepseek_r1 or qwen3, as vLLM's) decides how an output starts, the engine follows it
token by token (engine.core.reasoning), and this module only cuts the text there. So the split never depends on
how the markers happen to be tokenized, and what streams is exactly what a whole response holds:

- reasoning: the block's text with the opening marker and the whitespace around it dropped at its start, and the
  end marker and the whitespace before it dropped at its end;
- content: what follows the block, without the whitespace templates put after the end marker ("</think>\\n\\n");
  an output without a block is all content, as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.core.outputs import ReasoningOutput
from loraplex.engine.core.reasoning_config import THINK_END, THINK_START


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no think block, or an empty one (`none` may close it at once)
    content: str


def _skip_space(text: str, index: int, stop: int) -> int:
    while index < stop and text[index].isspace():
        index += 1
    return index


def _back_over_space(text: str, index: int, floor: int) -> int:
    while index > floor and text[index - 1].isspace():
        index -= 1
    return index


def _visible_start(text: str, stop: int, *, closed: bool) -> int | None:
    """Where the visible reasoning of the block text[:stop] begins: past leading whitespace, the opening marker and
    the whitespace after it. None while that is not known yet (only whitespace, or part of the marker, so far)."""
    index = _skip_space(text, 0, stop)
    if text.startswith(THINK_START, index, stop):
        after = _skip_space(text, index + len(THINK_START), stop)
        return after if after < stop or closed else None
    if stop - index < len(THINK_START) and THINK_START.startswith(text[index:stop]):
        return stop if closed else None  # the opening marker may still be arriving
    return index


def _visible_end(text: str, begin: int, stop: int, *, closed: bool) -> int:
    """Where the visible reasoning of the block text[:stop] ends: before the end marker and the whitespace around it;
    while the block is open, before a tail that may still become the end marker, before trailing whitespace, and
    before a whole end marker at its end (which the end would drop)."""
    end = stop
    if closed:
        end = _back_over_space(text, end, begin)
        if end - begin >= len(THINK_END) and text.startswith(THINK_END, end - len(THINK_END), end):
            end -= len(THINK_END)
        return _back_over_space(text, end, begin)
    for length in range(min(len(THINK_END) - 1, end - begin), 0, -1):
        if text.startswith(THINK_END[:length], end - length, end):
            end -= length
            break
    end = _back_over_space(text, end, begin)
    # A whole end marker the engine did not end the block at (text that spells it): if the output stops here, the
    # block's end drops it (and the whitespace around it), so it waits until something follows it.
    if end - begin >= len(THINK_END) and text.startswith(THINK_END, end - len(THINK_END), end):
        end = _back_over_space(text, end - len(THINK_END), begin)
    return end


def _reasoning_of(text: str, stop: int) -> str | None:
    """The reasoning of the closed block text[:stop]; None when it shows nothing."""
    begin = _visible_start(text, stop, closed=True)
    assert begin is not None  # a closed block's start is always known
    return text[begin : _visible_end(text, begin, stop, closed=True)] or None


def split(text: str, reasoning: ReasoningOutput | None) -> ReasoningSplit:
    """A finished output's reasoning and content."""
    if reasoning is None or reasoning.end == 0 or reasoning.deciding:
        return ReasoningSplit(None, text)
    if reasoning.end is None:  # the output ended inside its block (a length limit): all of it is reasoning
        return ReasoningSplit(_reasoning_of(text, len(text)), "")
    return ReasoningSplit(_reasoning_of(text, reasoning.end), text[reasoning.end :].lstrip())


class ReasoningStream:
    """Splits a streamed chat output into reasoning and content deltas that add up to `split` of the whole. Each
    call looks only at what is new and at the edges (the markers, whitespace): positions are kept, never a copy of
    the text so far, so a long think block costs each delta its own length."""

    def __init__(self) -> None:
        self._sent_reasoning = 0  # characters of visible reasoning sent
        self._content_sent: int | None = None  # where in the text the content sent so far ends; None before any

    def feed(self, text: str, reasoning: ReasoningOutput | None, *, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content delta), given the output's whole text so far and its ReasoningOutput."""
        if reasoning is None:
            return "", self._content(text, 0, stripped=False)
        if reasoning.deciding and not finished:
            return "", ""
        end = reasoning.end
        if end == 0 or reasoning.deciding:
            return "", self._content(text, 0, stripped=False)
        closed = end is not None or finished
        thought = self._reasoning(text, len(text) if end is None else end, closed=closed)
        return thought, ("" if end is None else self._content(text, end, stripped=True))

    def _reasoning(self, text: str, stop: int, *, closed: bool) -> str:
        begin = _visible_start(text, stop, closed=closed)
        if begin is None:
            return ""
        end = _visible_end(text, begin, stop, closed=closed)
        sent = begin + self._sent_reasoning
        self._sent_reasoning = max(self._sent_reasoning, end - begin)
        return text[sent:end] if end > sent else ""

    def _content(self, text: str, start: int, *, stripped: bool) -> str:
        if self._content_sent is None:
            begin = _skip_space(text, start, len(text)) if stripped else start
            if stripped and begin == len(text):
                return ""  # only whitespace after the block so far: it is dropped if nothing else follows it
            self._content_sent = begin
        out = text[self._content_sent :]
        self._content_sent = len(text)
        return out
