"""Phi-3, Phi-3.5 and Phi-4 (Phi3ForCausalLM): the Llama block with q/k/v fused into one `qkv_proj` and gate/up into
one `gate_up_proj` in the checkpoint (and so in peft's adapters), LongRoPE (short and long factors), partial rotary
where `partial_rotary_factor` says, and a sliding window over every layer where `sliding_window` is set."""

from __future__ import annotations

from typing import Any

from loraplex.engine.model.config_fields import ConfigFields
from loraplex.engine.model.registry import Family


def read(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"hidden_act": fields.activation("hidden_act"), "fused_projections": True}
    window = fields.optional_positive_int("sliding_window")
    if window is not None:
        out.update(sliding_window=window, layer_sliding=(True,) * common["num_layers"])
    parameters = fields.rope_parameters()
    if parameters.get("rope_type", parameters.get("type")) in ("su", "yarn"):
        parameters = {**parameters, "rope_type": "longrope"}  # Phi-3's older names for it, as transformers maps them
    out["rope"] = fields.rope(common["head_dim"], parameters=parameters)
    return out


FAMILY = Family(
    name="phi3",
    architectures={"Phi3ForCausalLM": "phi3"},
    headless={"Phi3Model": "phi3"},
    read=read,
)
