"""Weight-only quantized linear layers for the shared base weights: int8 per output channel, int4 per group.

Formats (what is kept in memory; nothing dequantized is cached, so `nbytes()` is the whole cost):

    Int8Weight: qweight int8 [out, in], scales float32 [out]
        w[n, k] ~= qweight[n, k] * scales[n]                           (symmetric, scale = max|w[n, :]| / 127)
    Int4Weight: packed uint8 [out, in // 2], scales and zeros float32 [out, in // group_size]
        q[n, k] = (packed[n, k // 2] >> 4 * (k % 2)) & 0xF             (low nibble = even column, q in 0..15)
        w[n, k] ~= (q[n, k] - zeros[n, g]) * scales[n, g],  g = k // group_size   (asymmetric, RTN min/max)

Bytes against bf16 for a [1024, 512] matrix: int8 0.504 (scales included), int4 0.281 (group_size 128).

Semantics (the reference loop; every path computes it with a float32 accumulator):

    W = dequantize(w)                                                   # float32 [out, in]
    for t in range(num_tokens):
        for n in range(out_features):
            y[t, n] = sum(x[t, k] * W[n, k] for k in range(in_features)) + (bias[n] if bias is not None else 0)
    # y is [num_tokens, out_features] in x.dtype, rounded once

`int8_linear` and `int4_linear` dispatch: the Triton kernels for CUDA tensors, the torch paths otherwise. The
torch paths are what CPU serving runs (benchmarks/quant_cpu.py times them against the alternatives; decision
0019); they dequantize up to 2^19 weight elements at a time into a float32 buffer, which a caller should keep and
pass as `workspace` (one `torch.empty(workspace_elems(max in_features))` per process, not shared across threads):
a new 2 MiB buffer per call can cost page faults that take longer than the matmul.

Layout: this module is the entry point (the semantics above, the dispatch, and the names callers import). Each
op keeps its Triton kernel, launcher and torch path in one module, kernels/quant_int8.py and kernels/quant_int4.py;
the formats, quantizers, dequantizers and shared checks are in kernels/quant_formats.py.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from loraplex.kernels import native
from loraplex.kernels.quant_formats import (
    GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    workspace_elems,
)
from loraplex.kernels.quant_int4 import int4_linear_dynamic, int4_linear_torch, int4_linear_triton, requantize_int4_rows
from loraplex.kernels.quant_int8 import int8_linear_dynamic, int8_linear_torch, int8_linear_triton

__all__ = [
    "GROUP_SIZE",
    "Int4Weight",
    "Int8Weight",
    "dequantize_int4",
    "dequantize_int8",
    "int4_linear",
    "int4_linear_dynamic",
    "int4_linear_torch",
    "int4_linear_triton",
    "int8_activations",
    "int8_linear",
    "int8_linear_dynamic",
    "int8_linear_torch",
    "int8_linear_triton",
    "pack_int4",
    "quantize_int4",
    "quantize_int8",
    "requantize_int4_rows",
    "unpack_int4",
    "workspace_elems",
]


@cache
def int8_activations() -> bool:
    """Whether CPU int8 and int4 matmuls quantize their activations too (`int8_linear_dynamic`,
    `int4_linear_dynamic`): where the CPU multiplies
    int8 natively (AVX-512 VNNI or AMX) unless LORAPLEX_INT8_ACTIVATIONS=0; LORAPLEX_INT8_ACTIVATIONS=1 forces it
    (slow without those instructions; for tests). Decided once per process (decision 0039)."""
    configured = os.environ.get("LORAPLEX_INT8_ACTIVATIONS", "auto")
    if configured in ("0", "1"):
        return configured == "1"
    return bool(torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported())


def int8_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int8Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    workspace: torch.Tensor | None = None,  # float32, >= workspace_elems(in_features); CPU path only
    dynamic: bool | None = None,  # CPU only: 8-bit activations; None decides by int8_activations()
    residual: torch.Tensor | None = None,  # [num_tokens, out_features], added to the product (not written)
) -> torch.Tensor:
    """x @ dequantize_int8(w)^T (+ bias) (+ residual), a new [num_tokens, out_features] tensor in x.dtype; see the
    module docstring. On the CPU with `dynamic` (by default where int8_activations() holds) x is rounded to 8 bits
    per row first (int8_linear_dynamic)."""
    if not x.is_cuda and (int8_activations() if dynamic is None else dynamic):
        return int8_linear_dynamic(x, w, bias, residual=residual, native=native.load())
    y = int8_linear_triton(x, w, bias) if x.is_cuda else int8_linear_torch(x, w, bias, workspace=workspace)
    return y if residual is None else y.add_(residual)


def int4_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int4Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    workspace: torch.Tensor | None = None,  # float32, >= workspace_elems(in_features); CPU path only
    dynamic: bool | None = None,  # CPU only: 8-bit activations; None decides by int8_activations()
    residual: torch.Tensor | None = None,  # [num_tokens, out_features], added to the product (not written)
) -> torch.Tensor:
    """x @ dequantize_int4(w)^T (+ bias) (+ residual), a new [num_tokens, out_features] tensor in x.dtype; see the
    module docstring. On the CPU with `dynamic` (by default where int8_activations() holds) x is rounded to 8 bits
    per row first and multiplied in integers (int4_linear_dynamic)."""
    if not x.is_cuda and (int8_activations() if dynamic is None else dynamic):
        return int4_linear_dynamic(x, w, bias, residual=residual, native=native.load())
    y = int4_linear_triton(x, w, bias) if x.is_cuda else int4_linear_torch(x, w, bias, workspace=workspace)
    return y if residual is None else y.add_(residual)
