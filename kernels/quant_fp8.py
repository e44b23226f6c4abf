"""FP8 (e4m3) weights as FP8 checkpoints ship them, and the matmul over them.

Format (what is kept in memory; nothing dequantized is cached):

    Fp8Weight: qweight float8_e4m3fn [out, in], scales float32 [out, ceil(in / col_block)], col_block
        w[n, k] = float(qweight[n, k]) * scales[n, k // col_block]

One layout holds every scale granularity checkpoints use, each expanded to rows at load: per tensor (one scale,
repeated on every row, col_block = in), per channel (one per row, col_block = in) and block-wise (transformers'
`weight_block_size` [128, 128] with `weight_scale_inv`, compressed-tensors' `block_structure`: the scale of row
block n // 128, column block k // 128, on each of the block's rows). Rows of separately quantized projections then
stack (q, k, v into qkv) and reorder (the rotary pairs) like any weight's rows. The row scales cost 4 bytes per
column block of a row: 1/32 of a byte per weight at [128, 128] blocks, so an FP8 model is half of bf16.

`fp8_linear` computes x @ w^T (+ bias) (+ residual) on one of two paths:
- dequantizing (CPUs, GPUs below compute capability 8.9): the codes are converted to float32 a tile of output rows
  at a time (exact: every e4m3 value is a float32), scaled, and multiplied with a float32 accumulator; activations
  stay in x's precision (weight-only).
- FP8 GEMMs (CUDA with compute capability >= 8.9, where `torch._scaled_mm` runs on the tensor cores): activations
  are quantized to e4m3 per token (dynamic: amax / 448; for block-wise weights per token and column block, as
  DeepSeek-V3's 1 x 128 groups); a static checkpoint's `input_scale` is not used (per token is finer). One GEMM per
  column block of the weight's scales (one for per-row weights) with unit scales and a float32 out (the form every
  FP8 GPU runs; torch's row-wise scaled form wants sm90 and a bf16 out), then scaled by the token's and the row's
  scale of that block and summed. Shapes whose in or out features are not multiples of 16 (the GEMM's alignment)
  take the dequantizing path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.quant_formats import TILE_ELEMS, check_linear, tile_buffer, tile_rows

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Weight", "dequantize_fp8", "fp8_gemm_supported", "fp8_linear", "quantize_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Every e4m3 bit pattern's float32 value: on the CPU a table lookup widens a tile 2.5x faster than torch's cast
# (0.45 against 1.12 ms for 1408 x 512 on 2 threads here, against 0.35 ms for the 32-row matmul that follows).
_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


@dataclass(frozen=True)
class Fp8Weight:
    """A [out, in] matrix as e4m3 codes with a scale per row and block of `col_block` input features (see the
    module docstring). Immutable and shared by every request."""

    qweight: torch.Tensor  # [out, in] float8_e4m3fn
    scales: torch.Tensor  # [out, ceil(in / col_block)] float32
    col_block: int

    def __post_init__(self) -> None:
        out_features, in_features = self.qweight.shape
        if self.qweight.dtype != FP8_DTYPE:
            raise ValueError(f"qweight must be {FP8_DTYPE}, got {self.qweight.dtype}")
        expected = (out_features, -(-in_features // self.col_block))
        if tuple(self.scales.shape) != expected or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {expected}, got {self.scales.dtype} {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1])

    @property
    def per_row(self) -> bool:
        """One scale per row (per tensor or per channel): the scale multiplies the product, not the tile."""
        return self.scales.shape[1] == 1

    def nbytes(self) -> int:
        """Bytes held in memory (the codes and the scales)."""
        return self.qweight.numel() + self.scales.numel() * 4

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.qweight.to(device), self.scales.to(device), self.col_block)

    def rows(self, index: torch.Tensor | slice) -> Fp8Weight:
        """The weight of rows `index` (a permutation, a subset, a slice)."""
        return Fp8Weight(self.qweight[index].contiguous(), self.scales[index].contiguous(), self.col_block)

    def columns(self, start: int, stop: int) -> Fp8Weight:
        """The weight of input columns [start, stop); block-wise scales need start on a block boundary."""
        if self.per_row:
            return Fp8Weight(self.qweight[:, start:stop].contiguous(), self.scales, stop - start)
        if start % self.col_block:
            raise ValueError(f"columns from {start} split a block of {self.col_block} input features")
        blocks = slice(start // self.col_block, -(-stop // self.col_block))
        return Fp8Weight(self.qweight[:, start:stop].contiguous(), self.scales[:, blocks].contiguous(), self.col_block)

    @staticmethod
    def stack(parts: list[Fp8Weight]) -> Fp8Weight:
        """The rows of `parts` one after another (q, k and v into qkv): per-row parts stack with any scales;
        block-wise parts need one column block size."""
        if len(parts) == 1:
            return parts[0]
        if all(part.per_row for part in parts):
            width = parts[0].shape[1]
            return Fp8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), width)
        if len({part.col_block for part in parts}) != 1 or any(part.per_row for part in parts):
            raise ValueError("the projections to fuse have scales of different granularities")
        return Fp8Weight(
            torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), parts[0].col_block
        )


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Per-channel e4m3 (`--quantization fp8` on a 16/32-bit checkpoint): scale = max|w[n, :]| / 448, codes
    rounded to nearest by the cast."""
    w = weight.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    codes = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes, scales, weight.shape[1])


