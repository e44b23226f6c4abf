"""Pre-quantized 4-bit checkpoints (GPTQ and AWQ), read into the engine's own int4 format at load.

What a checkpoint says (config.json's `quantization_config`, or AutoGPTQ's older quantize_config.json) and what each
4-bit projection holds, for W [out, in] used as y = x @ W^T, with G = in // group_size groups:

    GPTQ  qweight int32 [in // 8, out]   code of (k, n) = (qweight[k // 8, n] >> 4 * (k % 8)) & 0xF
          qzeros  int32 [G, out // 8]    zero of (g, n) = (qzeros[g, n // 8] >> 4 * (n % 8)) & 0xF
                                                          (+ 1 in the original "gptq" format, not in "gptq_v2")
          scales  float [G, out]         g_idx int32 [in] (optional): the group of each input feature
    AWQ   qweight int32 [in, out // 8]   code of (k, n) = (qweight[k, n // 8] >> 4 * AWQ_NIBBLE[n % 8]) & 0xF
          qzeros  int32 [G, out // 8]    the same packing;  scales float [G, out]

    W[n, k] = (code(k, n) - zero(k // group_size, n)) * scale(k // group_size, n)

which is exactly Int4Weight's arithmetic (kernels/quant_formats.py) once the codes are transposed to [out, in] and
repacked two per byte: the values served are the checkpoint's, bit for bit, and the same kernels run them.
GPTQ act-order (desc_act) checkpoints, whose g_idx scatters a group's features over the row, are read with their
input features sorted by group: the layer then multiplies x[:, order] with the sorted weight, as exllama does.
Refused with a message naming the field: other bit widths, AWQ other than the GEMM layout or without zero points,
a g_idx that does not give every group group_size features, and group sizes that do not divide a projection's width.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.fp8 import FP8_METHODS
from loraplex.kernels.quant import Int4Weight, pack_int4

if TYPE_CHECKING:
    from loraplex.engine.model.weights import CheckpointTensors

PrequantizedMethod = Literal["gptq", "awq"]

# AWQ's GEMM layout stores the 8 columns of a word in the order 0, 2, 4, 6, 1, 3, 5, 7: column j is in nibble
# AWQ_NIBBLE[j].
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class PrequantizedFormat:
    method: PrequantizedMethod
    group_size: int  # input features per scale and zero point; -1 = the whole row (GPTQ)
    zero_offset: int  # added to every stored zero point: 1 in GPTQ's original format, else 0


def read_prequantized_format(path: Path | None, raw_config: dict[str, Any]) -> PrequantizedFormat | None:
    """The checkpoint's pre-quantization, from config.json's `quantization_config` or (in folder `path`)
    quantize_config.json; None for a 16/32-bit checkpoint. Raises CheckpointError for one loraplex does not load."""
    source = "config.json field 'quantization_config'"
    spec = raw_config.get("quantization_config")
    if spec is None and path is not None and (path / "quantize_config.json").is_file():
        source = "quantize_config.json"
        try:
            spec = json.loads((path / "quantize_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"quantize_config.json in {path} is not valid JSON: {exc}") from None
        spec = {"quant_method": "gptq", **spec} if isinstance(spec, dict) else spec
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise CheckpointError(f"{source} must be an object")
    method = spec.get("quant_method")
    if method in FP8_METHODS:
        return None  # FP8 (engine/model/fp8.py)
    if method not in ("gptq", "awq"):
        raise CheckpointError(
            f"{source}: quant_method {method!r} is not supported; loraplex loads 'gptq', 'awq', 'fp8' and "
            "'compressed-tensors' (FP8)"
        )
    bits = spec.get("bits", spec.get("w_bit"))
    if bits != 4:
        raise CheckpointError(f"{source}: bits is {bits!r}; loraplex loads 4-bit {method.upper()} checkpoints only")
    group_size = spec.get("group_size", spec.get("q_group_size"))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise CheckpointError(f"{source}: group_size must be a positive integer or -1, got {group_size!r}")
    if method == "awq":
        version = str(spec.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{source}: AWQ version {version!r} is not supported; loraplex loads 'gemm'")
        if spec.get("zero_point", True) is not True:
            raise CheckpointError(f"{source}: AWQ without zero points (zero_point false) is not supported")
        if group_size == -1:
            raise CheckpointError(f"{source}: AWQ needs a group_size, got -1")
        return PrequantizedFormat("awq", group_size, zero_offset=0)
    checkpoint_format = spec.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"{source}: GPTQ checkpoint_format {checkpoint_format!r} is not supported; loraplex loads 'gptq' and "
            "'gptq_v2'"
        )
    return PrequantizedFormat("gptq", group_size, zero_offset=1 if checkpoint_format == "gptq" else 0)


@dataclass(frozen=True)
class LoadedInt4:
    weight: Int4Weight
    # GPTQ act-order: the input features in group order; the layer computes x[:, input_order] @ weight^T. None when
    # the groups are already contiguous.
    input_order: torch.Tensor | None


def load_int4(tensors: CheckpointTensors, prefix: str, fmt: PrequantizedFormat, shape: tuple[int, int]) -> LoadedInt4:
    """The projection `prefix` (e.g. "model.layers.0.mlp.down_proj") of expected [out, in] `shape` as an Int4Weight,
    with the input order an act-order GPTQ projection needs."""
    out_features, in_features = shape
    group_size = in_features if fmt.group_size == -1 else fmt.group_size
    if in_features % group_size or group_size % 2:
        raise CheckpointError(
            f"'{prefix}': group_size {fmt.group_size} does not divide its {in_features} input features evenly"
        )
    if out_features % 8 or (fmt.method == "gptq" and in_features % 8):
        raise CheckpointError(f"'{prefix}': a {fmt.method.upper()} projection needs widths divisible by 8")
    groups = in_features // group_size
    nibble_order = None if fmt.method == "gptq" else AWQ_NIBBLE
    zeros = _unpack_columns(_int32(tensors, f"{prefix}.qzeros", (groups, out_features // 8)), nibble_order=nibble_order)
    input_order = None
    if fmt.method == "gptq":
        qweight = _int32(tensors, f"{prefix}.qweight", (in_features // 8, out_features))
        codes = _unpack_rows(qweight).reshape(in_features, out_features)  # [in, out]
        input_order = _act_order(tensors, prefix, in_features, group_size)
        if input_order is not None:
            codes = codes.index_select(0, input_order)  # the features of group 0 first, then group 1, ...
    else:
        qweight = _int32(tensors, f"{prefix}.qweight", (in_features, out_features // 8))
        codes = _unpack_columns(qweight, nibble_order=nibble_order)  # [in, out]
    scales = _float(tensors, f"{prefix}.scales", (groups, out_features))
    weight = Int4Weight(
        packed=pack_int4(codes.t().to(torch.uint8)),  # [out, in] codes, two a byte
        scales=scales.t().contiguous(),
        zeros=(zeros + fmt.zero_offset).t().to(torch.float32).contiguous(),
        group_size=group_size,
    )
    return LoadedInt4(weight, input_order)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8, C]: nibble j of each word, in order (GPTQ packs along rows)."""
    return (packed[:, None, :] >> _SHIFTS[None, :, None]) & 0xF


