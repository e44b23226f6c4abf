"""Tokenizer: loading an HF folder, encode/decode, BOS handling, special ids and the chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.errors import CheckpointError, RequestError
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.tools.demo import BOS_TOKEN, END_OF_TEXT_TOKEN, IM_END_TOKEN, IM_START_TOKEN, write_tokenizer

pytestmark = pytest.mark.unit

VOCAB = 1024
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer-only folder as write_tokenizer makes it; tests copy it before changing anything."""
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer(demo_folder: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_folder)


def _variant(demo_folder: Path, tmp_path: Path, **files: dict[str, Any] | None) -> Path:
    """A copy of the demo folder with some JSON files replaced (dict) or removed (None); keys use _ for dots."""
    folder = tmp_path / "model"
    shutil.copytree(demo_folder, folder)
    for key, value in files.items():
        path = folder / key.replace("_json", ".json")
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps(value))
    return folder


def _tokenizer_config(demo_folder: Path, **changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((demo_folder / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def _tokenizer_json_without_post_processor(folder: Path) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))


class TestFromDir:
    def test_missing_tokenizer_json_names_it(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path)
        (folder / "tokenizer.json").unlink()
        with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
            Tokenizer.from_dir(folder)

    def test_corrupt_tokenizer_json_names_it(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path)
        (folder / "tokenizer.json").write_text('{"model": 42}')
        with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
            Tokenizer.from_dir(folder)

    def test_invalid_json_config_names_the_file(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path)
        (folder / "generation_config.json").write_text("{not json")
        with pytest.raises(CheckpointError, match=r"generation_config\.json"):
            Tokenizer.from_dir(folder)

    def test_bad_eos_field_names_file_and_field(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path, config_json={"eos_token_id": "two"})
        with pytest.raises(CheckpointError, match=r"config\.json.*eos_token_id"):
            Tokenizer.from_dir(folder)

    def test_eos_token_missing_from_vocabulary_is_refused(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, eos_token="</nope>")
        folder = _variant(demo_folder, tmp_path, tokenizer_config_json=config)
        with pytest.raises(CheckpointError, match=r"eos_token.*</nope>"):
            Tokenizer.from_dir(folder)

    def test_tokenizer_json_alone_is_enough(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path, tokenizer_config_json=None)
        tokenizer = Tokenizer.from_dir(folder)
        assert tokenizer.decode(tokenizer.encode("plain text")) == "plain text"
        assert tokenizer.eos_token_ids == frozenset()
        assert tokenizer.chat_template is None

    def test_code_in_the_folder_never_runs(self, demo_folder: Path, tmp_path: Path) -> None:
        marker = tmp_path / "executed"
        config = _tokenizer_config(
            demo_folder,
            tokenizer_class="EvilTokenizer",
            auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
        )
        folder = _variant(demo_folder, tmp_path, tokenizer_config_json=config)
        (folder / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        tokenizer = Tokenizer.from_dir(folder)
        tokenizer.apply_chat_template(CHAT)
        assert not marker.exists()


class TestEncodeDecode:
    @settings(max_examples=60, deadline=None)
    @given(text=st.text(max_size=60))
    def test_round_trip_any_text(self, tokenizer: Tokenizer, text: str) -> None:
        # Special-token strings in the text become their ids (Hypothesis draws them: it mines the code's literals),
        # which a decode that skips special tokens would drop.
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text

    @pytest.mark.parametrize("text", ["Hello, world!", "  two  spaces\n\tand tabs", "Grüße, café, 你好 😀👍🏽"])
    def test_round_trip_with_bos(self, tokenizer: Tokenizer, text: str) -> None:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text

    def test_special_token_text_becomes_its_id(self, tokenizer: Tokenizer) -> None:
        ids = tokenizer.encode(f"{IM_START_TOKEN}user", add_special_tokens=False)
        assert ids[0] == tokenizer.token_to_id(IM_START_TOKEN)
        assert tokenizer.decode(ids) == "user"

    def test_unknown_ids_decode_to_nothing(self, tokenizer: Tokenizer) -> None:
        ids = tokenizer.encode("abc", add_special_tokens=False)
        assert tokenizer.decode([*ids, tokenizer.vocab_size, tokenizer.vocab_size + 100]) == "abc"
        assert tokenizer.convert_ids_to_tokens([tokenizer.vocab_size]) == [None]

    def test_negative_ids_are_a_value_error(self, tokenizer: Tokenizer) -> None:
        with pytest.raises(ValueError, match="non-negative"):
            tokenizer.decode([-1])

    def test_vocab_and_special_ids(self, tokenizer: Tokenizer) -> None:
        assert tokenizer.vocab_size == VOCAB
        specials = {tokenizer.token_to_id(t) for t in (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)}
        assert tokenizer.all_special_ids == specials
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" the", add_special_tokens=False)) == ["Ġthe"]


