"""Mixture-of-experts bases (issue 38): Mixtral (Mistral's block with a sparse MoE MLP in every layer, top-2 of 8
renormalized), Qwen3-MoE (Qwen3's block; sparse layers every `decoder_sparse_step` but those of `mlp_only_layers`,
which keep a dense MLP of `intermediate_size`; experts of `moe_intermediate_size`; the top-k renormalized where
`norm_topk_prob`) and Qwen2-MoE (Qwen2's block, q/k/v biases where `qkv_bias`, the same sparse layers, and in each a
shared expert of `shared_expert_intermediate_size` behind a sigmoid gate). The experts are computed by
engine/model/layers/moe.py.

transformers writes each expert as its own modules (`mlp.experts.N.gate_proj` ..., Mixtral's
`block_sparse_moe.experts.N.w1/w3/w2`) and holds them fused in memory (`mlp.experts.gate_up_proj` [experts,
2 * intermediate, hidden], `mlp.experts.down_proj` [experts, hidden, intermediate]); checkpoints of either layout load
(engine/model/decoder_weights.py). gpt-oss is not served yet.
"""

from __future__ import annotations

from typing import Any

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.config_fields import ConfigFields
from loraplex.engine.model.layers.moe import MoeConfig
from loraplex.engine.model.llama import sliding_layers
from loraplex.engine.model.registry import Family


def _num_experts(fields: ConfigFields) -> int:
    # transformers 5 writes `num_local_experts` for both (Qwen3-MoE maps its `num_experts` onto it); older ones
    # wrote Qwen3-MoE's as `num_experts`.
    name = "num_local_experts" if fields.get("num_local_experts") is not None else "num_experts"
    return fields.positive_int(name)


def _silu(fields: ConfigFields) -> str:
    activation = fields.activation("hidden_act")
    if activation != "silu":
        raise CheckpointError(f"config.json field 'hidden_act' is {activation!r}: MoE experts compute SiLU only")
    return activation


def _top_k(fields: ConfigFields, num_experts: int) -> int:
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise CheckpointError(
            f"config.json field 'num_experts_per_tok' ({top_k}) is more than the model's {num_experts} experts"
        )
    return top_k


def read_mixtral(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    num_experts = _num_experts(fields)
    num_layers = common["num_layers"]
    return {
        "hidden_act": _silu(fields),
        "moe": MoeConfig(
            num_experts=num_experts,
            top_k=_top_k(fields, num_experts),
            intermediate_size=common["intermediate_size"],
            normalize_top_k=True,
            float32_weights=True,
            sparse_layers=(True,) * num_layers,
        ),
        **sliding_layers(fields, "mistral", num_layers),
    }


def _qwen_moe(fields: ConfigFields, common: dict[str, Any], *, shared: bool) -> MoeConfig:
    """The sparse block of Qwen2-MoE and Qwen3-MoE: sparse layers every `decoder_sparse_step` but those of
    `mlp_only_layers`; Qwen2-MoE's shared expert where `shared`."""
    num_experts = _num_experts(fields)
    num_layers = common["num_layers"]
    step = fields.positive_int("decoder_sparse_step", default=1)
    dense = fields.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise CheckpointError(f"config.json field 'mlp_only_layers' must list layer indices below {num_layers}")
    return MoeConfig(
        num_experts=num_experts,
        top_k=_top_k(fields, num_experts),
        intermediate_size=fields.positive_int("moe_intermediate_size"),
        normalize_top_k=fields.flag("norm_topk_prob"),
        float32_weights=False,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_intermediate_size=fields.positive_int("shared_expert_intermediate_size") if shared else 0,
    )


def read_qwen3_moe(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _silu(fields),
        "qk_norm": True,
        "moe": _qwen_moe(fields, common, shared=False),
        **sliding_layers(fields, common["architecture"], common["num_layers"]),
    }


def read_qwen2_moe(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _silu(fields),
        "attention_bias": fields.flag("qkv_bias", default=True),
        "moe": _qwen_moe(fields, common, shared=True),
        **sliding_layers(fields, common["architecture"], common["num_layers"]),
    }


MIXTRAL = Family(
    name="mixtral",
    architectures={"MixtralForCausalLM": "mixtral"},
    read=read_mixtral,
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures={"Qwen3MoeForCausalLM": "qwen3_moe"},
    read=read_qwen3_moe,
    refused={"GptOssForCausalLM": "gpt-oss is not supported yet (Mixtral, Qwen2-MoE and Qwen3-MoE are)"},
)

QWEN2_MOE = Family(
    name="qwen2_moe",
    architectures={"Qwen2MoeForCausalLM": "qwen2_moe"},
    read=read_qwen2_moe,
)
