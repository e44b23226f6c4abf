"""The Llama family: Llama 2/3, Mistral and Qwen2 (RMSNorm, RoPE, grouped-query attention, SwiGLU), read from their
config.json. Qwen2 adds q/k/v biases; Mistral and Qwen2 may slide a window over some layers."""

from __future__ import annotations

from typing import Any

from loraplex.engine.model.config_fields import ConfigFields
from loraplex.engine.model.registry import Family


def read(fields: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    label, num_layers = common["architecture"], common["num_layers"]
    out: dict[str, Any] = {"hidden_act": fields.activation("hidden_act")}
    if label == "qwen2":
        out["attention_bias"] = fields.flag("attention_bias", default=True)
    out.update(sliding_layers(fields, label, num_layers))
    return out


def sliding_layers(fields: ConfigFields, label: str, num_layers: int) -> dict[str, Any]:
    """Where transformers slides a window: every layer of a Mistral whose `sliding_window` is set; the layers from
    `max_window_layers` on of a Qwen2 or Qwen3 with `use_sliding_window` (or as `layer_types` says)."""
    if label == "llama":
        return {}
    if label == "mistral":
        window = fields.optional_positive_int("sliding_window")
        return {} if window is None else {"sliding_window": window, "layer_sliding": (True,) * num_layers}
    if not fields.flag("use_sliding_window"):
        return {}
    window = fields.optional_positive_int("sliding_window")
    if window is None:
        return {}
    first = fields.get("max_window_layers", num_layers)
    default = [i >= first for i in range(num_layers)]
    sliding = fields.layer_sliding(num_layers, default)
    return {"sliding_window": window, "layer_sliding": sliding} if any(sliding) else {}


FAMILY = Family(
    name="llama",
    architectures={"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"},
    headless={"LlamaModel": "llama", "MistralModel": "mistral", "Qwen2Model": "qwen2"},
    read=read,
)
