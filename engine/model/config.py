"""What the engine needs to know about a checkpoint, read from its config.json and checked before any weight loads."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.prequantized import PrequantizedFormat, read_prequantized_format

# The Llama family: same block structure (RMSNorm, RoPE, GQA attention, SwiGLU MLP); Qwen2 adds q/k/v biases.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (rope_type "llama3"); other kinds are refused at load."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # llama | mistral | qwen2
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    torch_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    # GPTQ / AWQ 4-bit layers (engine/model/prequantized.py); None for a 16/32-bit checkpoint.
    prequantized: PrequantizedFormat | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        config_path = path / "config.json"
        try:
            found = config_path.is_file()
        except (OSError, ValueError) as exc:  # a name longer than the filesystem allows, a NUL byte
            reason = getattr(exc, "strerror", None) or exc
            raise CheckpointError(f"{str(path)[:200]!r} is not a usable path: {reason}") from None
        if not found:
            raise CheckpointError(f"{path} has no config.json: not a Hugging Face model folder")
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"config.json in {path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise CheckpointError("config.json must hold a JSON object")
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path | None = None) -> ModelConfig:
        """The config from config.json's fields; `path` (the model folder) is where an older GPTQ checkpoint keeps
        its quantize_config.json."""
        architectures = raw.get("architectures") or []
        known = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not known:
            shown = ", ".join(map(str, architectures)) or f"model_type {raw.get('model_type')!r}"
            raise CheckpointError(
                f"config.json field 'architectures' is {shown}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = SUPPORTED_ARCHITECTURES[known[0]]

        hidden_size = _positive_int(raw, "hidden_size")
        num_heads = _positive_int(raw, "num_attention_heads")
        num_kv_heads = _positive_int(raw, "num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise CheckpointError("config.json field 'head_dim' must be a positive even integer")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"config.json field 'hidden_act' is {raw.get('hidden_act')!r}; only 'silu' is supported"
            )
        if raw.get("mlp_bias"):
            raise CheckpointError("config.json field 'mlp_bias' is true; MLP biases are not supported")

        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype_name not in DTYPES:
            raise CheckpointError(f"config.json field 'torch_dtype' is {dtype_name!r}; supported: {', '.join(DTYPES)}")

        attention_bias = bool(raw.get("attention_bias", architecture == "qwen2"))
        # transformers 5 writes rope_theta and the scaling together as rope_parameters; 4.x wrote them apart.
        rope_parameters = raw.get("rope_parameters") or {}
        if not isinstance(rope_parameters, dict):
            raise CheckpointError("config.json field 'rope_parameters' must be an object")
        sliding_window = raw.get("sliding_window") if raw.get("use_sliding_window", architecture == "mistral") else None
        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            num_layers=_positive_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            vocab_size=_positive_int(raw, "vocab_size"),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", default=2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0),
            rope_scaling=_rope_scaling(raw["rope_scaling"] if raw.get("rope_scaling") else rope_parameters or None),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=int(sliding_window) if isinstance(sliding_window, int) else None,
            torch_dtype=DTYPES[dtype_name],
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            prequantized=read_prequantized_format(path, raw),
        )

    def num_parameters(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size


def _positive_int(raw: dict[str, Any], name: str, *, default: int | None = None) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"config.json field '{name}' must be a positive integer, got {value!r}")
    return value


def _token_ids(value: object) -> frozenset[int]:
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, int))
    return frozenset()


def _rope_scaling(value: object) -> RopeScaling | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CheckpointError("config.json field 'rope_scaling' must be an object or null")
    kind = value.get("rope_type", value.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise CheckpointError(f"config.json field 'rope_scaling' has type {kind!r}; only 'llama3' is supported")
    try:
        scaling = RopeScaling(
            factor=float(value["factor"]),
            low_freq_factor=float(value["low_freq_factor"]),
            high_freq_factor=float(value["high_freq_factor"]),
            original_max_position_embeddings=int(value["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json field 'rope_scaling' is missing or has a bad {exc}") from None
    if not (scaling.factor > 0 and math.isfinite(scaling.factor)):
        raise CheckpointError("config.json field 'rope_scaling.factor' must be positive")
    return scaling
