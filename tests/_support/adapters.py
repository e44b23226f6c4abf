"""Random PEFT LoRA adapters made with peft itself, for engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# PEFT LoraConfigs of a range of adapters: mixed ranks and targets, rsLoRA, alpha != r, rank and alpha patterns, one
# layer only.
ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "r8-attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "r16-all": {"r": 16, "lora_alpha": 8, "target_modules": "all-linear"},
    "r64-all-rslora": {"r": 64, "lora_alpha": 32, "target_modules": "all-linear", "use_rslora": True},
    "r8-mlp": {"r": 8, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "pattern": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "rank_pattern": {"model.layers.1.self_attn.q_proj": 4},
        "alpha_pattern": {"down_proj": 64},
    },
    "layer0-only": {"r": 16, "lora_alpha": 24, "target_modules": ["q_proj", "o_proj"], "layers_to_transform": [0]},
    "r32-qk": {"r": 32, "lora_alpha": 7, "target_modules": ["q_proj", "k_proj"]},
    "r4-all": {"r": 4, "lora_alpha": 4, "target_modules": "all-linear"},
}


def make_peft_adapter(base_dir: Path, out_dir: Path, *, seed: int, **lora_config: Any) -> Path:
    """Save a LoRA adapter for the model in `base_dir` with random A and B (PEFT's init leaves B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_config)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def peft_logits(base_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of the base model with the adapter applied (or none), in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([token_ids])).logits[0].float()
    return logits
