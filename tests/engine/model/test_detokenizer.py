"""IncrementalDetokenizer: streamed text equals a full decode, never splits a character, and stays cheap."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from loraplex.engine.model.detokenizer import IncrementalDetokenizer
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.tools.demo import train_demo_tokenizer

pytestmark = pytest.mark.unit

VOCAB = 1024
MULTIBYTE = "Grüße aus Köln, naïve café! 你好, 世界. Emoji: 😀 👍🏽 🇫🇷 — done."
ENGLISH = "The quick brown fox jumps over the lazy dog. A river runs past the old mill, slow and wide."


def _byte_level() -> Tokenizer:
    return Tokenizer(train_demo_tokenizer(VOCAB), special_tokens={"bos_token": "<|begin_of_text|>"})


def _sentencepiece(decoder: str) -> Tokenizer:
    """A Llama 2 / Mistral style tokenizer: "▁" marks word starts, and characters outside the (ASCII) vocabulary
    fall back to <0xXX> byte tokens. decoder: "strip" (Replace, ByteFallback, Fuse, Strip: what transformers
    converts Llama 2 to) or "metaspace" (the Metaspace decoder, which drops the first token's leading "▁")."""
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained = BackendTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator([ENGLISH, ENGLISH.lower(), "0123456789 ,.;:!?'\"()-"], trainer=trainer)
    data = json.loads(trained.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    # Byte tokens go right after the special tokens, as in Llama 2's vocabulary.
    ordered = ["<unk>", "<s>", "</s>", *byte_tokens] + [t for t in sorted(vocab, key=vocab.__getitem__) if vocab[t] > 2]
    data["model"]["vocab"] = {token: index for index, token in enumerate(ordered)}
    data["model"]["byte_fallback"] = True
    data["added_tokens"] = [{**token, "id": ordered.index(token["content"])} for token in data["added_tokens"]]
    backend = BackendTokenizer.from_str(json.dumps(data))
    if decoder == "strip":
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        backend.decoder = decoders.Sequence(
            [decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
        )
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


BYTE_LEVEL = _byte_level()
SENTENCEPIECE = {name: _sentencepiece(name) for name in ("strip", "metaspace")}


def _stream(
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    output: Sequence[int],
    chunks: Sequence[int] = (),
    *,
    skip_special_tokens: bool = True,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds `output` in chunks of the given sizes (then one by one); returns each add()'s text and flush()'s."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    pieces, start = [], 0
    sizes = iter(chunks)
    while start < len(output):
        size = max(1, next(sizes, 1))
        pieces.append(detokenizer.add(output[start : start + size]))
        start += size
    pieces.append(detokenizer.flush())
    return pieces, detokenizer


token_ids = st.lists(st.integers(0, VOCAB + 8), max_size=40)  # a few ids past the vocabulary, as padded models give


class TestByteLevel:
    @settings(max_examples=300, deadline=None)
    @given(
        prompt=token_ids,
        output=token_ids,
        chunks=st.lists(st.integers(1, 4), max_size=40),
        skip=st.booleans(),
    )
    def test_random_ids_stream_to_a_full_decode(
        self, prompt: list[int], output: list[int], chunks: list[int], skip: bool
    ) -> None:
        pieces, detokenizer = _stream(BYTE_LEVEL, prompt, output, chunks, skip_special_tokens=skip)
        full = BYTE_LEVEL.decode(output, skip_special_tokens=skip)
        assert "".join(pieces) == detokenizer.text == full
        if "\ufffd" not in full:
            assert all("\ufffd" not in piece for piece in pieces)
            # flush() only ever releases a trailing partial character.
            assert pieces[-1] == ""

    @pytest.mark.parametrize("text", [MULTIBYTE, "😀😀😀", "é", "a你b", "\U0001f9d1\u200d\U0001f373 cooks"])
    def test_multibyte_characters_are_held_until_complete(self, text: str) -> None:
        output = BYTE_LEVEL.encode(text, add_special_tokens=False)
        # The demo vocabulary is ASCII English, so these characters really are split over several tokens.
        assert any(BYTE_LEVEL.decode([token]).endswith("\ufffd") for token in output)
        prompt = BYTE_LEVEL.encode("Say it:")
        pieces, detokenizer = _stream(BYTE_LEVEL, prompt, output)
        assert "".join(pieces) == detokenizer.text == text
        assert all("\ufffd" not in piece for piece in pieces)
        assert "" in pieces[:-1]  # something was held back on the way

    def test_text_ending_mid_character_is_released_by_flush(self) -> None:
        output = BYTE_LEVEL.encode("ok 😀", add_special_tokens=False)[:-1]
        detokenizer = IncrementalDetokenizer(BYTE_LEVEL, [])
        assert detokenizer.add(output) == "ok "
        assert detokenizer.flush() == "\ufffd"
        assert detokenizer.text == BYTE_LEVEL.decode(output)

    def test_space_after_the_prompt_is_kept(self) -> None:
        prompt = BYTE_LEVEL.encode("The capital of France is")
        output = BYTE_LEVEL.encode(" Paris.", add_special_tokens=False)
        pieces, _ = _stream(BYTE_LEVEL, prompt, output)
        assert pieces[0].startswith(" P")
        assert "".join(pieces) == " Paris."

    def test_special_tokens_are_skipped_or_kept(self) -> None:
        output = BYTE_LEVEL.encode("hi<|im_end|>", add_special_tokens=False)
        assert "".join(_stream(BYTE_LEVEL, [], output)[0]) == "hi"
        assert "".join(_stream(BYTE_LEVEL, [], output, skip_special_tokens=False)[0]) == "hi<|im_end|>"

    def test_each_step_decodes_a_small_window(self) -> None:
        windows: list[int] = []

        class CountingTokenizer(Tokenizer):
            def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
                windows.append(len(ids))
                return super().decode(ids, skip_special_tokens=skip_special_tokens)

        tokenizer = CountingTokenizer(train_demo_tokenizer(VOCAB))
        text = (ENGLISH + " " + MULTIBYTE + " ") * 40
        output = tokenizer.encode(text, add_special_tokens=False)
        assert len(output) > 2000
        _, detokenizer = _stream(tokenizer, tokenizer.encode(text[:500]), output)
        assert detokenizer.text == text
        assert max(windows) <= 12
        assert len(windows) <= 2 * len(output) + 4
        assert detokenizer.num_output_tokens == len(output)


class TestSentencePiece:
    @pytest.mark.parametrize("decoder", sorted(SENTENCEPIECE))
    def test_first_word_keeps_its_space_after_a_prompt(self, decoder: str) -> None:
        tokenizer = SENTENCEPIECE[decoder]
        prompt = tokenizer.encode("The fox jumps over")
        output = tokenizer.encode("the dog", add_special_tokens=False)
        assert tokenizer.convert_ids_to_tokens(output)[0] == "▁the"
        _, detokenizer = _stream(tokenizer, prompt, output)
        assert detokenizer.text == " the dog"
        full = tokenizer.decode(prompt + output)
        assert tokenizer.decode(prompt) + detokenizer.text == full == "The fox jumps over the dog"

    @pytest.mark.parametrize("decoder", sorted(SENTENCEPIECE))
    def test_without_prompt_equals_decode(self, decoder: str) -> None:
        tokenizer = SENTENCEPIECE[decoder]
        output = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
        assert any(token.startswith("<0x") for token in tokenizer.convert_ids_to_tokens(output))  # type: ignore[union-attr]
        pieces, detokenizer = _stream(tokenizer, [], output)
        assert detokenizer.text == tokenizer.decode(output) == MULTIBYTE
        assert all("\ufffd" not in piece for piece in pieces)

    @settings(max_examples=150, deadline=None)
    @given(
        decoder=st.sampled_from(sorted(SENTENCEPIECE)),
        prompt_text=st.text(alphabet="ab ,.é你😀", max_size=12),
        output_text=st.text(alphabet="ab ,.\né你😀", max_size=20),
        word_ids=st.lists(st.integers(3 + 256, 400), max_size=10),
        chunks=st.lists(st.integers(1, 3), max_size=30),
    )
    def test_streams_what_follows_the_prompt(
        self, decoder: str, prompt_text: str, output_text: str, word_ids: list[int], chunks: list[int]
    ) -> None:
        tokenizer = SENTENCEPIECE[decoder]
        prompt = tokenizer.encode(prompt_text)
        # Byte tokens as a model emits them (whole characters), mixed with arbitrary word pieces, with and
        # without a word start at the boundary.
        output = word_ids + tokenizer.encode(output_text, add_special_tokens=False) + word_ids[::-1]
        pieces, detokenizer = _stream(tokenizer, prompt, output, chunks)
        full, prefix = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
        assert full.startswith(prefix)
        assert "".join(pieces) == detokenizer.text == full[len(prefix) :]
        assert all("\ufffd" not in piece for piece in pieces)
        if not prompt:
            assert detokenizer.text == tokenizer.decode(output)
