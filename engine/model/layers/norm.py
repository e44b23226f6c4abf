"""RMSNorm as the families compute it.

Llama, Qwen and Phi scale by the weight after casting back to the activations' dtype (`w * norm(x).to(dtype)`); Gemma
stores `w` as an offset from one and multiplies in float32 before the cast (`(norm(x.float()) * (1 + w)).to(dtype)`).
The decoder keeps Gemma's weights as `1 + w` in float32 (`gemma_weight`), so both are one multiplication here.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

NormKind = Literal["llama", "gemma"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: NormKind = "llama") -> torch.Tensor:
    """x [..., dim] normalized over its last dimension and scaled by `weight` [dim], in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel; same arithmetic in float32
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "gemma":
        return (x32 * weight.float()).to(x.dtype)
    # Half types: computed in float32 and cast back before the weight, exactly as transformers does.
    return weight * x32.to(x.dtype)


def gemma_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's checkpoint weight `w` as the multiplier rms_norm takes: `1 + w`, in float32."""
    return 1.0 + weight.float()
