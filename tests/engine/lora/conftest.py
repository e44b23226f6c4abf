"""A tiny random Llama base (GQA) and real PEFT adapters on it, saved with save_pretrained into temp folders."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save

from loraplex.engine.model.config import ModelConfig

NUM_LAYERS = 3


@dataclass
class Base:
    config: ModelConfig
    model: Any  # transformers LlamaForCausalLM, never adapted itself (adapters go on deep copies)


@dataclass
class PeftAdapter:
    path: Path
    peft_model: Any

    @property
    def config_bytes(self) -> bytes:
        return (self.path / "adapter_config.json").read_bytes()

    @property
    def weights_bytes(self) -> bytes:
        return (self.path / "adapter_model.safetensors").read_bytes()


@pytest.fixture(scope="session")
def base() -> Base:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).to(torch.float32).eval()
    return Base(ModelConfig.from_dict(hf_config.to_dict()), model)


@pytest.fixture(scope="session")
def make_peft_adapter(base: Base, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., PeftAdapter]:
    """make_peft_adapter(**LoraConfig kwargs) -> a saved adapter with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model

    def make(**lora_kwargs: Any) -> PeftAdapter:
        torch.manual_seed(1)
        with warnings.catch_warnings():
            # peft 0.21 calls a transformers 5 method that warns about its own deprecation.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            peft_model = get_peft_model(copy.deepcopy(base.model), LoraConfig(init_lora_weights=False, **lora_kwargs))
        path = tmp_path_factory.mktemp("adapter")
        peft_model.save_pretrained(path)
        return PeftAdapter(path, peft_model)

    return make


@pytest.fixture(scope="session")
def reference_adapter(make_peft_adapter: Callable[..., PeftAdapter]) -> PeftAdapter:
    """q, k, v and up_proj in every layer, r=8: the starting point of the failure tests."""
    return make_peft_adapter(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"])


@dataclass
class Files:
    """An adapter as editable values; encode() gives the two files' bytes."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def encode(self) -> tuple[bytes, bytes]:
        return json.dumps(self.config).encode(), save(self.tensors, metadata={"format": "pt"})


@pytest.fixture
def files(reference_adapter: PeftAdapter) -> Files:
    from safetensors.torch import load

    config = json.loads(reference_adapter.config_bytes)
    return Files(config, load(reference_adapter.weights_bytes))
