"""The int4 weight-only matmul, y = x @ dequantize(w)^T (+ bias): its torch path, Triton kernel and launcher.

kernels/quant.py states the format and the semantics and its `int4_linear` picks the path; the format, quantizer
and checks live in kernels/quant_formats.py."""

from __future__ import annotations

import torch

from loraplex.kernels.quant_formats import (
    HAS_TRITON,
    MIN_SCALE,
    TILE_ELEMS,
    Int4Weight,
    Int8Weight,
    check_linear,
    check_residual,
    native_operands,
    prepare_launch,
    tile_buffer,
    tile_rows,
    unpack_int4,
)
from loraplex.kernels.quant_int8 import int8_linear_dynamic

if HAS_TRITON:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["int4_linear_dynamic", "int4_linear_torch", "int4_linear_triton", "requantize_int4_rows"]

# Batches up to this many tokens take the split tiles, larger ones the interleaved tiles (see int4_linear_torch).
SPLIT_MAX_TOKENS = 64


# ---------------------------------------------------------------------------------------------------------------------
# Torch path (CPU serving)
# ---------------------------------------------------------------------------------------------------------------------


def int4_linear_torch(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int4Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    workspace: torch.Tensor | None = None,  # float32, >= workspace_elems(in_features) elements
) -> torch.Tensor:
    """The torch path, in float32, dequantizing a tile of output rows at a time into a reused buffer; the packed
    codes stay the only copy of the weight. Returns [num_tokens, out_features] in x.dtype. `workspace`, kept by
    the caller across calls, holds the tiles (see tile_buffer in kernels/quant_formats.py).

    Two tile forms (benchmarks/quant_cpu.py times them; decision 0019 has the figures). Decode-sized batches
    (<= SPLIT_MAX_TOKENS) leave the nibbles apart: the low ones (even columns) and the high ones (odd columns)
    each become a [rows, in / 2] tile times its scale, multiplied with x's even and odd columns, and the zero
    points come out of the matmul as (sum of x over each group) @ (zeros * scales)^T, one small product per call:
    the least elementwise work per weight. Larger batches rebuild the [rows, in] tile, (q - zero) * scale, for one
    matmul over all of `in`, which amortizes better there. Not torch's `_weight_int4pack_mm_for_cpu`: it needs its
    own blocked layout (a second copy of the codes) and is far slower from a few tokens up."""
    check_linear(x, w.shape, w.packed.device, bias)
    xf = x.float()
    tiled = _split_tiles if x.shape[0] <= SPLIT_MAX_TOKENS else _interleaved_tiles
    y = tiled(xf, w, workspace)
    if bias is not None:
        y.add_(bias)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def int4_linear_dynamic(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int4Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    residual: torch.Tensor | None = None,  # [num_tokens, out_features], added to the product
    native: bool = False,
) -> torch.Tensor:
    """The CPU path with 8-bit activations (W4A8): each output row's int4 values are requantized, for this call
    only, to int8 codes on one symmetric scale for the row (`requantize_int4_rows`), then multiplied as
    int8_linear_dynamic does (kernels/quant_int8.py: x rounded to 8 bits per row, one integer product, both scales
    after). One product instead of one per group of inputs (each a small, slower integer matmul), for an extra
    rounding of the weights of at most half an int8 step of the row. Returns a new [num_tokens, out_features] tensor
    in x.dtype; nothing requantized is kept. `native`: float32 operands go to the native operator (the caller
    checked it is loaded), which requantizes in one pass (a table lookup per nibble) and computes the same."""
    check_linear(x, w.shape, w.packed.device, bias)
    check_residual(residual, x.shape[0], w.shape[0])
    if native and native_operands(x, w.scales, w.zeros, bias, residual):
        y: torch.Tensor = torch.ops.loraplex_cpu.int4_linear_dynamic(
            x, w.packed, w.scales, w.zeros, w.group_size, bias, residual
        )
        return y
    return int8_linear_dynamic(x, requantize_int4_rows(w), bias, residual=residual)


