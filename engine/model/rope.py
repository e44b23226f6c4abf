"""Rotary position embeddings as Llama computes them (non-interleaved halves), with Llama 3's frequency scaling."""

from __future__ import annotations

import math

import torch

from loraplex.engine.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32, as transformers computes them (llama3 scaling included)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def interleave_rotary_rows(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection (or its bias) so each rotary pair sits side by side.

    Llama rotates dimension j of a head with dimension j + head_dim / 2. Moving the pairs next to each other
    turns the rotation into one complex multiplication, far cheaper on a CPU than the half-split form (0019).
    Attention scores are unchanged, because q and k get the same order and q . k does not depend on it. Anything
    else that writes into these rows (LoRA B matrices) must be reordered the same way.
    """
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).reshape(-1)
    rows = weight.view(num_heads, head_dim, *weight.shape[1:])
    return rows[:, order].reshape(weight.shape)


class RotaryEmbedding:
    """Rotations for every position up to `max_positions`, as complex numbers, looked up per token."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        *,
        device: torch.device,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cis = torch.polar(torch.ones_like(angles), angles).to(device)  # [max_positions, head_dim / 2]

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations for these positions, [num_tokens, 1, head_dim / 2], broadcasting over heads."""
        return self.cis[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim] with rotary pairs interleaved -> rotated copy, x's dtype."""
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * cis).flatten(-2).to(x.dtype)
