"""FP8 checkpoints as they ship, read into Fp8Weight (kernels/quant_fp8.py) at load, without a conversion step.

What a checkpoint says (config.json's `quantization_config`) and what each quantized projection holds beside its
`weight` (float8_e4m3fn [out, in]), for W [out, in]:

    quant_method "fp8" (transformers' FP8 and fine-grained FP8, vLLM / AutoFP8 checkpoints)
        weight_block_size [bo, bi]   weight_scale_inv float32 [ceil(out / bo), ceil(in / bi)]
                                     W[n, k] = weight[n, k] * weight_scale_inv[n // bo, k // bi]
        no weight_block_size         weight_scale float32 [] or [1]: W = weight * weight_scale (per tensor)
        activation_scheme "dynamic" | "static" (static: input_scale float32 [] or [1] beside the weight)
    quant_method "compressed-tensors", format "float-quantized" (llm-compressor's FP8, FP8-dynamic and FP8-block)
        config_groups: one scheme for the Linear layers, weights {num_bits: 8, type: float, strategy: tensor |
        channel | block (block_structure [bo, bi])}, input_activations {dynamic, strategy} or none
        weight_scale float32: [1] (tensor), [out, 1] (channel), [ceil(out / bo), ceil(in / bi)] (block)
        `ignore` names modules left in 16 bits (lm_head, usually): their weight is a 16/32-bit tensor

A projection whose `weight` is 16/32-bit (an ignored module) loads as a float one. The activations' scales
(input_scale of static schemes) are checked and not used: the matmul keeps activations in the model's dtype
(kernels/quant_fp8.py), which is at least as exact as rounding them to FP8. Refused, naming the field: e5m2
weights, other bit widths and types, integer schemes of compressed-tensors (served as GPTQ/AWQ where they are),
more than one scheme, and a block-wise scale whose blocks a fused projection's parts do not tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from loraplex.engine.errors import CheckpointError
from loraplex.kernels.quant_fp8 import FP8_DTYPE, Fp8Weight

if TYPE_CHECKING:
    from loraplex.engine.model.weights import CheckpointTensors

FP8_METHODS = ("fp8", "compressed-tensors")
Granularity = Literal["tensor", "channel", "block"]

_SOURCE = "config.json field 'quantization_config'"


@dataclass(frozen=True)
class Fp8Format:
    method: Literal["fp8", "compressed-tensors"]
    granularity: Granularity
    block: tuple[int, int] | None  # (rows, columns) per scale, block-wise only
    static_activations: bool  # an input_scale per projection (checked, not used)

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" and self.granularity == "block" else "weight_scale"


def read_fp8_format(raw_config: dict[str, Any]) -> Fp8Format | None:
    """The checkpoint's FP8 scheme, or None when it has none; CheckpointError for an FP8-family config loraplex does
    not load."""
    spec = raw_config.get("quantization_config")
    if not isinstance(spec, dict) or spec.get("quant_method") not in FP8_METHODS:
        return None
    if spec["quant_method"] == "fp8":
        return _read_fp8(spec)
    return _read_compressed_tensors(spec)


def _read_fp8(spec: dict[str, Any]) -> Fp8Format:
    fmt = spec.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{_SOURCE}: fmt {fmt!r} is not supported; loraplex loads e4m3 FP8 weights")
    scheme = spec.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(f"{_SOURCE}: activation_scheme {scheme!r}; expected 'dynamic' or 'static'")
    block = spec.get("weight_block_size")
    if block is None:
        return Fp8Format("fp8", "tensor", None, scheme == "static")
    return Fp8Format("fp8", "block", _block(block, "weight_block_size"), scheme == "static")


def _read_compressed_tensors(spec: dict[str, Any]) -> Fp8Format:
    fmt = spec.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise CheckpointError(
            f"{_SOURCE}: compressed-tensors format {fmt!r} is not supported; loraplex loads 'float-quantized' (FP8)"
        )
    groups = spec.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise CheckpointError(f"{_SOURCE}: config_groups must hold one scheme; loraplex loads one FP8 scheme per model")
    ((name, scheme),) = groups.items()
    where = f"{_SOURCE} config_groups.{name}"
    if not isinstance(scheme, dict):
        raise CheckpointError(f"{where} must be an object")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where}.weights must be an object")
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise CheckpointError(
            f"{where}.weights: num_bits {weights.get('num_bits')!r}, type {weights.get('type')!r}; loraplex loads "
            "8-bit float (FP8) weights from compressed-tensors"
        )
    if weights.get("dynamic") is True:
        raise CheckpointError(f"{where}.weights.dynamic is true; FP8 weights need their stored scales")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "block"):
        raise CheckpointError(
            f"{where}.weights.strategy {strategy!r} is not supported; loraplex loads tensor, channel and block"
        )
    activations = scheme.get("input_activations")
    if activations is not None and not isinstance(activations, dict):
        raise CheckpointError(f"{where}.input_activations must be an object or null")
    static = bool(activations) and activations.get("dynamic") is False  # type: ignore[union-attr]
    block = _block(weights.get("block_structure"), "block_structure") if strategy == "block" else None
    return Fp8Format("compressed-tensors", strategy, block, static)


def _block(value: Any, field: str) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise CheckpointError(f"{_SOURCE}: {field} must be two positive integers, got {value!r}")
    return (value[0], value[1])


def load_fp8(tensors: CheckpointTensors, prefix: str, fmt: Fp8Format, shape: tuple[int, int]) -> Fp8Weight | None:
    """The projection `prefix` (e.g. "model.layers.0.mlp.down_proj") of [out, in] `shape` as an Fp8Weight with
    row-expanded scales; None when its weight is 16/32-bit (a module the checkpoint left unquantized)."""
    out_features, in_features = shape
    weight = tensors.get_shaped(f"{prefix}.weight", shape)
    if weight.dtype != FP8_DTYPE:
        if weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return None
        raise CheckpointError(
            f"tensor '{prefix}.weight' in {tensors.file_of(prefix + '.weight')} has dtype {weight.dtype}; an FP8 "
            f"checkpoint's quantized weights are {FP8_DTYPE} (e4m3)"
        )
    scale_name = f"{prefix}.{fmt.scale_name}"
    if fmt.granularity == "block":
        assert fmt.block is not None
        rows, cols = fmt.block
        scale_shape = (-(-out_features // rows), -(-in_features // cols))
        scales = _scales(tensors, scale_name, [scale_shape])
        row_scales = scales.repeat_interleave(rows, dim=0)[:out_features]
        weight_fp8 = Fp8Weight(weight.contiguous(), row_scales.contiguous(), cols)
    else:
        shapes: list[tuple[int, ...]] = [(), (1,)] if fmt.granularity == "tensor" else [(out_features, 1)]
        scales = _scales(tensors, scale_name, shapes).reshape(-1, 1)
        weight_fp8 = Fp8Weight(weight.contiguous(), scales.expand(out_features, 1).contiguous(), in_features)
    if fmt.static_activations:
        _scales(tensors, f"{prefix}.input_scale", [(), (1,)])
    return weight_fp8


def _scales(tensors: CheckpointTensors, name: str, shapes: list[tuple[int, ...]]) -> torch.Tensor:
    """A float scale tensor of one of `shapes`, finite and not negative."""
    if name not in tensors.names:
        raise CheckpointError(f"the FP8 checkpoint has no tensor '{name}'")
    tensor = tensors.get(name)
    if tuple(tensor.shape) not in shapes or not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE:
        expected = " or ".join(str(list(s)) for s in shapes)
        raise CheckpointError(
            f"tensor '{name}' in {tensors.file_of(name)} is {tensor.dtype} {list(tensor.shape)}; expected a float "
            f"scale of shape {expected}"
        )
    tensor = tensor.float()
    if not bool(torch.isfinite(tensor).all()) or not bool((tensor >= 0).all()):
        raise CheckpointError(f"tensor '{name}' in {tensors.file_of(name)} holds scales that are not finite and >= 0")
    return tensor
