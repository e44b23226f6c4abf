"""Streaming detokenization: turns each step's new token ids into the text they complete.

Decoding the whole output every step costs O(n) per token, and decoding each token alone is wrong (a byte-level
token can be part of a character; SentencePiece decoders drop the space of a text's first word). So, as in vLLM,
only a small window is decoded: `ids[prefix_offset:read_offset]` is text already emitted, kept as context;
`ids[read_offset:]` is pending. The new text is decode(window) minus decode(context); a window whose text ends in
U+FFFD holds an incomplete character, whose tokens stay pending while the tokens before them are emitted. Then the
window slides: context := the tokens just emitted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from loraplex.engine.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first output token: enough for the decoder to see a word boundary.
_PROMPT_CONTEXT_TOKENS = 5
# A real partial character is at most 4 bytes, so at most 4 tokens are ever pending for a good reason. Beyond this,
# the text keeps ending in U+FFFD because the model emits byte garbage; emit it as is so the cost stays bounded.
_MAX_PENDING_TOKENS = 64
# Ids before the window are never read again; drop them now and then so memory stays bounded too.
_COMPACT_AFTER = 1024


class IncrementalDetokenizer:
    """The output text of one sequence, built as its tokens arrive. Owned by that sequence; not thread-safe.

    Invariants (given that flush() is called after the last token):
    - the strings returned by add() and flush(), concatenated, equal `text`;
    - for byte-level BPE tokenizers `text == tokenizer.decode(output_ids)`; for SentencePiece-style ones too, except
      at the start: after a prompt, a first token that starts a new word keeps its space (decode(output_ids) drops
      it, gluing the word to the prompt), so that `decode(prompt_ids) + text == decode(prompt_ids + output_ids)`;
    - no returned string ends in a partial character, so none holds U+FFFD unless the full decode does.
    The one exception: an output that keeps ending in U+FFFD for over 64 tokens (undecodable garbage) is
    emitted as it stands, so a character completed after that point may differ from a full decode.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Ids that decode to nothing are left out of the window: decode drops them anyway, and a run of them would
        # only grow the window.
        self._dropped_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset[int]()
        self._vocab_size = tokenizer.vocab_size

        # The context must decode cleanly: a prompt ending inside a character (a token-id prompt) would swallow
        # the bytes that complete it, and a byte-fallback run cut in the middle decodes as all U+FFFD. So start it
        # at the first of the last few tokens from which it does; with none, output decodes like decode(output_ids).
        tail = self._kept(prompt_token_ids[-4 * _PROMPT_CONTEXT_TOKENS :])[-_PROMPT_CONTEXT_TOKENS:]
        context: list[int] = []
        context_text = ""
        for start in range(len(tail)):
            text = self._decode(tail[start:])
            if not text.endswith(REPLACEMENT_CHAR):
                context, context_text = tail[start:], text
                break
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._pieces: list[str] = []
        self._text: str | None = ""
        self.num_output_tokens = 0  # every id passed to add(), the dropped ones included

    @property
    def text(self) -> str:
        """All output text emitted so far (pending partial characters excluded until they complete)."""
        if self._text is None:
            self._text = "".join(self._pieces)
        return self._text

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends this step's new output tokens; returns the text they complete ("" while a character is partial)."""
        new_ids = list(token_ids)
        self.num_output_tokens += len(new_ids)
        self._ids.extend(self._kept(new_ids))
        return self._emit(force=False)

    def flush(self) -> str:
        """Emits whatever is still held back (a trailing partial character, as U+FFFD); call once at the end."""
        return self._emit(force=True)

    def _emit(self, *, force: bool) -> str:
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        window_text = self._decode(self._ids[self._prefix_offset : end])
        if window_text.endswith(REPLACEMENT_CHAR) and not force:
            if end - self._read_offset > _MAX_PENDING_TOKENS:
                logger.debug("emitting %d tokens of undecodable output as is", end - self._read_offset)
            else:
                # The last tokens hold a partial character, which has at most 3 bytes, so it starts in one of the
                # last 3 tokens: what comes before that may be complete already.
                end, window_text = self._complete_part(end)
        if len(window_text) <= len(self._prefix_text):
            # Nothing complete, or nothing visible yet (e.g. a lone SentencePiece "▁" at the window start).
            return ""
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_offset >= _COMPACT_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._pieces.append(new_text)
        self._text = None
        return new_text

    def _complete_part(self, end: int) -> tuple[int, str]:
        """The longest window ids[prefix_offset:k], k >= end - 3, whose text is complete; ("" if none is)."""
        for cut in range(end - 1, max(self._read_offset, end - 4), -1):
            text = self._decode(self._ids[self._prefix_offset : cut])
            if not text.endswith(REPLACEMENT_CHAR):
                return cut, text
        return self._read_offset, ""

    def _kept(self, token_ids: Iterable[int]) -> list[int]:
        return [
            token_id for token_id in token_ids if token_id not in self._dropped_ids and 0 <= token_id < self._vocab_size
        ]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
