"""The tokenizer of a Hugging Face model folder: text <-> token ids, special ids, and the chat template.

Only data is read from the folder (tokenizer.json through the `tokenizers` library, JSON configs, a Jinja
template rendered in a sandbox); no code from it ever runs, so `auto_map` and custom tokenizer classes are
ignored on purpose.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from loraplex.engine.errors import CheckpointError, RequestError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# Recent transformers versions save the template in its own file, which then wins over tokenizer_config.json's.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The special-token names transformers hands to a chat template (its `special_tokens_map`).
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encodes and decodes text for one base model and renders its chat template.

    Immutable after construction, so one instance is shared by every request of an engine.
    `eos_token_ids` is the union of every end-of-sequence id the folder names (config.json,
    generation_config.json and tokenizer_config.json's `eos_token`): generation stops at any of them.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        add_bos_token: bool | None = None,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
        source: str = "tokenizer",
    ) -> None:
        """Wraps a loaded `tokenizers.Tokenizer`; `from_dir` is the usual way in.

        special_tokens: bos_token / eos_token / unk_token / pad_token strings, as tokenizer_config.json names them.
        add_bos_token: prepend BOS on `encode` unless the backend's post-processor already does.
        eos_token_ids: extra end-of-sequence ids, on top of `eos_token`'s.
        bos_token_id: used when `bos_token` is not given (config.json's id).
        sampling_defaults: the checkpoint's own sampling settings (generation_config.json), for requests that set none.
        source: names the folder in error messages.
        """
        self._backend = backend
        self.sampling_defaults: dict[str, float] = dict(sampling_defaults or {})
        self._source = source
        self._special_tokens = dict(special_tokens or {})
        self._template_source = chat_template
        self._template = _compile_chat_template(chat_template, source) if chat_template is not None else None

        bos_token = self._special_tokens.get("bos_token")
        eos_token = self._special_tokens.get("eos_token")
        self.bos_token_id: int | None = (
            self._token_id_of(bos_token, "bos_token") if bos_token is not None else bos_token_id
        )
        eos_ids = set(eos_token_ids)
        if eos_token is not None:
            eos_ids.add(self._token_id_of(eos_token, "eos_token"))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

        vocab = backend.get_vocab(with_added_tokens=True)
        # The number of ids this tokenizer can decode; a model's vocab may be larger (padding rows), and ids at or
        # past this decode to nothing.
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        # Exactly the ids `decode(..., skip_special_tokens=True)` drops: the backend's special added tokens.
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

        self.max_chars_per_token: int | None = _max_chars_per_token(backend, self.vocab_size)

        # Llama 3 style folders add BOS in tokenizer.json's post-processor; Llama 2 style ones may only say
        # add_bos_token. Adding it in both places would double it, so ask the post-processor what it does.
        post_processor_adds_bos = self.bos_token_id is not None and backend.encode("").ids[:1] == [self.bos_token_id]
        if add_bos_token and self.bos_token_id is None:
            logger.warning("%s: add_bos_token is true but no bos_token is set; no BOS will be added", source)
        self._add_bos = bool(add_bos_token) and self.bos_token_id is not None and not post_processor_adds_bos

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads the tokenizer of an HF model folder; raises CheckpointError naming the bad file or field."""
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file}: missing; only fast tokenizers (tokenizer.json) are supported")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception for every kind of bad file
            raise CheckpointError(f"{tokenizer_file}: cannot be loaded by the tokenizers library: {exc}") from exc

        tokenizer_config = _read_json_object(folder / TOKENIZER_CONFIG_FILE)
        generation_config = _read_json_object(folder / GENERATION_CONFIG_FILE)
        model_config = _read_json_object(folder / MODEL_CONFIG_FILE)

        special_tokens: dict[str, str] = {}
        for name in _TEMPLATE_TOKEN_NAMES:
            token = _token_content(tokenizer_config.get(name), folder / TOKENIZER_CONFIG_FILE, name)
            if token is not None:
                special_tokens[name] = token

        add_bos_token = tokenizer_config.get("add_bos_token")
        if add_bos_token is not None and not isinstance(add_bos_token, bool):
            raise CheckpointError(f"{folder / TOKENIZER_CONFIG_FILE}: add_bos_token must be true or false")

        eos_ids = _token_ids(generation_config.get("eos_token_id"), folder / GENERATION_CONFIG_FILE, "eos_token_id")
        eos_ids += _token_ids(model_config.get("eos_token_id"), folder / MODEL_CONFIG_FILE, "eos_token_id")
        bos_ids = _token_ids(generation_config.get("bos_token_id"), folder / GENERATION_CONFIG_FILE, "bos_token_id")
        bos_ids += _token_ids(model_config.get("bos_token_id"), folder / MODEL_CONFIG_FILE, "bos_token_id")

        return cls(
            backend,
            chat_template=_read_chat_template(folder, tokenizer_config),
            special_tokens=special_tokens,
            add_bos_token=add_bos_token,
            eos_token_ids=eos_ids,
            bos_token_id=bos_ids[0] if bos_ids else None,
            sampling_defaults=_sampling_defaults(generation_config, folder / GENERATION_CONFIG_FILE),
            source=str(folder),
        )

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer`; treat it as read-only."""
        return self._backend

    @property
    def chat_template(self) -> str | None:
        return self._template_source

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings inside `text` become their ids.

        add_special_tokens: apply the post-processor (e.g. Llama 3's BOS) and add BOS where the folder asks for it.
        A rendered chat template already holds the BOS it wants: encode it with add_special_tokens=False (or use
        `encode_chat`).
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; ids this tokenizer does not know (>= vocab_size) decode to nothing.

        Byte-level tokens that end in the middle of a character decode to U+FFFD; see IncrementalDetokenizer.
        """
        try:
            text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be non-negative integers: {exc}") from exc
        return text

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """The vocabulary strings of `ids` (e.g. "Ġthe", "▁the"); None for an id the tokenizer does not know."""
        return [self._backend.id_to_token(token_id) if token_id >= 0 else None for token_id in ids]

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self._backend.token_to_id(token)
        return token_id

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders `messages` ({"role": ..., "content": ...}, and tool calls and results) and `tools` (OpenAI's
        function definitions, as transformers passes them) with the model's chat template, as transformers does.
        `template_kwargs` are further variables for the template (vLLM's `chat_template_kwargs`, e.g. Qwen3's
        `enable_thinking`, and `reasoning_effort`); they cannot replace the variables above, which win.

        Raises RequestError when the model has no template or the template rejects the conversation (a template's
        `raise_exception("...")` message is passed on).
        """
        if self._template is None:
            raise RequestError(
                f"{self._source}: the model has no chat template ({TOKENIZER_CONFIG_FILE} chat_template or "
                f"{CHAT_TEMPLATE_FILE}); send a plain prompt to the completions API instead",
                code="chat_template_missing",
                param="messages",
            )
        try:
            variables: dict[str, Any] = dict(template_kwargs or {})
            variables.update(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                tools=[dict(tool) for tool in tools] if tools else None,
                documents=None,
                **self._special_tokens,
            )
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template rejected the messages: {exc.message}", param="messages") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # Template code is the model author's; whatever it trips over in these messages is the caller's to fix.
            raise RequestError(f"the chat template failed on the messages: {exc}", param="messages") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat: special tokens come from the template only, so BOS is never doubled."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def surely_longer_than(self, text: str, num_tokens: int) -> bool:
        """Whether `text` encodes to more than `num_tokens` tokens, told from its length alone (False when unsure).
        A cheap bound that lets a prompt far over the context be refused without tokenizing it, which for megabytes
        takes seconds."""
        return self.max_chars_per_token is not None and len(text) > num_tokens * self.max_chars_per_token

    def _token_id_of(self, token: str, field: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{self._source}: {TOKENIZER_CONFIG_FILE} {field} {token!r} is not in the vocabulary")
        result: int = token_id
        return result


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with it; here it only renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt; transformers overrides it the same way.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


# How many input characters one token may stand for at most, beyond its own text, when the tokenizer normalizes:
# Unicode composition folds up to three code points into one (Hangul jamo), so four is a safe margin.
_NORMALIZER_MARGIN = 4


def _max_chars_per_token(backend: BackendTokenizer, vocab_size: int) -> int | None:
    """The most input characters any one token covers, or None where no such bound holds.

    Each token of a BPE model covers the characters it decodes to, so the longest decoded token bounds them; an
    unknown-token run fused into one token (a BPE without byte fallback) or a WordPiece word too long for its
    vocabulary covers any number, so other models get no bound."""
    model = backend.model
    if type(model).__name__ != "BPE":
        return None
    fused_unknowns = getattr(model, "unk_token", None) is not None and getattr(model, "fuse_unk", False)
    if fused_unknowns and not getattr(model, "byte_fallback", False):
        return None
    texts = backend.decode_batch([[token_id] for token_id in range(vocab_size)], skip_special_tokens=False)
    longest = max((len(text) for text in texts), default=1)
    return max(longest, 1) * (_NORMALIZER_MARGIN if backend.normalizer is not None else 1)


def _compile_chat_template(source: str, where: str) -> jinja2.Template:
    # Same environment as transformers' (chat templates are untrusted code: the sandbox forbids attribute tricks
    # and mutating the inputs), so a template renders here exactly as it does there.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(
            f"{where}: the chat template does not compile (line {exc.lineno}): {exc.message}"
        ) from exc


# generation_config.json's sampling fields that a request inherits when it leaves them out, as vLLM's default
# `--generation-config auto` does (Qwen3 ships temperature 0.6, top_p 0.95, top_k 20): (lowest, highest) allowed.
SAMPLING_DEFAULT_FIELDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, float("inf")),
    "top_p": (0.0, 1.0),
    "top_k": (-1, float("inf")),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, float("inf")),
}


def _sampling_defaults(generation_config: Mapping[str, Any], path: Path) -> dict[str, float]:
    """The sampling fields generation_config.json sets, checked. `do_sample` is not read, as vLLM does not: a
    request's temperature decides."""
    defaults: dict[str, float] = {}
    for name, (lowest, highest) in SAMPLING_DEFAULT_FIELDS.items():
        value = generation_config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not lowest <= value <= highest:
            raise CheckpointError(f"{path}: field {name!r} must be a number in [{lowest}, {highest}], got {value!r}")
        defaults[name] = int(value) if name == "top_k" else float(value)
    return defaults


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the (optional) file is missing."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    template_file = folder / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        try:
            return template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{template_file}: not readable: {exc}") from exc
    where = f"{folder / TOKENIZER_CONFIG_FILE}: chat_template"
    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named: dict[str, str] = {}
        for entry in value:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise CheckpointError(f"{where} list entries must be {{name, template}} strings")
            named[entry["name"]] = entry["template"]
        if "default" in named:
            return named["default"]
        # Named-only templates (tool_use, rag, ...) need a caller who picks one; chat requests use the default.
        logger.warning("%s has no template named 'default' (only %s); chat is disabled", where, sorted(named))
        return None
    raise CheckpointError(f"{where} must be a string or a list of {{name, template}}")


def _token_content(value: Any, path: Path, field: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    raise CheckpointError(f"{path}: {field} must be a string or an object with a string 'content'")


def _token_ids(value: Any, path: Path, field: str) -> list[int]:
    """A token id field as config files write it: null, an int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for item in values:
        # bool is an int subclass, and `true` is never meant as token id 1.
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise CheckpointError(f"{path}: {field} must be a non-negative integer or a list of them, got {value!r}")
    return list(values)
