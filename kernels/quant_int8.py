"""The int8 weight-only matmul, y = x @ dequantize(w)^T (+ bias): its torch path, Triton kernel and launcher.

kernels/quant.py states the format and the semantics and its `int8_linear` picks the path; the format, quantizer
and checks live in kernels/quant_formats.py."""

from __future__ import annotations

import torch

from loraplex.kernels.quant_formats import (
    HAS_TRITON,
    MIN_SCALE,
    TILE_ELEMS,
    Int8Weight,
    check_linear,
    check_residual,
    native_operands,
    prepare_launch,
    tile_buffer,
    tile_rows,
)

if HAS_TRITON:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["int8_linear_dynamic", "int8_linear_torch", "int8_linear_triton"]

# Weight elements dequantized per step of the torch path (a float32 buffer of 2 MiB): the int8 codes stay the only
# copy in memory. Large enough for few, large matmuls; a whole matrix per call would be a transient full copy the
# largest matrices of a bigger model could not afford (benchmarks/quant_cpu.py; decision 0019). The tests shrink
# it to cover several tiles.


# ---------------------------------------------------------------------------------------------------------------------
# Torch path (CPU serving)
# ---------------------------------------------------------------------------------------------------------------------


def int8_linear_torch(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int8Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    workspace: torch.Tensor | None = None,  # float32, >= workspace_elems(in_features) elements
) -> torch.Tensor:
    """The torch path, in float32: the codes are converted to float32 a tile of output rows at a time (exact: int8
    fits float32) and multiplied with x; the per-channel scale multiplies the product. Returns [num_tokens,
    out_features] in x.dtype. `workspace`, kept by the caller across calls, holds the tile (see tile_buffer).

    Not torch's fused `_weight_int8pack_mm`: for float32 x it is no faster at one token and far slower from a few
    tokens up; with bfloat16 x it rounds x to 8 bits, and it crashed for some input widths in torch 2.13
    (benchmarks/quant_cpu.py; decision 0019)."""
    check_linear(x, w.shape, w.qweight.device, bias)
    num_tokens = x.shape[0]
    out_features, in_features = w.shape
    xf = x.float()
    y = torch.empty(num_tokens, out_features, dtype=torch.float32, device=x.device)
    rows = tile_rows(out_features, in_features, TILE_ELEMS)
    tile = tile_buffer(workspace, rows * in_features, x.device).view(rows, in_features)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        t = tile[: end - start]
        t.copy_(w.qweight[start:end])
        torch.mm(xf, t.t(), out=y[:, start:end])
    y.mul_(w.scales)
    if bias is not None:
        y.add_(bias)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def int8_linear_dynamic(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int8Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    residual: torch.Tensor | None = None,  # [num_tokens, out_features], added to the product
    native: bool = False,
) -> torch.Tensor:
    """The CPU path with 8-bit activations (W8A8): each row of x is quantized on the fly, symmetric to -127..127
    with its own scale, sx[t] = max(max|x[t, :]|, tiny) / 127, q = round(x * (1 / sx[t])); the codes are multiplied
    in integers (`torch._int_mm`, int32 accumulators: exact) and the product scaled by the row's and the channel's
    scale, float(acc) * sx[t] * scales[n] (+ bias) (+ residual). Returns a new [num_tokens, out_features] tensor
    in x.dtype.

    Not the reference semantics of kernels/quant.py: rounding x to 8 bits per row moves the logits a little
    (tests/engine/model/test_quantization.py states by how much; decision 0039). It pays only where the CPU
    multiplies int8 natively (AVX-512 VNNI, AMX): 4-5x faster per call than float32 there, far slower without.
    `native`: float32 operands go to the native operator (kernels/native.py; the caller checked it is loaded),
    which computes the same in one pass over x and one over the output."""
    check_linear(x, w.shape, w.qweight.device, bias)
    num_tokens, out_features = x.shape[0], w.shape[0]
    check_residual(residual, num_tokens, out_features)
    if native and w.qweight.is_contiguous() and native_operands(x, w.scales, bias, residual):
        y: torch.Tensor = torch.ops.loraplex_cpu.int8_linear_dynamic(x, w.qweight, w.scales, bias, residual)
        return y
    if num_tokens == 0:
        return torch.empty(0, out_features, dtype=x.dtype, device=x.device)
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min_(MIN_SCALE).div_(127)
    xq = torch.round(xf * scale.reciprocal()).to(torch.int8)
    y = torch._int_mm(xq, w.qweight.t()).float()
    y.mul_(scale).mul_(w.scales)
    if bias is not None:
        y.add_(bias)
    if residual is not None:
        y.add_(residual)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernel and launcher (CUDA; CPU under TRITON_INTERPRET=1 for tests)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _int8_linear_kernel(  # type: ignore[no-untyped-def]  # Triton reads parameter annotations itself
        # Pointers
        x_ptr,  # [num_tokens, in_features]
        qweight_ptr,  # [out_features, in_features] int8
        scales_ptr,  # [out_features] float32
        bias_ptr,  # [out_features], or any pointer when not HAS_BIAS
        out_ptr,  # [num_tokens, out_features], x's dtype
        # Sizes
        num_tokens,
        out_features,
        in_features,
        # Strides
        stride_x_token,
        stride_x_feature,
        stride_w_out,
        stride_w_in,
        stride_o_token,
        stride_o_feature,
        # Meta-parameters
        BLOCK_T: tl.constexpr,  # tokens per program
        BLOCK_N: tl.constexpr,  # output features per program
        BLOCK_K: tl.constexpr,  # input features per step of the reduction
        HAS_BIAS: tl.constexpr,
        DOT_FP32: tl.constexpr,  # upcast x for tl.dot: the interpreter gets half-type dots wrong
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 x: TF32 would drop its low mantissa bits
    ):
        """Program (token tile, output tile): out[t, n] = sum_k x[t, k] * q[n, k] * scale[n] (+ bias[n]).

        The codes are loaded as int8 and converted in registers (to x's dtype, exact: int8 fits every float
        type here); the scale multiplies the float32 accumulator once, after the reduction."""
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        t_valid = offs_t < num_tokens
        n_valid = offs_n < out_features
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, in_features, BLOCK_K):
            k = k_start + offs_k
            k_valid = k < in_features
            x = tl.load(
                x_ptr + offs_t[:, None].to(tl.int64) * stride_x_token + k[None, :] * stride_x_feature,
                mask=t_valid[:, None] & k_valid[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_K]
            q = tl.load(
                qweight_ptr + offs_n[:, None].to(tl.int64) * stride_w_out + k[None, :] * stride_w_in,
                mask=n_valid[:, None] & k_valid[None, :],
                other=0,
            )  # [BLOCK_N, BLOCK_K] int8
            if DOT_FP32:
                x = x.to(tl.float32)
            acc += tl.dot(x, tl.trans(q.to(x.dtype)), input_precision=DOT_PRECISION)
        acc *= tl.load(scales_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_t[:, None].to(tl.int64) * stride_o_token + offs_n[None, :] * stride_o_feature,
            acc.to(out_ptr.dtype.element_ty),
            mask=t_valid[:, None] & n_valid[None, :],
        )


def int8_linear_triton(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int8Weight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:
    """Launch the int8 kernel: check, allocate, launch. CPU tensors work under TRITON_INTERPRET=1."""
    out, tiles = prepare_launch("int8_linear", x, w.shape, w.qweight.device, bias)
    if tiles is None:
        return out
    out_features, in_features = w.shape
    if in_features == 0:
        return out.copy_(bias) if bias is not None else out.zero_()
    _int8_linear_kernel[tiles.grid](
        x,
        w.qweight,
        w.scales,
        bias if bias is not None else w.scales,
        out,
        x.shape[0],
        out_features,
        in_features,
        *x.stride(),
        *w.qweight.stride(),
        *out.stride(),
        BLOCK_T=tiles.block_t,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_BIAS=bias is not None,
        DOT_FP32=tiles.interpret,
        DOT_PRECISION=tiles.dot_precision,
    )
    return out
