"""Gemma 2 and Gemma 3 (text): RMSNorm weights as offsets from 1 applied in float32, embeddings scaled by
sqrt(hidden), a GELU-tanh gated MLP, norms before and after both attention and MLP, a softmax scale of
query_pre_attn_scalar ** -0.5, sliding-window layers interleaved with global ones (`layer_types`), tied embeddings.
Gemma 2 soft-caps attention scores and the final logits; Gemma 3 normalizes q and k per head and gives its sliding
layers a RoPE base of their own (`rope_local_base_freq`), its global ones the checkpoint's rope scaling."""

from __future__ import annotations

import math
from typing import Any

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.config_fields import ConfigFields
from loraplex.engine.model.registry import Family

_GEMMA3_GLOBAL_THETA = 1_000_000.0
_GEMMA3_LOCAL_THETA = 10_000.0


def read(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    label, num_layers, hidden = common["architecture"], common["num_layers"], common["hidden_size"]
    fields.refuse_if_set("use_bidirectional_attention", "bidirectional attention (an encoder such as EmbeddingGemma)")
    gemma2 = label == "gemma2"
    pattern = 2 if gemma2 else fields.positive_int("sliding_window_pattern", default=6)
    window = fields.optional_positive_int("sliding_window")
    sliding = fields.layer_sliding(num_layers, [bool((i + 1) % pattern) for i in range(num_layers)])
    out: dict[str, Any] = {
        "hidden_act": fields.activation("hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        "norm_kind": "gemma",
        "sandwich_norms": True,
        "qk_norm": not gemma2,
        "embed_scale": math.sqrt(hidden),
        "query_scale": fields.positive_float("query_pre_attn_scalar", default=256) ** -0.5,
        "attn_softcap": _softcap(fields, "attn_logit_softcapping", 50.0 if gemma2 else None),
        "final_softcap": _softcap(fields, "final_logit_softcapping", 30.0 if gemma2 else None),
        "tie_word_embeddings": fields.flag("tie_word_embeddings", default=True),
        "sliding_window": window if any(sliding) else None,
        "layer_sliding": sliding if window is not None and any(sliding) else (),
    }
    if not gemma2:
        out.update(_gemma3_ropes(fields, common["head_dim"]))
    return out


def _softcap(fields: ConfigFields, name: str, default: float | None) -> float | None:
    if name not in fields.raw:
        return default
    return fields.optional_positive_float(name)


def _gemma3_ropes(fields: ConfigFields, head_dim: int) -> dict[str, Any]:
    """The global and local RoPE: transformers 5 writes them per layer type in `rope_parameters`; 4.x wrote
    rope_theta (global), rope_local_base_freq (local) and rope_scaling (global only)."""
    parameters = fields.get("rope_parameters")
    if isinstance(parameters, dict) and ("full_attention" in parameters or "sliding_attention" in parameters):
        full, local = parameters.get("full_attention") or {}, parameters.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise CheckpointError("config.json field 'rope_parameters' must map layer types to objects")
        return {
            "rope": fields.rope(head_dim, theta=full.get("rope_theta", _GEMMA3_GLOBAL_THETA), parameters=full),
            "local_rope": fields.rope(head_dim, theta=local.get("rope_theta", _GEMMA3_LOCAL_THETA), parameters=local),
        }
    global_parameters = fields.rope_parameters()
    return {
        "rope": fields.rope(
            head_dim, theta=global_parameters.get("rope_theta") or fields.get("rope_theta") or _GEMMA3_GLOBAL_THETA
        ),
        "local_rope": fields.rope(
            head_dim, theta=fields.get("rope_local_base_freq") or _GEMMA3_LOCAL_THETA, parameters={}
        ),
    }


FAMILY = Family(
    name="gemma",
    architectures={"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"},
    headless={"Gemma2Model": "gemma2", "Gemma3TextModel": "gemma3"},
    read=read,
    refused={
        "Gemma3ForConditionalGeneration": (
            "a vision-language checkpoint (a SigLIP vision tower beside the language model); loraplex serves text "
            "models: give a Gemma3ForCausalLM checkpoint (the text-only 1B, or the language model saved alone)"
        ),
    },
)
