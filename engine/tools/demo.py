"""Small random Llama-family checkpoints, written from scratch in Hugging Face's on-disk format.

They serve the embedded demo (`make dev`), benchmarks, and tests that compare the engine with transformers. Only
torch, safetensors and tokenizers are used, never transformers: product code must not depend on it. The tokenizer
is a byte-level BPE trained in well under a second on demo_corpus.txt (plain English shipped with the package).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

Architecture = Literal["llama", "mistral", "qwen2"]
DType = Literal["float32", "bfloat16", "float16"]

# Vocabulary tokens, not secrets (ruff's S105 reads "TOKEN" as a password).
BOS_TOKEN = "<|begin_of_text|>"  # noqa: S105
END_OF_TEXT_TOKEN = "<|end_of_text|>"  # noqa: S105
IM_START_TOKEN = "<|im_start|>"  # noqa: S105
IM_END_TOKEN = "<|im_end|>"  # noqa: S105
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# The byte alphabet must fit next to the special tokens, or some byte could not be encoded at all.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CORPUS_FILE = "demo_corpus.txt"

# ChatML, opened with BOS as Llama 3's template does: the rendered prompt carries every special token, so it is
# encoded with add_special_tokens=False. Unknown roles are refused the way real templates refuse them.
# `enable_thinking` set to false (Qwen3's variable) puts an empty, closed think block after the generation prompt, so
# a model that thinks first (the demo's `think` adapter) answers directly; unset or true, nothing is added.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role'] + '; expected system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

_ARCHITECTURE_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class RandomModelSpec:
    """The shape of a random checkpoint; field names and meanings are those of transformers' config.json.

    attention_bias: q/k/v projections carry a bias. Qwen2 always has one (its config has no such field), Llama and
    Mistral never do here (Llama's flag would also bias o_proj, which no real checkpoint of the family uses).
    init_std: every weight and bias is drawn from normal(0, init_std); norm weights are 1.0.
    """

    architecture: Architecture = "llama"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 704
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # a dict cannot be hashed
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    torch_dtype: DType = "float32"
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURE_CLASSES:
            raise ValueError(f"architecture must be one of {sorted(_ARCHITECTURE_CLASSES)}, got {self.architecture!r}")
        if self.torch_dtype not in _TORCH_DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(_TORCH_DTYPES)}, got {self.torch_dtype!r}")
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be at least {MIN_VOCAB_SIZE} (bytes + special tokens), got {self.vocab_size}"
            )
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases: set attention_bias=True")
        if self.architecture != "qwen2" and self.attention_bias:
            raise ValueError(f"{self.architecture} checkpoints have no attention biases: set attention_bias=False")
        if self.rms_norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps, init_std and rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_parameters(self) -> int:
        """Parameters in model.safetensors (the tied lm_head counted once)."""
        kv_size = self.num_key_value_heads * self.head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv_size
        if self.attention_bias:
            attention += self.hidden_size + 2 * kv_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * per_layer + self.hidden_size


# Tiny and quick on a CPU: the model `make dev` serves. The demo tokenizer fills its whole vocab (the corpus allows
# up to 2,228 ids), so every id the model can sample decodes to text.
DEMO_SPEC = RandomModelSpec()

# About 56M parameters (bf16: about 110 MB): big enough that a benchmark measures the engine, not Python overhead.
BENCHMARK_SPEC = RandomModelSpec(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)


def write_random_model(path: str | os.PathLike[str], spec: RandomModelSpec = DEMO_SPEC) -> Path:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer files into `path`.

    The same spec always gives the same bytes. The tokenizer is trained for spec.vocab_size ids but stops where the
    corpus runs out of merges (2,228 ids), so a larger model vocab has padding rows no text maps to.
    Files already in `path` with the same names are replaced.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    backend = _write_tokenizer(
        folder,
        vocab_size=spec.vocab_size,
        chat_template=DEFAULT_CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    bos_id = _special_id(backend, BOS_TOKEN)
    end_of_text_id = _special_id(backend, END_OF_TEXT_TOKEN)
    im_end_id = _special_id(backend, IM_END_TOKEN)

    _write_json(folder / "config.json", _model_config(spec, bos_token_id=bos_id, eos_token_id=end_of_text_id))
    # A chat model stops at the end of its turn as well as at the end of the text, as Llama 3 Instruct does.
    _write_json(
        folder / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": [end_of_text_id, im_end_id]}
    )
    save_file(_random_weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote a random %s model (%d parameters) to %s", spec.architecture, spec.num_parameters, folder)
    return folder


def write_tokenizer(
    path: str | os.PathLike[str],
    *,
    vocab_size: int,
    chat_template: str = DEFAULT_CHAT_TEMPLATE,
    model_max_length: int | None = None,
) -> Path:
    """Trains the demo byte-level BPE (at most `vocab_size` ids) and writes tokenizer.json and tokenizer_config.json.

    Ids 0-3 are the special tokens <|begin_of_text|>, <|end_of_text|>, <|im_start|>, <|im_end|>; BOS is added by
    tokenizer.json's post-processor (Llama 3 style) and eos_token is <|im_end|>.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(folder, vocab_size=vocab_size, chat_template=chat_template, model_max_length=model_max_length)
    return folder


def train_demo_tokenizer(vocab_size: int) -> BackendTokenizer:
    """The demo byte-level BPE trained on demo_corpus.txt; deterministic, and well under a second."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (bytes + special tokens), got {vocab_size}")
    corpus = resources.files("loraplex.engine.tools").joinpath(CORPUS_FILE).read_text(encoding="utf-8")
    backend = BackendTokenizer(models.BPE())
    # GPT-2's byte-level scheme: every byte sequence is encodable, and a token may hold part of a character.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Paragraphs, not lines, so that newlines take part in merges as they do in chat text.
    backend.train_from_iterator(corpus.split("\n\n"), trainer=trainer)
    bos_id = _special_id(backend, BOS_TOKEN)
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
            ),
        ]
    )
    return backend


def _write_tokenizer(
    folder: Path, *, vocab_size: int, chat_template: str, model_max_length: int | None = None
) -> BackendTokenizer:
    backend = train_demo_tokenizer(vocab_size)
    backend.save(str(folder / "tokenizer.json"))
    added_tokens = backend.get_added_tokens_decoder()
    config: dict[str, Any] = {
        # Explicit, so that transformers rebuilds the same BOS-adding post-processor the file already has.
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token.content,
                "lstrip": token.lstrip,
                "normalized": token.normalized,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
                "special": token.special,
            }
            for token_id, token in sorted(added_tokens.items())
        },
        "bos_token": BOS_TOKEN,
        "chat_template": chat_template,
        # Cleanup rewrites " ." as "." after decoding, which would make streamed and whole decodes disagree.
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END_TOKEN,
        "pad_token": END_OF_TEXT_TOKEN,
        # The generic fast tokenizer: a model-specific class (chosen from config.json's model_type otherwise) could
        # rebuild the pipeline from the vocab with its own pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    _write_json(folder / "tokenizer_config.json", config)
    return backend


def _special_id(backend: BackendTokenizer, token: str) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"the demo tokenizer lost its special token {token}")
    result: int = token_id
    return result


def _model_config(spec: RandomModelSpec, *, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
    """config.json as transformers 4.4x writes it on save_pretrained (the field names real checkpoints carry).

    transformers 5 writes `rope_parameters` and `dtype` instead, and still reads these.
    """
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURE_CLASSES[spec.architecture]],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type": spec.architecture,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": spec.rope_scaling,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.torch_dtype,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if spec.architecture == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif spec.architecture == "mistral":
        # Mistral 7B v0.1's 4096-token sliding window, as it ships: its pages behind the window go back to the pool.
        config.update(sliding_window=4096)
    else:
        config.update(max_window_layers=spec.num_hidden_layers, sliding_window=None, use_sliding_window=False)
    return dict(sorted(config.items()))


def _random_weights(spec: RandomModelSpec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = _TORCH_DTYPES[spec.torch_dtype]

    def normal(*shape: int) -> torch.Tensor:
        # Drawn in float32 then cast, so a spec gives the same values whatever the storage dtype.
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, spec.init_std, generator=generator).to(dtype)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=dtype)

    hidden, kv_size = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(spec.vocab_size, hidden)}
    for i in range(spec.num_hidden_layers):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.self_attn.q_proj.weight"] = normal(hidden, hidden)
        tensors[f"{layer}.self_attn.k_proj.weight"] = normal(kv_size, hidden)
        tensors[f"{layer}.self_attn.v_proj.weight"] = normal(kv_size, hidden)
        tensors[f"{layer}.self_attn.o_proj.weight"] = normal(hidden, hidden)
        if spec.attention_bias:
            # Random rather than zero (HF's init), so a loader that drops the biases is caught by comparisons.
            tensors[f"{layer}.self_attn.q_proj.bias"] = normal(hidden)
            tensors[f"{layer}.self_attn.k_proj.bias"] = normal(kv_size)
            tensors[f"{layer}.self_attn.v_proj.bias"] = normal(kv_size)
        tensors[f"{layer}.mlp.gate_proj.weight"] = normal(spec.intermediate_size, hidden)
        tensors[f"{layer}.mlp.up_proj.weight"] = normal(spec.intermediate_size, hidden)
        tensors[f"{layer}.mlp.down_proj.weight"] = normal(hidden, spec.intermediate_size)
        tensors[f"{layer}.input_layernorm.weight"] = ones(hidden)
        tensors[f"{layer}.post_attention_layernorm.weight"] = ones(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(spec.vocab_size, hidden)
    return tensors


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