def _unpack_columns(packed: torch.Tensor, *, nibble_order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8 * C]: column 8 * c + j from nibble j (or nibble_order[j]) of word c."""
    nibbles = (packed[:, :, None] >> _SHIFTS[None, None, :]) & 0xF  # [R, C, 8] by nibble
    if nibble_order is not None:
        nibbles = nibbles[:, :, list(nibble_order)]
    return nibbles.reshape(packed.shape[0], -1)


def _act_order(tensors: CheckpointTensors, prefix: str, in_features: int, group_size: int) -> torch.Tensor | None:
    """None when g_idx is absent or k // group_size; for act-order (desc_act) checkpoints, whose g_idx assigns each
    group's features anywhere in the row, the input features sorted by group (stable), as int64."""
    name = f"{prefix}.g_idx"
    if name not in tensors.names:
        return None
    g_idx = tensors.get_shaped(name, (in_features,)).to(torch.int64)
    num_groups = in_features // group_size
    if torch.equal(g_idx, torch.arange(in_features) // group_size):
        return None
    in_range = bool(((g_idx >= 0) & (g_idx < num_groups)).all())
    if not in_range or not bool((torch.bincount(g_idx, minlength=num_groups) == group_size).all()):
        raise CheckpointError(f"'{name}' must give each of the {num_groups} groups exactly {group_size} input features")
    return torch.argsort(g_idx, stable=True)


def _int32(tensors: CheckpointTensors, name: str, shape: tuple[int, int]) -> torch.Tensor:
    tensor = tensors.get_shaped(name, shape)
    if tensor.dtype != torch.int32:
        raise CheckpointError(f"tensor '{name}' in {tensors.file_of(name)} has dtype {tensor.dtype}, expected int32")
    return tensor


def _float(tensors: CheckpointTensors, name: str, shape: tuple[int, int]) -> torch.Tensor:
    tensor = tensors.get_shaped(name, shape)
    if not tensor.is_floating_point():
        raise CheckpointError(f"tensor '{name}' in {tensors.file_of(name)} has dtype {tensor.dtype}, expected float")
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"tensor '{name}' in {tensors.file_of(name)} holds non-finite scales")
    return tensor.to(torch.float32)
