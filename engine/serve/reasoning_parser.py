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


def _reasoning_text(block: str, *, closed: bool) -> str:
    """The visible reasoning of a block's text so far; while the block is open, the tail that may still become the
    end marker (or is whitespace the end may drop) is held back."""
    text = block.lstrip()
    if text.startswith(THINK_START):
        text = text[len(THINK_START) :].lstrip()
    elif THINK_START.startswith(text):
        return ""  # the opening marker may still be arriving
    if closed:
        text = text.rstrip()
        return text.removesuffix(THINK_END).rstrip()
    for length in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        if text.endswith(THINK_END[:length]):
            text = text[:-length]
            break
    return text.rstrip()


def split(text: str, reasoning: ReasoningOutput | None) -> ReasoningSplit:
    """A finished output's reasoning and content."""
    if reasoning is None or reasoning.end == 0 or reasoning.deciding:
        return ReasoningSplit(None, text)
    if reasoning.end is None:  # the output ended inside its block (a length limit): all of it is reasoning
        return ReasoningSplit(_reasoning_text(text, closed=True) or None, "")
    return ReasoningSplit(_reasoning_text(text[: reasoning.end], closed=True) or None, text[reasoning.end :].lstrip())


class ReasoningStream:
    """Splits a streamed chat output into reasoning and content deltas that add up to `split` of the whole."""

    def __init__(self) -> None:
        self._sent_reasoning = 0  # characters of visible reasoning sent
        self._content_started = False
        self._sent_content = 0  # characters of the text after the block already sent (or dropped as leading space)

    def feed(self, text: str, reasoning: ReasoningOutput | None, *, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content delta), given the output's whole text so far and its ReasoningOutput."""
        if reasoning is None:
            return "", self._content(text, 0, stripped=False)
        if reasoning.deciding and not finished:
            return "", ""
        end = reasoning.end
        if end is None and not finished:
            return self._reasoning(_reasoning_text(text, closed=False)), ""
        if end == 0 or (reasoning.deciding and finished):
            return "", self._content(text, 0, stripped=False)
        block = text if end is None else text[:end]
        out = self._reasoning(_reasoning_text(block, closed=True))
        return out, ("" if end is None else self._content(text, end, stripped=True))

    def _reasoning(self, visible: str) -> str:
        out = visible[self._sent_reasoning :]
        self._sent_reasoning = max(self._sent_reasoning, len(visible))
        return out

    def _content(self, text: str, start: int, *, stripped: bool) -> str:
        rest = text[start:]
        if stripped and not self._content_started:
            body = rest.lstrip()
            if not body:
                return ""  # only whitespace after the block so far: it is dropped if nothing else follows it
            self._sent_content = len(rest) - len(body)
        self._content_started = True
        out = rest[self._sent_content :]
        self._sent_content = len(rest)
        return out
