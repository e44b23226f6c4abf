"""Rotary position embeddings as transformers computes them: the default frequencies, Llama 3's frequency-dependent
scaling, linear interpolation (Gemma 3's global layers), YaRN (Qwen3's long context), LongRoPE (Phi-3 / Phi-4, short and
long factors), and partial rotary (only the first `rotary_dim` dimensions of a head rotate).

Every variant ends as a table of unit complex numbers per position (times an attention factor where the variant scales
cos and sin), applied to a head's rotary pairs by one complex multiplication. The engine stores q and k with each
rotary pair side by side (`interleave_rotary_rows`), which is what makes the multiplication a plain view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Llama3Scaling:
    """rope_type "llama3": low frequencies divided by `factor`, high ones kept, a smooth ramp between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class LinearScaling:
    """rope_type "linear": every frequency divided by `factor` (position interpolation)."""

    factor: float


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """rope_type "yarn" (Peng et al. 2023): interpolated and extrapolated frequencies blended by a ramp between the
    dimensions that rotate `beta_fast` and `beta_slow` times over the original context; cos and sin scaled by
    `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float
    truncate: bool


@dataclass(frozen=True, slots=True)
class LongRopeScaling:
    """rope_type "longrope" (Phi-3, Phi-4): each frequency divided by a per-dimension factor, `short_factor` for
    sequences within `original_max_position_embeddings`, `long_factor` beyond; cos and sin scaled by
    `attention_factor`. Which set a sequence uses is fixed per sequence (decision 0045)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


RopeScaling = Llama3Scaling | LinearScaling | YarnScaling | LongRopeScaling


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One rotary embedding: base `theta`, an optional scaling, and how many leading dimensions of a head rotate."""

    theta: float
    scaling: RopeScaling | None
    rotary_dim: int  # even, <= head_dim; head_dim unless the config sets partial_rotary_factor

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (1 except for YaRN and LongRoPE)."""
        if isinstance(self.scaling, YarnScaling | LongRopeScaling):
            return self.scaling.attention_factor
        return 1.0

    @property
    def has_long_factors(self) -> bool:
        """Whether sequences past the original context take other frequencies (LongRoPE)."""
        return isinstance(self.scaling, LongRopeScaling)


def _default_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inverse_frequencies(rope: RopeConfig, *, long: bool = False) -> torch.Tensor:
    """[rotary_dim / 2] float32, as transformers computes them; `long`: LongRoPE's long factors."""
    dim, scaling = rope.rotary_dim, rope.scaling
    inv_freq = _default_frequencies(dim, rope.theta)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, Llama3Scaling):
        return _llama3(inv_freq, scaling)
    if isinstance(scaling, YarnScaling):
        return _yarn(dim, rope.theta, scaling)
    factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
    return 1.0 / (factors * rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, scaling: YarnScaling) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ramp  # the share of each dimension that extrapolates
    return interpolation * (1 - keep) + extrapolation * keep


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The row order within one head that puts each rotary pair (j, j + rotary_dim / 2) side by side, for the first
    rotary_dim dimensions; the dimensions past rotary_dim (partial rotary) keep their places."""
    half = rotary_dim // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).reshape(-1)
    return torch.cat([pairs, torch.arange(rotary_dim, head_dim)])


def interleave_rotary_rows(
    weight: torch.Tensor, num_heads: int, head_dim: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """Reorder the output rows of a q or k projection (or its bias, or a per-head norm weight with num_heads=1) so
    each rotary pair sits side by side.

    Transformers rotates dimension j of a head with dimension j + rotary_dim / 2. Moving the pairs next to each other
    turns the rotation into one complex multiplication, far cheaper on a CPU than the half-split form (0019).
    Attention scores are unchanged, because q and k get the same order and q . k does not depend on it. Anything
    else that writes into these rows (LoRA B matrices, q/k norms' weights) must be reordered the same way.
    """
    order = rotary_order(head_dim, head_dim if rotary_dim is None else rotary_dim)
    rows = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return rows[:, order.to(weight.device)].reshape(weight.shape)


class RotaryEmbedding:
    """Rotations for every position up to `max_positions`, as complex numbers, looked up per token.

    With LongRoPE the table holds the short factors' rotations for positions [0, max_positions) and the long factors'
    for [max_positions, 2 * max_positions): a token of a sequence that takes the long factors looks up its position
    plus max_positions (`ForwardBatch.rope_positions`)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, *, device: torch.device) -> None:
        self.rotary_dim = rope.rotary_dim
        self.head_dim = head_dim
        self.max_positions = max_positions
        positions = torch.arange(max_positions, dtype=torch.float32)
        tables = [inverse_frequencies(rope)]
        if rope.has_long_factors:
            tables.append(inverse_frequencies(rope, long=True))
        angles = torch.cat([torch.outer(positions, inv_freq) for inv_freq in tables])
        # transformers computes cos and sin in float32 and multiplies by the factor before any cast.
        cis = torch.polar(torch.full_like(angles, rope.attention_factor), angles)
        self.cis = cis.to(device)  # [max_positions (x2 with long factors), rotary_dim / 2]

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations for these positions, [num_tokens, 1, rotary_dim / 2], broadcasting over heads."""
        return self.cis[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim] with rotary pairs interleaved -> rotated copy, x's dtype."""
        if self.rotary_dim == self.head_dim:
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * cis).flatten(-2).to(x.dtype)
        rotated = x[..., : self.rotary_dim]
        pairs = torch.view_as_complex(rotated.float().reshape(*x.shape[:-1], -1, 2))
        out = x.clone()
        out[..., : self.rotary_dim] = torch.view_as_real(pairs * cis).flatten(-2).to(x.dtype)
        return out
