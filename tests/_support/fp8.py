"""FP8 checkpoints written from a float one in the layouts they ship in, with their dequantized twin, for the
engine's tests. Plain torch only (no loraplex code), as a producer (transformers' FP8 integration, AutoFP8,
llm-compressor) would write them:

    "fp8-block"       quant_method fp8, weight_block_size [bo, bi]: weight float8_e4m3fn, weight_scale_inv
                      [ceil(out / bo), ceil(in / bi)] (transformers' fine-grained FP8, Qwen3-*-FP8, DeepSeek)
    "fp8-tensor"      quant_method fp8, static activations: weight_scale [] and input_scale [] (AutoFP8)
    "ct-channel"      compressed-tensors float-quantized, channel weights, dynamic per-token activations:
                      weight_scale [out, 1] (llm-compressor's FP8_DYNAMIC)
    "ct-tensor"       compressed-tensors, tensor weights, static tensor activations: weight_scale [1],
                      input_scale [1] (llm-compressor's FP8)
    "ct-block"        compressed-tensors, block weights [bo, bi]: weight_scale [ceil(out / bo), ceil(in / bi)]
                      (llm-compressor's FP8_BLOCK)

Every decoder projection is quantized; lm_head stays float (the `ignore` / `modules_to_not_convert` every producer
defaults to) unless `quantize_lm_head`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LAYOUTS = ("fp8-block", "fp8-tensor", "ct-channel", "ct-tensor", "ct-block")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def _quantized(name: str, quantize_lm_head: bool) -> bool:
    if name == "lm_head.weight":
        return quantize_lm_head
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def _block_scales(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax / 448 of each [bo, bi] block (the last ones partial): [ceil(out / bo), ceil(in / bi)]."""
    out_features, in_features = weight.shape
    bo, bi = block
    rows, cols = math.ceil(out_features / bo), math.ceil(in_features / bi)
    padded = torch.zeros(rows * bo, cols * bi)
    padded[:out_features, :in_features] = weight.abs()
    amax = padded.view(rows, bo, cols, bi).amax(dim=(1, 3))
    return (amax / FP8_MAX).clamp(min=1e-12)


def _expand(scales: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    bo, bi = block
    return scales.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: shape[0], : shape[1]]


def _quantize(weight: torch.Tensor, layout: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, the scale tensor as the layout stores it) of a float weight [out, in]."""
    w = weight.float()
    if layout.endswith("block"):
        scales = _block_scales(w, block)
        expanded = _expand(scales, block, w.shape)
    elif layout == "ct-channel":
        scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [out, 1]
        expanded = scales
    else:
        scales = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
        expanded = scales
        scales = scales.reshape(1) if layout == "ct-tensor" else scales.reshape(())
    codes = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scales.float()


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, layout: str, block: tuple[int, int]) -> torch.Tensor:
    values = codes.float()
    if layout.endswith("block"):
        return values * _expand(scales, block, values.shape)
    return values * (scales if scales.dim() == 2 else scales.reshape(()))


def _quantization_config(layout: str, block: tuple[int, int], quantize_lm_head: bool) -> dict[str, Any]:
    if layout == "fp8-block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(block),
            "modules_to_not_convert": [] if quantize_lm_head else ["lm_head"],
        }
    if layout == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    strategy = layout.removeprefix("ct-")
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": strategy,
        "group_size": None,
        "block_structure": list(block) if strategy == "block" else None,
    }
    activations: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True}
    if layout == "ct-tensor":
        activations |= {"dynamic": False, "strategy": "tensor"}
    else:
        activations |= {"dynamic": True, "strategy": "token" if strategy == "channel" else "group", "group_size": 128}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": [] if quantize_lm_head else ["lm_head"],
    }


def write_fp8(
    source: Path,
    target: Path,
    layout: str,
    *,
    block: tuple[int, int] = (128, 128),
    quantize_lm_head: bool = False,
) -> Path:
    """`target`: source's checkpoint with its projections in FP8 as `layout` stores them; `target`/dequantized: the
    same values as a float32 checkpoint."""
    assert layout in LAYOUTS, layout
    target.mkdir(parents=True, exist_ok=True)
    dequantized = target / "dequantized"
    dequantized.mkdir()
    tensors = load_file(source / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    static = layout in ("fp8-tensor", "ct-tensor")
    for name, tensor in tensors.items():
        if not _quantized(name, quantize_lm_head):
            quantized[name] = tensor
            reference[name] = tensor.float()
            continue
        prefix = name.removesuffix(".weight")
        codes, scales = _quantize(tensor, layout, block)
        quantized[name] = codes
        quantized[f"{prefix}.weight_scale_inv" if layout == "fp8-block" else f"{prefix}.weight_scale"] = scales
        if static:  # a calibrated activation scale: what the producer measured; the engine checks it
            quantized[f"{prefix}.input_scale"] = torch.tensor(0.02).reshape(() if layout == "fp8-tensor" else (1,))
        reference[name] = _dequantized(codes, scales, layout, block)
    save_file(quantized, target / "model.safetensors", metadata={"format": "pt"})
    save_file(reference, dequantized / "model.safetensors", metadata={"format": "pt"})
    for file in source.iterdir():
        if file.is_file() and file.name != "model.safetensors":
            shutil.copy(file, target / file.name)
            shutil.copy(file, dequantized / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(layout, block, quantize_lm_head)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
