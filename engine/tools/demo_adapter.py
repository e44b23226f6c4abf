"""Random LoRA adapters in PEFT's on-disk format, for demos and benchmarks (no peft needed to write them).

The folder holds what PEFT's `save_pretrained` writes: adapter_config.json and adapter_model.safetensors with
PEFT's tensor names, so peft itself loads it as well as the engine does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.engine.lora.base_modules import MODULES, module_shape
from loraplex.engine.model.config import ModelConfig

_PREFIX = "base_model.model.model.layers"
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def write_random_adapter(
    path: str | os.PathLike[str],
    base: ModelConfig,
    *,
    rank: int,
    alpha: float | None = None,
    target_modules: Sequence[str] = MODULES,
    seed: int = 0,
    init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an adapter of `rank` on `target_modules` of every layer of `base`, with normal(0, init_std) A and B."""
    if rank < 1:
        raise ValueError("rank must be at least 1")
    unknown = set(target_modules) - set(MODULES)
    if unknown:
        raise ValueError(f"unknown target modules: {sorted(unknown)}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base.num_layers):
        for module in target_modules:
            in_features, out_features = module_shape(base, module)
            name = f"{_PREFIX}.{layer}.{_PARENT.get(module, 'mlp')}.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator) * init_std).to(
                dtype
            )
            tensors[f"{name}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * init_std).to(
                dtype
            )
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