class TestBos:
    def test_post_processor_bos_is_not_doubled(self, tokenizer: Tokenizer) -> None:
        # The demo folder asks for BOS twice over: in tokenizer.json's post-processor and with add_bos_token.
        ids = tokenizer.encode("hi")
        assert ids.count(tokenizer.bos_token_id) == 1  # type: ignore[arg-type]
        assert tokenizer.encode("hi", add_special_tokens=False) == ids[1:]

    def test_add_bos_token_alone_adds_it(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path)
        _tokenizer_json_without_post_processor(folder)
        tokenizer = Tokenizer.from_dir(folder)
        ids = tokenizer.encode("hi")
        assert ids[0] == tokenizer.bos_token_id == tokenizer.token_to_id(BOS_TOKEN)
        assert ids[1:] == tokenizer.encode("hi", add_special_tokens=False)
        assert tokenizer.bos_token_id not in ids[1:]

    def test_no_bos_when_nothing_asks_for_it(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(
            demo_folder, tmp_path, tokenizer_config_json=_tokenizer_config(demo_folder, add_bos_token=None)
        )
        _tokenizer_json_without_post_processor(folder)
        tokenizer = Tokenizer.from_dir(folder)
        assert tokenizer.bos_token_id is not None
        assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)

    def test_bos_id_falls_back_to_config_json(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, bos_token=None)
        folder = _variant(demo_folder, tmp_path, tokenizer_config_json=config, config_json={"bos_token_id": [7, 8]})
        assert Tokenizer.from_dir(folder).bos_token_id == 7


class TestEosIds:
    def _ids(self, tokenizer: Tokenizer, *tokens: str) -> frozenset[int]:
        return frozenset(tokenizer.token_to_id(token) for token in tokens)  # type: ignore[misc]

    def test_from_tokenizer_config_string(self, tokenizer: Tokenizer) -> None:
        assert tokenizer.eos_token_ids == self._ids(tokenizer, IM_END_TOKEN)

    def test_from_tokenizer_config_added_token_dict(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, eos_token={"__type": "AddedToken", "content": END_OF_TEXT_TOKEN})
        tokenizer = Tokenizer.from_dir(_variant(demo_folder, tmp_path, tokenizer_config_json=config))
        assert tokenizer.eos_token_ids == self._ids(tokenizer, END_OF_TEXT_TOKEN)
        assert tokenizer.eos_token == END_OF_TEXT_TOKEN

    def test_from_config_json_int(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, eos_token=None)
        folder = _variant(demo_folder, tmp_path, tokenizer_config_json=config, config_json={"eos_token_id": 5})
        assert Tokenizer.from_dir(folder).eos_token_ids == {5}

    def test_from_generation_config_list(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, eos_token=None)
        folder = _variant(
            demo_folder, tmp_path, tokenizer_config_json=config, generation_config_json={"eos_token_id": [5, 6]}
        )
        assert Tokenizer.from_dir(folder).eos_token_ids == {5, 6}

    def test_union_of_all_sources(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(
            demo_folder, tmp_path, config_json={"eos_token_id": [1, 9]}, generation_config_json={"eos_token_id": 8}
        )
        tokenizer = Tokenizer.from_dir(folder)
        assert tokenizer.eos_token_ids == {1, 8, 9} | self._ids(tokenizer, IM_END_TOKEN)


class TestSamplingDefaults:
    """generation_config.json's sampling fields become the defaults of requests that leave them out (vLLM's
    `--generation-config auto`); a request's own value always wins."""

    QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": [5, 6]}

    def test_read_from_generation_config(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path, generation_config_json=self.QWEN3)
        assert Tokenizer.from_dir(folder).sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}

    def test_requests_inherit_what_they_leave_out(self, demo_folder: Path, tmp_path: Path) -> None:
        from loraplex.engine.serve.protocol import ChatCompletionRequest, CompletionRequest

        defaults = Tokenizer.from_dir(
            _variant(demo_folder, tmp_path, generation_config_json=self.QWEN3)
        ).sampling_defaults
        chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        params = chat.sampling_params(defaults)
        assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.95, 20, 0.0)
        own = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": 0, "top_k": 5})
        params = own.sampling_params(defaults)
        assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, 5)
        assert chat.sampling_params().temperature == 1.0  # no checkpoint defaults: the API's

    @pytest.mark.parametrize("bad", [{"temperature": "hot"}, {"top_p": 1.5}, {"top_k": True}])
    def test_a_bad_field_names_file_and_field(self, demo_folder: Path, tmp_path: Path, bad: dict[str, object]) -> None:
        folder = _variant(demo_folder, tmp_path, generation_config_json=bad)
        with pytest.raises(CheckpointError, match=rf"generation_config\.json.*{next(iter(bad))}"):
            Tokenizer.from_dir(folder)