def requantize_int4_rows(w: Int4Weight) -> Int8Weight:
    """The int4 weight as int8 with one scale per output row: scale[n] = max(largest |value| of the row, tiny) / 127,
    the largest being max over groups of scales[n, g] * max(|zeros[n, g]|, |15 - zeros[n, g]|); codes
    round((q - zeros[n, g]) * (scales[n, g] * (1 / scale[n]))), each within half an int8 step of the int4 value."""
    out_features, in_features = w.shape
    groups = in_features // w.group_size
    largest = (w.scales * torch.maximum(w.zeros.abs(), (15 - w.zeros).abs())).amax(dim=1)
    scale = largest.clamp_min(MIN_SCALE) / 127
    factor = (w.scales * scale.reciprocal()[:, None])[..., None]
    q = unpack_int4(w.packed).float().view(out_features, groups, w.group_size)
    codes = torch.round((q - w.zeros[..., None]) * factor).to(torch.int8).view(out_features, in_features)
    return Int8Weight(qweight=codes, scales=scale)


def _split_tiles(x: torch.Tensor, w: Int4Weight, workspace: torch.Tensor | None) -> torch.Tensor:
    num_tokens = x.shape[0]
    out_features, in_features = w.shape
    num_groups, half_group = in_features // w.group_size, w.group_size // 2
    x_even = x[:, 0::2].contiguous()
    x_odd = x[:, 1::2].contiguous()
    y = torch.empty(num_tokens, out_features, dtype=torch.float32, device=x.device)
    rows = tile_rows(out_features, in_features, TILE_ELEMS)
    tiles = tile_buffer(workspace, rows * in_features, x.device).view(2, rows, num_groups, half_group)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        n = end - start
        packed = w.packed[start:end].view(n, num_groups, half_group)
        scales = w.scales[start:end, :, None]
        low, high = tiles[0, :n], tiles[1, :n]
        # Convert, then scale in place: one uint8-times-float32 multiply into `out` is slower (a casting loop).
        low.copy_(packed & 0xF).mul_(scales)
        high.copy_(packed >> 4).mul_(scales)
        y_tile = y[:, start:end]
        torch.mm(x_even, low.view(n, -1).t(), out=y_tile)
        y_tile.addmm_(x_odd, high.view(n, -1).t())
    group_sums = x.view(num_tokens, num_groups, w.group_size).sum(dim=2)  # [num_tokens, num_groups]
    return y.sub_(group_sums @ (w.zeros * w.scales).t())


