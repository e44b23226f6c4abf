"""Tokenizers in each family's chat format, for the families' chat tests: the family's turn markers as special
tokens of their own, a chat template that writes turns as the family's does (our own templates, in the families'
formats: ChatML with Hermes tools and a think block for Qwen3, opened in the prompt as its thinking releases do;
start_of_turn / end_of_turn with a `model` role and the system text in the first user turn for Gemma; <|user|> ...
<|end|> for Phi-3/4), tokenizer_config.json's eos_token, and generation_config.json listing the end-of-turn token
beside it, as those checkpoints ship (where tokenizer_config names one end and generation_config the others)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from _support.checkpoints import VOCAB

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ first if loop.first else '' }}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Family:
    template: str
    special: tuple[str, ...]  # turn markers, special tokens of their own
    plain: tuple[str, ...]  # added tokens that are not special (they survive skip_special_tokens)
    end_of_turn: str  # listed in generation_config.json, not tokenizer_config.json's eos_token
    sampling: dict[str, float]  # generation_config.json's defaults


FAMILIES = {
    "qwen3": Family(
        QWEN3_TEMPLATE,
        (),
        ("<think>", "</think>", "<tool_call>", "</tool_call>"),
        "<|im_end|>",
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    ),
    "gemma3": Family(
        GEMMA_TEMPLATE, ("<start_of_turn>", "<end_of_turn>"), (), "<end_of_turn>", {"top_p": 0.95, "top_k": 64}
    ),
    "phi3": Family(PHI_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), (), "<|end|>", {}),
}


def write_family_tokenizer(path: Path, family: str) -> Family:
    """The demo tokenizer in `family`'s chat format, filling VOCAB ids; tokenizer_config's eos_token is the demo's
    <|end_of_text|> for Gemma and Phi (their <eos> and <|endoftext|>), <|im_end|>'s end-of-text twin for Qwen3."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as BackendTokenizer

    from loraplex.engine.tools.demo import write_tokenizer

    spec = FAMILIES[family]
    extra = len(spec.special) + len(spec.plain)
    write_tokenizer(path, vocab_size=VOCAB - extra, chat_template=spec.template)
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain])
    if backend.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the {family} tokenizer has {backend.get_vocab_size()} ids, not {VOCAB}")
    backend.save(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = "<|end_of_text|>"
    config_file.write_text(json.dumps(config, indent=2))
    ends = [backend.token_to_id("<|end_of_text|>"), backend.token_to_id(spec.end_of_turn)]
    generation = {"bos_token_id": 0, "eos_token_id": ends, **spec.sampling}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return spec
