"""The linear modules of a base model that a LoRA adapter may adapt, with their names and shapes.

Most families name seven projections per decoder layer (q/k/v/o, gate/up/down); Phi-3 fuses q/k/v into `qkv_proj`
and gate/up into `gate_up_proj` in its checkpoint, so peft's adapters on it name those four. A mixture-of-experts
layer's experts are two stacked parameters in transformers (`mlp.experts.gate_up_proj` [experts, 2 * intermediate,
hidden] and `mlp.experts.down_proj`), which peft adapts with `target_parameters`: one LoRA per expert of each.
"""

from __future__ import annotations

from loraplex.engine.model.config import ModelConfig

MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Every module name of any family, in one order (target_modules "all-linear" selects each family's own).
ALL_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)

# A sparse layer's expert parameters, as peft's target_parameters name them (under `mlp.`).
EXPERT_MODULES: tuple[str, ...] = ("experts.gate_up_proj", "experts.down_proj")

# Which block each module sits in, as transformers names it (model.layers.{i}.<block>.<module>).
BLOCK_OF: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
    "experts.gate_up_proj": "mlp",
    "experts.down_proj": "mlp",
}

# Modules of the model outside the decoder layers that PEFT can target; loraplex refuses adapters on them.
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")


def adaptable_modules(base: ModelConfig) -> tuple[str, ...]:
    """The module names of one decoder layer of `base`, in the order of the fused outputs they write."""
    return FUSED_MODULES if base.fused_projections else MODULES


def expert_modules(base: ModelConfig) -> tuple[str, ...]:
    """The expert parameters of a sparse layer of `base` (none for a dense base)."""
    return EXPERT_MODULES if base.moe is not None else ()


def module_key(layer: int, module: str) -> str:
    """The module's name in the transformers model, the key PEFT matches target_modules and patterns against."""
    return f"model.layers.{layer}.{BLOCK_OF[module]}.{module}"


def module_shape(base: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of the module's weight (of one expert's, for an expert parameter), so LoRA A is
    [rank, in] and B is [out, rank].

    Raises ValueError for a name `base` does not have.
    """
    shapes = {
        "q_proj": (base.hidden_size, base.q_size),
        "k_proj": (base.hidden_size, base.kv_size),
        "v_proj": (base.hidden_size, base.kv_size),
        "qkv_proj": (base.hidden_size, base.q_size + 2 * base.kv_size),
        "o_proj": (base.q_size, base.hidden_size),
        "gate_proj": (base.hidden_size, base.intermediate_size),
        "up_proj": (base.hidden_size, base.intermediate_size),
        "gate_up_proj": (base.hidden_size, 2 * base.intermediate_size),
        "down_proj": (base.intermediate_size, base.hidden_size),
    }
    if base.moe is not None:  # one expert's
        shapes["experts.gate_up_proj"] = (base.hidden_size, 2 * base.moe.intermediate_size)
        shapes["experts.down_proj"] = (base.moe.intermediate_size, base.hidden_size)
    modules = adaptable_modules(base) + expert_modules(base)
    if module not in modules:
        raise ValueError(f"unknown module {module!r}; LoRA modules of this model are {', '.join(modules)}")
    return shapes[module]
