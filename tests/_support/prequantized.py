"""Pre-quantized (GPTQ / AWQ 4-bit) checkpoints written from a float one, with their dequantized twin, for the
engine's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: word nibble i holds column ORDER[i]


def _signed32(values: torch.Tensor) -> torch.Tensor:
    return (((values + 2**31) % 2**32) - 2**31).to(torch.int32)


def _rtn(
    weight: torch.Tensor, g_idx: torch.Tensor, group_size: int, min_zero: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes [in, out], scales [G, out] (half), zeros [G, out] (ints) of a [out, in] float weight
    whose input feature k belongs to group g_idx[k]; zero points from `min_zero` up (GPTQ's original format stores
    zero - 1 in 4 bits, so it cannot hold 0)."""
    out_features, in_features = weight.shape
    w = weight.t()  # [in, out]
    by_group = w[torch.argsort(g_idx, stable=True)].reshape(in_features // group_size, group_size, out_features)
    low, high = by_group.amin(1).clamp(max=0), by_group.amax(1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-8).half()
    zeros = torch.round(-low / scales.float()).clamp(min_zero, 15)
    codes = (torch.round(w / scales.float()[g_idx]) + zeros[g_idx]).clamp(0, 15)
    return codes.long(), scales, zeros.long()


def _input_of(name: str) -> str:
    """The input a projection reads: q, k and v read the attention's, gate and up the MLP's, o and down their own."""
    block, module = name.rsplit(".", 2)[0], name.split(".")[-2]
    shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    return f"{block}.{shared.get(module, module)}"


def _pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    in_features, out_features = codes.shape
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int64)
    for j in range(8):
        qweight |= codes[j::8] << (4 * j)
    stored = zeros - zero_offset
    qzeros = torch.zeros(zeros.shape[0], out_features // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= (stored[:, j::8] & 0xF) << (4 * j)
    return _signed32(qweight), _signed32(qzeros)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    rows, columns = values.shape
    packed = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_PACK_ORDER):
        packed |= values[:, column::8] << (4 * i)
    return _signed32(packed)


def write_prequantized(
    source: Path,
    target: Path,
    method: str,
    group_size: int,
    *,
    checkpoint_format: str = "gptq",
    act_order: bool = False,
) -> Path:
    """`target`: source's checkpoint with its layers' projections in `method`'s 4-bit format; `target`/dequantized:
    the same values as a float32 checkpoint. `act_order`: GPTQ's desc_act, each group drawn from a random order of
    the input features, one order per input (q, k and v share theirs, as do gate and up: GPTQ orders by the
    input's Hessian)."""
    orders: dict[str, torch.Tensor] = {}
    dequantized = target / "dequantized"
    dequantized.mkdir(parents=True)
    tensors = load_file(source / "model.safetensors")
    float_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith("_proj.weight") and n.split(".")[-2] in PROJECTIONS]:
        weight = tensors.pop(name)
        prefix = name.removesuffix(".weight")
        size = weight.shape[1] if group_size == -1 else group_size
        offset = 1 if method == "gptq" and checkpoint_format == "gptq" else 0
        groups = torch.arange(weight.shape[1]) // size
        if act_order:
            seed = torch.Generator().manual_seed(len(orders))
            order = orders.setdefault(_input_of(name), torch.randperm(weight.shape[1], generator=seed))
            groups = torch.empty_like(groups)
            groups[order] = torch.arange(weight.shape[1]) // size  # feature order[j] is in group j // size
        codes, scales, zeros = _rtn(weight.float(), groups, size, min_zero=offset)
        float_tensors[name] = ((codes - zeros[groups]) * scales.float()[groups]).t().contiguous()
        if method == "gptq":
            tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = _pack_gptq(codes, zeros, offset)
            tensors[f"{prefix}.g_idx"] = groups.to(torch.int32)
        else:
            tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = _pack_awq(codes), _pack_awq(zeros)
        tensors[f"{prefix}.scales"] = scales
    for folder in (target, dequantized):
        for file in source.iterdir():
            if file.is_file() and file.name != "model.safetensors":
                (folder / file.name).write_bytes(file.read_bytes())
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    save_file(float_tensors, dequantized / "model.safetensors", metadata={"format": "pt"})
    if method == "gptq":
        spec: dict[str, Any] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": checkpoint_format,
        }
    else:
        spec = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    edit_config(target, quantization_config=spec)
    return target


def edit_config(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    for key, value in fields.items():
        if value is None:
            del config[key]
    (folder / "config.json").write_text(json.dumps(config))
