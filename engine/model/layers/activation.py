"""The gated MLP's activation: `act(gate) * up`, over the fused [gate | up] projection output."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Activation = Literal["silu", "gelu_tanh"]

# config.json's names for each (hidden_act, or Gemma's hidden_activation).
ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def gated(gate_up: torch.Tensor, intermediate: int, activation: Activation) -> torch.Tensor:
    """act(gate_up[:, :intermediate]) * gate_up[:, intermediate:] -> [num_tokens, intermediate]."""
    gate = gate_up[:, :intermediate]
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    act.mul_(gate_up[:, intermediate:])  # in place: a fresh large tensor costs page faults
    return act