def _interleaved_tiles(x: torch.Tensor, w: Int4Weight, workspace: torch.Tensor | None) -> torch.Tensor:
    out_features, in_features = w.shape
    num_groups = in_features // w.group_size
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    rows = tile_rows(out_features, in_features, TILE_ELEMS)
    tile = tile_buffer(workspace, rows * in_features, x.device).view(rows, num_groups, w.group_size)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        n = end - start
        t = tile[:n]
        t.view(n, in_features).copy_(unpack_int4(w.packed[start:end]))
        t.sub_(w.zeros[start:end, :, None]).mul_(w.scales[start:end, :, None])
        torch.mm(x, t.view(n, in_features).t(), out=y[:, start:end])
    return y


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernel and launcher (CUDA; CPU under TRITON_INTERPRET=1 for tests)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _int4_linear_kernel(  # type: ignore[no-untyped-def]  # Triton reads parameter annotations itself
        # Pointers
        x_ptr,  # [num_tokens, in_features]
        packed_ptr,  # [out_features, in_features // 2] uint8, low nibble = even column
        scales_ptr,  # [out_features, in_features // GROUP_SIZE] float32
        zeros_ptr,  # [out_features, in_features // GROUP_SIZE] float32
        bias_ptr,  # [out_features], or any pointer when not HAS_BIAS
        out_ptr,  # [num_tokens, out_features], x's dtype
        # Sizes
        num_tokens,
        out_features,
        in_features,
        # Strides
        stride_x_token,
        stride_x_feature,
        stride_p_out,
        stride_p_byte,
        stride_s_out,
        stride_s_group,
        stride_z_out,
        stride_z_group,
        stride_o_token,
        stride_o_feature,
        # Meta-parameters
        GROUP_SIZE: tl.constexpr,  # input features per scale and zero point
        BLOCK_T: tl.constexpr,  # tokens per program
        BLOCK_N: tl.constexpr,  # output features per program
        BLOCK_K: tl.constexpr,  # input features per step of the reduction
        HAS_BIAS: tl.constexpr,
        DOT_FP32: tl.constexpr,  # dot in float32: the interpreter gets half-type dots wrong
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 x: TF32 would drop its low mantissa bits
    ):
        """Program (token tile, output tile): out[t, n] = sum_k x[t, k] * (q[n, k] - zero) * scale (+ bias[n]).

        Column k's code is byte k // 2, nibble k % 2: each byte is loaded for both of its columns (the second load
        hits the cache) and shifted in registers. Scales and zero points are gathered per column, so BLOCK_K need
        not divide GROUP_SIZE."""
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        t_valid = offs_t < num_tokens
        n_valid = offs_n < out_features
        offs_k = tl.arange(0, BLOCK_K)
        n64 = offs_n[:, None].to(tl.int64)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, in_features, BLOCK_K):
            k = k_start + offs_k
            k_valid = k < in_features
            x = tl.load(
                x_ptr + offs_t[:, None].to(tl.int64) * stride_x_token + k[None, :] * stride_x_feature,
                mask=t_valid[:, None] & k_valid[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_K]
            w_mask = n_valid[:, None] & k_valid[None, :]
            byte = tl.load(packed_ptr + n64 * stride_p_out + (k // 2)[None, :] * stride_p_byte, mask=w_mask, other=0)
            q = ((byte >> ((k % 2) * 4).to(tl.uint8)[None, :]) & 0xF).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            g = (k // GROUP_SIZE)[None, :]
            scale = tl.load(scales_ptr + n64 * stride_s_out + g * stride_s_group, mask=w_mask, other=0.0)
            zero = tl.load(zeros_ptr + n64 * stride_z_out + g * stride_z_group, mask=w_mask, other=0.0)
            wt = (q - zero) * scale  # [BLOCK_N, BLOCK_K] float32
            if DOT_FP32:
                x = x.to(tl.float32)
            else:
                wt = wt.to(x.dtype)
            acc += tl.dot(x, tl.trans(wt), input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_t[:, None].to(tl.int64) * stride_o_token + offs_n[None, :] * stride_o_feature,
            acc.to(out_ptr.dtype.element_ty),
            mask=t_valid[:, None] & n_valid[None, :],
        )


def int4_linear_triton(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Int4Weight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:
    """Launch the int4 kernel: check, allocate, launch. CPU tensors work under TRITON_INTERPRET=1.

    On a GPU, half-precision x is multiplied with the dequantized tile rounded to x's dtype (the tensor cores'
    operands); float32 x keeps float32 tiles."""
    out, tiles = prepare_launch("int4_linear", x, w.shape, w.packed.device, bias)
    if tiles is None:
        return out
    out_features, in_features = w.shape
    _int4_linear_kernel[tiles.grid](
        x,
        w.packed,
        w.scales,
        w.zeros,
        bias if bias is not None else w.scales,
        out,
        x.shape[0],
        out_features,
        in_features,
        *x.stride(),
        *w.packed.stride(),
        *w.scales.stride(),
        *w.zeros.stride(),
        *out.stride(),
        GROUP_SIZE=w.group_size,
        BLOCK_T=tiles.block_t,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        HAS_BIAS=bias is not None,
        DOT_FP32=tiles.interpret or x.dtype == torch.float32,
        DOT_PRECISION=tiles.dot_precision,
    )
    return out