class TestChatTemplate:
    def test_renders_with_and_without_generation_prompt(self, tokenizer: Tokenizer) -> None:
        body = f"{BOS_TOKEN}<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) == body
        assert tokenizer.apply_chat_template(CHAT) == body + "<|im_start|>assistant\n"

    def test_encode_chat_has_one_bos(self, tokenizer: Tokenizer) -> None:
        ids = tokenizer.encode_chat(CHAT)
        assert ids.count(tokenizer.bos_token_id) == 1  # type: ignore[arg-type]
        assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.apply_chat_template(CHAT)

    def test_raise_exception_becomes_a_request_error(self, tokenizer: Tokenizer) -> None:
        with pytest.raises(RequestError, match="Unknown role: robot") as caught:
            tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
        assert caught.value.param == "messages"

    def test_missing_template_is_a_clear_error(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, chat_template=None)
        tokenizer = Tokenizer.from_dir(_variant(demo_folder, tmp_path, tokenizer_config_json=config))
        with pytest.raises(RequestError, match="no chat template"):
            tokenizer.apply_chat_template(CHAT)

    def test_named_templates_use_default(self, demo_folder: Path, tmp_path: Path) -> None:
        templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT {{ 1 + 1 }}"}]
        config = _tokenizer_config(demo_folder, chat_template=templates)
        tokenizer = Tokenizer.from_dir(_variant(demo_folder, tmp_path, tokenizer_config_json=config))
        assert tokenizer.apply_chat_template(CHAT) == "DEFAULT 2"

    def test_chat_template_file_wins(self, demo_folder: Path, tmp_path: Path) -> None:
        folder = _variant(demo_folder, tmp_path)
        (folder / "chat_template.jinja").write_text("{{ messages | length }} messages")
        assert Tokenizer.from_dir(folder).apply_chat_template(CHAT) == "2 messages"

    def test_syntax_error_is_refused_at_load(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, chat_template="{% for m in messages %}")
        with pytest.raises(CheckpointError, match="chat template does not compile"):
            Tokenizer.from_dir(_variant(demo_folder, tmp_path, tokenizer_config_json=config))

    def test_sandbox_refuses_attribute_tricks(self, demo_folder: Path, tmp_path: Path) -> None:
        config = _tokenizer_config(demo_folder, chat_template="{{ messages.__class__.__mro__ }}")
        tokenizer = Tokenizer.from_dir(_variant(demo_folder, tmp_path, tokenizer_config_json=config))
        with pytest.raises(RequestError, match="unsafe"):
            tokenizer.apply_chat_template(CHAT)

    def test_renders_like_transformers(self, demo_folder: Path, tmp_path: Path) -> None:
        # Trim/lstrip of blocks, tojson without HTML escaping, loopcontrols, namespace, generation tags.
        template = (
            "{% set ns = namespace(count=0) %}\n"
            "{% for message in messages %}\n"
            "  {% if message['role'] == 'system' %}{% continue %}{% endif %}\n"
            "  {% set ns.count = ns.count + 1 %}\n"
            "  {{ message | tojson }}\n"
            "  {% generation %}[{{ loop.index }}]{% endgeneration %}\n"
            "{% endfor %}\n"
            "{{ ns.count }} {{ eos_token }}{% if add_generation_prompt %}<gen>{% endif %}"
        )
        config = _tokenizer_config(demo_folder, chat_template=template)
        folder = _variant(demo_folder, tmp_path, tokenizer_config_json=config)
        messages = [*CHAT, {"role": "user", "content": 'a <b> & "c" é'}]
        transformers = pytest.importorskip("transformers")
        reference = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        for generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            ours = Tokenizer.from_dir(folder).apply_chat_template(messages, add_generation_prompt=generation_prompt)
            assert ours == expected


# --- the cheap length bound ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=400), num_tokens=st.integers(min_value=0, max_value=120))
def test_a_text_surely_longer_than_n_tokens_encodes_to_more(tokenizer: Tokenizer, text: str, num_tokens: int) -> None:
    """The bound is sound: whenever it says a text is too long, tokenizing it agrees (it may say nothing)."""
    if tokenizer.surely_longer_than(text, num_tokens):
        assert len(tokenizer.encode(text, add_special_tokens=False)) > num_tokens


def test_the_bound_is_the_longest_token_and_catches_a_run_of_it(tokenizer: Tokenizer) -> None:
    assert tokenizer.max_chars_per_token is not None
    longest = max((tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)), key=len)
    assert tokenizer.max_chars_per_token == len(longest)
    # The worst case for the bound: a text of nothing but the longest token is exactly that many tokens.
    text = longest * 50
    assert not tokenizer.surely_longer_than(text, 50)
    assert tokenizer.surely_longer_than(text + "x", 50)


def test_no_bound_where_one_token_may_cover_any_length(demo_folder: Path, tmp_path: Path) -> None:
    """A WordPiece model maps a word too long for it to one unknown token: no length tells its token count."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, pre_tokenizers

    backend = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]", max_input_chars_per_word=5))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = Tokenizer(backend)
    assert wordpiece.max_chars_per_token is None
    assert not wordpiece.surely_longer_than("b" * 10_000, 1)
    assert len(wordpiece.encode("b" * 10_000, add_special_tokens=False)) == 1
    # A normalizing tokenizer gets a margin: composition can fold several code points into one.
    folder = _variant(demo_folder, tmp_path)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "NFC"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    plain, normalizing = Tokenizer.from_dir(demo_folder), Tokenizer.from_dir(folder)
    assert plain.max_chars_per_token is not None and normalizing.max_chars_per_token is not None
    assert normalizing.max_chars_per_token == 4 * plain.max_chars_per_token
