"""Linear layers over a weight that is either a plain tensor or a quantized one (kernels/quant.py).

The model's forward calls `linear` and `addmm` whatever its weights are; a plain tensor takes exactly the path it
took before quantization existed, so the unquantized engine is unchanged. On a CPU that path for float32 weights
is one of two libraries (`cpu_matmul`, docs/decisions/0055): oneDNN's linear on AMD x86 CPUs, where it runs the
engine's shapes 1.2-1.9x faster than MKL, and F.linear (MKL, or the BLAS torch has) elsewhere; `matmul_layout`
stores each weight in the layout its library runs fastest.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from loraplex.engine.model.quantization import QuantizationName
from loraplex.kernels.paths import cpu_matmul
from loraplex.kernels.quant import (
    GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    int4_linear,
    int8_linear,
    quantize_int4,
    quantize_int8,
    workspace_elems,
)
from loraplex.kernels.quant_fp8 import Fp8Weight, fp8_linear, quantize_fp8

QuantizedWeight = Int8Weight | Int4Weight | Fp8Weight
Weight = torch.Tensor | QuantizedWeight

# int4 groups run along in_features. A width that 128 does not divide (the demo model's intermediate size 704, the
# test checkpoints' 160) takes the largest of these that divides it: finer groups cost a little memory (float32
# scale and zero point per group) and lose no accuracy, where refusing would leave such models unquantizable.
_INT4_GROUP_SIZES = (GROUP_SIZE, 64, 32)


# The CPU paths dequantize tiles into a float32 workspace; one per thread (the engine steps in one thread, tests and
# benchmarks may drive several engines), grown to the widest matrix seen, kept for the thread's life. A fresh 2 MiB
# buffer per call costs page faults whenever the allocator returns it to the OS in between (kernels/quant.py).
_workspaces = threading.local()


def onednn_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product goes to oneDNN: a float32 CPU weight kept row-major (matmul_layout's choice for it), a
    float32 2-D input, nothing that needs a gradient (oneDNN's linear has none)."""
    return (
        weight.dtype == torch.float32
        and x.dtype == torch.float32
        and x.dim() == 2
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and cpu_matmul() == "onednn"
    )


def _workspace(x: torch.Tensor, in_features: int) -> torch.Tensor | None:
    if x.is_cuda:
        return None
    needed = workspace_elems(in_features)
    buffer: torch.Tensor | None = getattr(_workspaces, "buffer", None)
    if buffer is None or buffer.numel() < needed:
        # A normal tensor even when made during an inference-mode step: such a one may be written in and out of it.
        with torch.inference_mode(False):
            buffer = torch.empty(needed, dtype=torch.float32)
        _workspaces.buffer = buffer
    return buffer


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in] @ weight.T (+ bias [out]) -> [num_tokens, out] in x's dtype."""
    if isinstance(weight, torch.Tensor):
        if onednn_fp32(x, weight) and (bias is None or bias.dtype == torch.float32):
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
            return out
        return F.linear(x, weight, bias)
    workspace = _workspace(x, weight.shape[1])
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias, workspace=workspace)
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, bias, workspace=workspace)
    return int4_linear(x, weight, bias, workspace=workspace)


def addmm(residual: torch.Tensor, x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """residual [num_tokens, out] + x [num_tokens, in] @ weight.T, as a new tensor (residual is not written)."""
    if isinstance(weight, torch.Tensor):
        # Both add the residual inside the matmul: one pass over the activations fewer.
        if onednn_fp32(x, weight) and residual.dtype == torch.float32:
            summed: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x.contiguous(), residual.contiguous(), weight, None, "add"
            )
            return summed
        return torch.addmm(residual, x, weight.t())
    workspace = _workspace(x, weight.shape[1])
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, residual=residual, workspace=workspace)
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight, residual=residual, workspace=workspace)
    return int4_linear(x, weight, residual=residual, workspace=workspace)


def matmul_layout(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight [out, in] in the layout its library multiplies fastest: for MKL the same-shaped view of
    an input-major copy ([in, out] in memory), so that F.linear hands MKL x @ W with W stored as is (no transposed
    operand), the path MKL runs fastest at the row counts of decode steps and no slower at prefill sizes
    (docs/decisions/0017); for oneDNN the checkpoint's row-major layout (decision 0055). Half types go through
    oneDNN in either case, so they keep it.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return weight
    if cpu_matmul() == "onednn":
        return weight.contiguous()
    return weight.t().contiguous().t()


def quantize(weight: torch.Tensor, mode: QuantizationName) -> QuantizedWeight:
    """Round-to-nearest quantization of a float weight [out, in]; raises ValueError if int4 has no group size
    that divides in_features."""
    if mode == "int8":
        return quantize_int8(weight)
    if mode == "fp8":
        return quantize_fp8(weight)
    return quantize_int4(weight, group_size=int4_group_size(weight.shape[1]))


def int4_group_size(in_features: int) -> int:
    """The int4 group size for rows of `in_features`: 128, or the largest of 64 and 32 that divides it."""
    for size in _INT4_GROUP_SIZES:
        if in_features % size == 0:
            return size
    raise ValueError(
        f"int4 quantization needs in_features divisible by one of {', '.join(map(str, _INT4_GROUP_SIZES))}, "
        f"but a projection has {in_features}"
    )


def nbytes(weight: Weight) -> int:
    """Bytes the weight really keeps: the tensor, or the quantized values with their scales and zero points."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.nbytes()
