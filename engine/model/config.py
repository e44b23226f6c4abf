"""What the engine needs to know about a checkpoint, read from its config.json and checked before any weight loads.

The common fields (sizes, heads, RoPE, dtype, special ids) are read here; each family's variations (norms, softcaps,
sliding windows, fused projections) by its module through the registry (engine/model/registry.py), the one place an
architecture is accepted or refused. The defaults of the variation fields are Llama's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.config_fields import ConfigFields, token_ids
from loraplex.engine.model.fp8 import Fp8Format, read_fp8_format
from loraplex.engine.model.layers.activation import Activation
from loraplex.engine.model.layers.moe import MoeConfig
from loraplex.engine.model.layers.norm import NormKind
from loraplex.engine.model.layers.rope import RopeConfig
from loraplex.engine.model.prequantized import PrequantizedFormat, read_prequantized_format

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # the family's label: llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 | phi3 | <moe>
    # where <moe> is mixtral | qwen2_moe | qwen3_moe
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    # GPTQ / AWQ 4-bit layers (engine/model/prequantized.py); None for a 16/32-bit checkpoint.
    prequantized: PrequantizedFormat | None = None
    # FP8 weights as the checkpoint stores them (engine/model/fp8.py); None for any other checkpoint.
    fp8: Fp8Format | None = None
    # --- what the families vary (defaults: Llama) ---------------------------------------------------------------
    hidden_act: Activation = "silu"
    norm_kind: NormKind = "llama"  # gemma: weights are offsets from 1, applied in float32
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and MLP too, and a pre-MLP norm
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    query_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_sliding: tuple[bool, ...] = ()  # per layer, whether it slides (empty: none does)
    local_rope: RopeConfig | None = None  # the sliding layers' own RoPE (Gemma 3's rope_local_base_freq)
    fused_projections: bool = False  # Phi-3: the checkpoint (and LoRA) name qkv_proj and gate_up_proj
    # Mixture-of-experts bases (Mixtral, Qwen2-MoE, Qwen3-MoE): the experts, which layers are sparse; None if dense.
    moe: MoeConfig | None = None
    # The checkpoint was saved from the bare decoder (transformers' *Model, as sentence-transformers writes it): its
    # tensor names lack the "model." prefix and it has no lm_head of its own.
    headless: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to the whole context."""
        return self.sliding_window if self.layer_sliding and self.layer_sliding[layer] else None

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.layer_sliding)

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
        from loraplex.engine.model.registry import resolve  # the registry imports the families, which import this

        family, label, headless = resolve(raw)
        fields = ConfigFields(raw)
        hidden_size = fields.positive_int("hidden_size")
        num_heads = fields.positive_int("num_attention_heads")
        num_kv_heads = fields.positive_int("num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0 or head_dim % 2:
            raise CheckpointError("config.json field 'head_dim' must be a positive even integer")
        if raw.get("mlp_bias"):
            raise CheckpointError("config.json field 'mlp_bias' is true; MLP biases are not supported")
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype_name not in DTYPES:
            raise CheckpointError(f"config.json field 'torch_dtype' is {dtype_name!r}; supported: {', '.join(DTYPES)}")
        common: dict[str, Any] = {
            "architecture": label,
            "hidden_size": hidden_size,
            "num_layers": fields.positive_int("num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "intermediate_size": fields.positive_int("intermediate_size"),
            "vocab_size": fields.positive_int("vocab_size"),
            "max_position_embeddings": fields.positive_int("max_position_embeddings", default=2048),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": fields.flag("tie_word_embeddings"),
            "attention_bias": fields.flag("attention_bias"),
            "torch_dtype": DTYPES[dtype_name],
            "bos_token_id": raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            "eos_token_ids": token_ids(raw.get("eos_token_id")),
            "prequantized": read_prequantized_format(path, raw),
            "fp8": read_fp8_format(raw),
            "headless": headless,
        }
        common.update(family.read(fields, common))
        if "rope" not in common:
            common["rope"] = fields.rope(head_dim)
        config = cls(**common)
        config._check_windows()
        return config

    def _check_windows(self) -> None:
        if self.layer_sliding and len(self.layer_sliding) != self.num_layers:
            raise CheckpointError("config.json: one layer type per layer is needed")
        if self.has_sliding_layers and self.sliding_window is None:
            raise CheckpointError("config.json: 'layer_types' names sliding layers but 'sliding_window' is not set")

    def num_parameters(self) -> int:
        qk_norms = 2 * self.head_dim if self.qk_norm else 0
        norms = (4 if self.sandwich_norms else 2) * self.hidden_size
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size + norms + qk_norms
        )
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings or self.headless else 2)
        return (
            self.num_layers * per_layer
            + sum(map(self.mlp_parameters, range(self.num_layers)))
            + embeddings
            + (self.hidden_size)
        )

    def active_parameters(self) -> int:
        """The parameters one token runs: num_parameters() less the experts its router does not pick (a dense
        model's are all of them)."""
        skipped = sum(self.mlp_parameters(i) - self.mlp_parameters(i, active=True) for i in range(self.num_layers))
        return self.num_parameters() - skipped

    def mlp_parameters(self, layer: int, *, active: bool = False) -> int:
        """Parameters of a layer's MLP: the dense one's, or a sparse block's router and experts (`active`: the
        top-k experts a token runs, and the router)."""
        moe = self.moe
        if moe is None or not moe.is_sparse(layer):
            return 3 * self.hidden_size * self.intermediate_size
        experts = moe.top_k if active else moe.num_experts
        # Qwen2-MoE's shared expert runs for every token, behind a gate of one output.
        shared = (
            3 * self.hidden_size * moe.shared_intermediate_size + self.hidden_size
            if moe.shared_intermediate_size
            else 0
        )
        return moe.num_experts * self.hidden_size + experts * 3 * self.hidden_size * moe.intermediate_size + shared
