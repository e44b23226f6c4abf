"""The quantized weight formats (kernels/quant.py states them), their quantizers and dequantizers, the input
checks the matmuls share, and the guarded Triton import."""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton  # type: ignore[import-untyped]  # noqa: F401  (re-exported for the kernel modules)
except ImportError:  # the CPU image ships without Triton; the torch paths need none
    HAS_TRITON = False
else:
    HAS_TRITON = True

__all__ = [
    "GROUP_SIZE",
    "HAS_TRITON",
    "MIN_SCALE",
    "Int4Weight",
    "Int8Weight",
    "check_residual",
    "dequantize_int4",
    "dequantize_int8",
    "native_operands",
    "pack_int4",
    "quantize_int4",
    "quantize_int8",
    "workspace_elems",
]

GROUP_SIZE = 128  # input features per int4 scale and zero point
# Weight elements the torch paths dequantize per step (float32, 2 MiB); see kernels/quant_int8.py for the
# measurements behind it. Each path module imports it as its own TILE_ELEMS.
TILE_ELEMS = 1 << 19

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Keeps all-zero rows and groups finite: their values quantize to 0 (int8) or to the zero point (int4); the same for
# the rows of activations the dynamic paths quantize.
MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Int8Weight:
    """A [out, in] matrix as int8 with one symmetric scale per output channel: w[n, k] ~= qweight[n, k] * scales[n].

    Built by `quantize_int8`; immutable and shared by every request. Nothing dequantized is kept."""

    qweight: torch.Tensor  # [out, in] int8, in -127..127
    scales: torch.Tensor  # [out] float32, max|w[n, :]| / 127

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.qweight.shape[1])

    def nbytes(self) -> int:
        """Bytes held in memory (the codes and the scales)."""
        return _nbytes(self.qweight, self.scales)


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] matrix as 4-bit codes, two per byte, with a scale and a zero point per group of `group_size`
    input features: w[n, k] ~= (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size], where
    q[n, k] = (packed[n, k // 2] >> 4 * (k % 2)) & 0xF (the low nibble holds the even column).

    Built by `quantize_int4`; immutable and shared by every request. Nothing dequantized or repacked is kept, so
    `nbytes` is everything this format costs."""

    packed: torch.Tensor  # [out, in // 2] uint8
    scales: torch.Tensor  # [out, in // group_size] float32, (max - min) / 15 of the group
    zeros: torch.Tensor  # [out, in // group_size] float32, whole numbers (in 0..15 when the group spans 0)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], 2 * self.packed.shape[1])

    def nbytes(self) -> int:
        """Bytes held in memory (the packed codes, the scales and the zero points)."""
        return _nbytes(self.packed, self.scales, self.zeros)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight dtype must be one of {_FLOAT_DTYPES}, got {weight.dtype}")


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round-to-nearest symmetric int8 per output channel: scale = max|w[n, :]| / 127, q = round(w / scale).
    Every element is then within scale / 2 of its dequantized value."""
    _check_weight(weight)
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(MIN_SCALE)
    qweight = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(qweight=qweight.contiguous(), scales=scales.contiguous())


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Round-to-nearest asymmetric int4 per group of `group_size` input features, from the group's min and max:
    scale = (max - min) / 15, zero = round(-min / scale), q = clamp(round(w / scale) + zero, 0, 15), so every
    element is within scale / 2 of its dequantized value. The zero point is not clamped to 0..15: a group of one
    sign keeps its whole range (zeros are floats anyway); a constant group c gets scale |c| and is exact.
    Raises ValueError unless in_features is a multiple of group_size and group_size is even."""
    _check_weight(weight)
    out_features, in_features = weight.shape
    if group_size < 2 or group_size % 2 != 0:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    if in_features % group_size != 0:
        raise ValueError(f"int4 needs in_features ({in_features}) to be a multiple of group_size ({group_size})")
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = torch.where(hi > lo, (hi - lo) / 15, lo.abs()).clamp_min_(MIN_SCALE)
    zeros = torch.round(-lo / scales)
    q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.view(out_features, in_features)
    return Int4Weight(packed=pack_int4(q), scales=scales, zeros=zeros, group_size=group_size)


def dequantize_int8(w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] matrix in `dtype` (computed in float32, rounded once): a new tensor for references and
    tests; the matmuls never build it whole."""
    return (w.qweight.float() * w.scales[:, None]).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes (uint8, 0..15) -> [out, in // 2] bytes, the even column in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The [out, in] codes (uint8, 0..15) of a [out, in // 2] packed tensor."""
    return torch.stack([packed & 0xF, packed >> 4], dim=2).view(packed.shape[0], -1)


def dequantize_int4(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] matrix in `dtype` (computed in float32, rounded once); see `dequantize_int8`."""
    out_features, in_features = w.shape
    q = unpack_int4(w.packed).float().view(out_features, in_features // w.group_size, w.group_size)
    return ((q - w.zeros[..., None]) * w.scales[..., None]).view(out_features, in_features).to(dtype)


def tile_rows(out_features: int, in_features: int, tile_elems: int) -> int:
    """Rows per tile of the torch paths: at most tile_elems // in_features, split evenly over the tiles needed
    (512 rows of 1408 go as 256 + 256 rather than 372 + 140: the second matmul is not a small, slow one)."""
    most = max(1, tile_elems // max(in_features, 1))
    num_tiles = -(-out_features // most) if out_features else 1
    return max(1, -(-out_features // num_tiles))


def workspace_elems(in_features: int) -> int:
    """Float32 elements a `workspace` for the torch paths needs, for matrices of up to `in_features` inputs."""
    return max(TILE_ELEMS, in_features)


def tile_buffer(workspace: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    """`numel` float32 elements for the torch paths' tiles: the front of the caller's workspace, else a new
    buffer. A new 2 MiB buffer per call costs page faults whenever the allocator hands it back to the OS in
    between (glibc maps blocks this large itself); a workspace the caller keeps avoids that."""
    if workspace is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if workspace.dtype != torch.float32 or workspace.dim() != 1 or not workspace.is_contiguous():
        raise ValueError(
            f"workspace must be a flat, contiguous float32 tensor, got {workspace.dtype} {tuple(workspace.shape)}"
        )
    if workspace.numel() < numel or workspace.device != device:
        raise ValueError(f"workspace needs {numel} elements on {device}, got {workspace.numel()} on {workspace.device}")
    return workspace[:numel]


def check_linear(x: torch.Tensor, shape: tuple[int, int], device: torch.device, bias: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices of a quantized matmul's operands (values are not read)."""
    out_features, in_features = shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [num_tokens, {in_features}], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weight on {device}")
    if bias is not None and (bias.shape != (out_features,) or bias.device != device):
        raise ValueError(f"bias must be [{out_features}] on {device}, got {tuple(bias.shape)} on {bias.device}")


def check_residual(residual: torch.Tensor | None, num_tokens: int, out_features: int) -> None:
    """A dynamic path's residual, when given, is [num_tokens, out_features]."""
    if residual is not None and residual.shape != (num_tokens, out_features):
        raise ValueError(f"residual must be [{num_tokens}, {out_features}], got {tuple(residual.shape)}")


def native_operands(*tensors: torch.Tensor | None) -> bool:
    """Whether the native CPU operators take these float operands (None: an absent optional one): float32,
    contiguous, not on a GPU."""
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda) for t in tensors)


@dataclass(frozen=True)
class LaunchTiles:
    """How a quantized matmul kernel is launched for one call: its grid over (token, output) tiles and the tile
    sizes, the same for int8 and int4."""

    grid: tuple[int, int]
    block_t: int  # tokens per program: 16 (tl.dot's minimum) for decode-sized calls, else 64
    block_n: int  # output features per program
    block_k: int  # input features per step of the reduction
    interpret: bool  # CPU tensors: only the Triton interpreter runs them; it gets half-type dots wrong
    dot_precision: str  # "ieee" for float32 x (TF32 would drop its low mantissa bits) and the interpreter


def prepare_launch(
    op: str, x: torch.Tensor, shape: tuple[int, int], device: torch.device, bias: torch.Tensor | None
) -> tuple[torch.Tensor, LaunchTiles | None]:
    """What both launchers do first: check the operands, allocate `out` [num_tokens, out_features] in x's dtype,
    and choose the tiles; None for the tiles when there is nothing to launch (no token or no output)."""
    if not HAS_TRITON:
        raise RuntimeError(f"{op}_triton needs Triton (the `kernels` extra); use {op}_torch")
    check_linear(x, shape, device, bias)
    num_tokens, out_features = x.shape[0], shape[0]
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_features == 0:
        return out, None
    interpret = x.device.type == "cpu"
    block_t = 16 if num_tokens <= 16 else 64
    block_n = 128 if interpret else 64  # the interpreter runs a program per tile in Python: large tiles are fast
    return out, LaunchTiles(
        grid=(-(-num_tokens // block_t), -(-out_features // block_n)),
        block_t=block_t,
        block_n=block_n,
        block_k=128 if interpret else 64,
        interpret=interpret,
        dot_precision="ieee" if interpret or x.dtype == torch.float32 else "tf32",
    )
