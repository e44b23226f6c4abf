"""Random PEFT LoRA adapters made with peft itself, for engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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