def _widen(codes: torch.Tensor, out: torch.Tensor) -> None:
    """out (float32, codes' shape, contiguous) = the codes' values."""
    if codes.device.type != "cpu":
        out.copy_(codes)
        return
    torch.index_select(_VALUES, 0, codes.reshape(-1).view(torch.uint8).int(), out=out.view(-1))


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix the weight stands for."""
    values = w.qweight.float()
    _scale_tile(values, w.scales, w.col_block)
    return values.to(dtype)


def _scale_tile(tile: torch.Tensor, scales: torch.Tensor, col_block: int) -> None:
    """tile[n, k] *= scales[n, k // col_block], in place (tile: float32 [rows, in])."""
    in_features = tile.shape[1]
    whole = in_features // col_block * col_block
    if whole:
        tile[:, :whole].view(tile.shape[0], -1, col_block).mul_(scales[:, : whole // col_block, None])
    if whole < in_features:
        tile[:, whole:].mul_(scales[:, -1:])


def fp8_linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    w: Fp8Weight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    workspace: torch.Tensor | None = None,  # float32, >= workspace_elems(in_features) elements
    residual: torch.Tensor | None = None,  # [num_tokens, out_features], added to the product (not written)
    fp8_gemm: bool | None = None,  # None: where the device has FP8 GEMMs (`fp8_gemm_supported`)
) -> torch.Tensor:
    """x @ dequantize_fp8(w)^T (+ bias) (+ residual) as a new [num_tokens, out_features] tensor in x.dtype, on
    FP8 GEMMs when `fp8_gemm` (or, None, where the device has them) and the shape allows, else dequantizing."""
    check_linear(x, w.shape, w.qweight.device, bias)
    use_gemm = fp8_gemm_supported(x.device) if fp8_gemm is None else fp8_gemm
    y = _fp8_gemm(x, w) if use_gemm and _gemm_aligned(w) else _dequantizing(x, w, workspace)
    if bias is not None:
        y.add_(bias)
    if residual is not None:
        y.add_(residual)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether FP8 GEMMs run on `device`'s tensor cores: CUDA with compute capability 8.9 (Ada) or later."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _gemm_aligned(w: Fp8Weight) -> bool:
    out_features, in_features = w.shape
    return out_features % 16 == 0 and in_features % 16 == 0 and (w.per_row or w.col_block % 16 == 0)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32 [tokens, k]) as e4m3 codes and a float32 scale per token ([tokens, 1]): amax / 448."""
    scales = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    return (x / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def _fp8_gemm(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x @ W^T in float32 [tokens, out] through `torch._scaled_mm` (the module docstring's FP8 path): one GEMM per
    column block of the weight's scales (one for per-row scales), whose float32 product is scaled by the tokens'
    and the rows' scales of that block."""
    xf = x.float()
    out_features, in_features = w.shape
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y: torch.Tensor | None = None
    for block, start in enumerate(range(0, in_features, w.col_block)):
        stop = min(in_features, start + w.col_block)
        codes, x_scales = _quantize_rows(xf[:, start:stop].contiguous())
        part = torch._scaled_mm(codes, w.qweight[:, start:stop].t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        scale = x_scales * w.scales[:, block].view(1, out_features)
        if y is None:
            y = part.mul_(scale)
        else:
            y.addcmul_(part, scale)
    assert y is not None
    return y


def _dequantizing(x: torch.Tensor, w: Fp8Weight, workspace: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T in float32 [tokens, out], the codes widened and scaled a tile of rows at a time."""
    num_tokens = x.shape[0]
    out_features, in_features = w.shape
    xf = x.float()
    y = torch.empty(num_tokens, out_features, dtype=torch.float32, device=x.device)
    rows = tile_rows(out_features, in_features, TILE_ELEMS)
    tile = tile_buffer(workspace, rows * in_features, x.device).view(rows, in_features)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        t = tile[: end - start]
        _widen(w.qweight[start:end], t)
        if not w.per_row:
            _scale_tile(t, w.scales[start:end], w.col_block)
        torch.mm(xf, t.t(), out=y[:, start:end])
    if w.per_row:
        y.mul_(w.scales[:, 0])
    return y
