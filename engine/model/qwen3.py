"""Qwen3: the Llama block with a per-head RMSNorm on q and k before RoPE, a head_dim of its own (not hidden /
heads), no attention biases by default; sliding layers as Qwen2 has them. Qwen3-Embedding checkpoints are this
family saved headless."""

from __future__ import annotations

from typing import Any

from loraplex.engine.model.config_fields import ConfigFields
from loraplex.engine.model.llama import sliding_layers
from loraplex.engine.model.registry import Family


def read(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": fields.activation("hidden_act"),
        "qk_norm": True,
        **sliding_layers(fields, common["architecture"], common["num_layers"]),
    }


FAMILY = Family(
    name="qwen3",
    architectures={"Qwen3ForCausalLM": "qwen3"},
    headless={"Qwen3Model": "qwen3"},
    read=read,
)
