"""parse_adapter on real PEFT adapters: the same modules PEFT adapts, and b @ a equal to PEFT's delta weight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load, save

from loraplex.engine.lora import MODULES, LoraAdapter, module_shape, parse_adapter, read_adapter_dir
from loraplex.engine.model.layers.rope import interleave_rotary_rows

# The fixtures' types (tests/engine/lora/conftest.py); conftest modules cannot be imported by name here.
Base = Any
PeftAdapter = Any

pytestmark = pytest.mark.unit

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CASES: dict[str, dict[str, Any]] = {
    "attention-only": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "all-linear": {"r": 16, "lora_alpha": 8, "target_modules": "all-linear"},
    "regex": {"r": 8, "lora_alpha": 8, "target_modules": r".*\.(q_proj|v_proj|down_proj)"},
    "regex-one-layer": {"r": 8, "lora_alpha": 4, "target_modules": r"model\.layers\.1\.(self_attn|mlp)\.\w+_proj"},
    "layers-to-transform": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "gate_proj"],
        "layers_to_transform": [0, 2],
    },
    "layers-pattern": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["k_proj", "down_proj"],
        "layers_to_transform": 1,
        "layers_pattern": "layers",
    },
    "rslora-rank-64": {
        "r": 64,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["q_proj", "k_proj", "up_proj"],
    },
    "rank-and-alpha-pattern": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ALL,
        "rank_pattern": {"model.layers.1.self_attn.q_proj": 4, "down_proj": 8},
        "alpha_pattern": {"k_proj": 7, r"layers\.2\.mlp\.up_proj": 64},
    },
    "exclude-modules": {
        "r": 8,
        "lora_alpha": 8,
        "target_modules": "all-linear",
        "exclude_modules": ["o_proj", "up_proj"],
    },
    "full-module-names": {
        "r": 8,
        "lora_alpha": 8,
        "target_modules": ["model.layers.0.self_attn.v_proj", "model.layers.2.mlp.gate_proj"],
    },
}


def peft_deltas(peft_adapter: PeftAdapter) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> PEFT's own delta weight [out, in] for every module PEFT put a LoRA layer on."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in peft_adapter.peft_model.base_model.model.named_modules():
        if isinstance(module, LoraLayer):
            parts = name.split(".")  # model.layers.{i}.{block}.{module}
            deltas[int(parts[2]), parts[4]] = module.get_delta_weight("default").detach()
    return deltas


def in_engine_row_order(delta: torch.Tensor, module: str, base: Base) -> torch.Tensor:
    if module == "q_proj":
        return interleave_rotary_rows(delta, base.config.num_heads, base.config.head_dim)
    if module == "k_proj":
        return interleave_rotary_rows(delta, base.config.num_kv_heads, base.config.head_dim)
    return delta


def check_against_peft(adapter: LoraAdapter, peft_adapter: PeftAdapter, base: Base) -> None:
    deltas = peft_deltas(peft_adapter)
    assert set(adapter.modules) == set(deltas)
    for (layer, module), lora in adapter.modules.items():
        in_features, out_features = module_shape(base.config, module)
        assert lora.a.shape == (lora.rank, in_features)
        assert lora.b.shape == (out_features, lora.rank)
        expected = in_engine_row_order(deltas[layer, module], module, base)
        torch.testing.assert_close(lora.b @ lora.a, expected, atol=1e-6, rtol=0, msg=f"{layer} {module}")


@pytest.mark.parametrize("case", CASES)
def test_modules_and_deltas_match_peft(case: str, make_peft_adapter: Callable[..., PeftAdapter], base: Base) -> None:
    peft_adapter = make_peft_adapter(**CASES[case])
    adapter = parse_adapter(*read_adapter_dir(peft_adapter.path), base.config)
    check_against_peft(adapter, peft_adapter, base)


def test_ranks_scalings_and_helpers_follow_the_patterns(
    make_peft_adapter: Callable[..., PeftAdapter], base: Base
) -> None:
    peft_adapter = make_peft_adapter(**CASES["rank-and-alpha-pattern"])
    adapter = parse_adapter(peft_adapter.config_bytes, peft_adapter.weights_bytes, base.config)
    assert adapter.ranks[1, "q_proj"] == 4
    assert adapter.modules[1, "q_proj"].scaling == 32 / 4
    assert adapter.ranks[0, "q_proj"] == 16
    assert adapter.ranks[0, "down_proj"] == 8
    assert adapter.modules[0, "k_proj"].scaling == 7 / 16
    assert adapter.modules[2, "up_proj"].scaling == 64 / 16
    assert adapter.modules[1, "up_proj"].scaling == 32 / 16
    assert adapter.max_rank == 16
    assert adapter.layers == (0, 1, 2)
    assert len(adapter.modules) == len(MODULES) * 3
    assert adapter.num_bytes == sum(4 * (m.a.numel() + m.b.numel()) for m in adapter.modules.values())


def test_rslora_scales_by_the_square_root_of_the_rank(
    make_peft_adapter: Callable[..., PeftAdapter], base: Base
) -> None:
    peft_adapter = make_peft_adapter(**CASES["rslora-rank-64"])
    adapter = parse_adapter(peft_adapter.config_bytes, peft_adapter.weights_bytes, base.config)
    assert {m.scaling for m in adapter.modules.values()} == {16 / 8}
    assert adapter.max_rank == 64


def test_layers_to_transform_limits_the_layers(make_peft_adapter: Callable[..., PeftAdapter], base: Base) -> None:
    peft_adapter = make_peft_adapter(**CASES["layers-to-transform"])
    adapter = parse_adapter(peft_adapter.config_bytes, peft_adapter.weights_bytes, base.config)
    assert adapter.layers == (0, 2)


def test_the_default_spelling_of_keys_is_accepted(reference_adapter: PeftAdapter, base: Base) -> None:
    tensors = load(reference_adapter.weights_bytes)
    renamed = {name.replace(".weight", ".default.weight"): tensor for name, tensor in tensors.items()}
    adapter = parse_adapter(reference_adapter.config_bytes, save(renamed), base.config)
    check_against_peft(adapter, reference_adapter, base)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_are_cast_to_the_serving_dtype(dtype: torch.dtype, reference_adapter: PeftAdapter, base: Base) -> None:
    reference = parse_adapter(reference_adapter.config_bytes, reference_adapter.weights_bytes, base.config)
    cast = parse_adapter(reference_adapter.config_bytes, reference_adapter.weights_bytes, base.config, dtype=dtype)
    for module_id, lora in cast.modules.items():
        assert lora.a.dtype == lora.b.dtype == dtype
        torch.testing.assert_close(lora.b.float(), reference.modules[module_id].b, atol=1e-2, rtol=1e-2)
    assert cast.num_bytes == reference.num_bytes // 2


def test_half_precision_files_are_read(reference_adapter: PeftAdapter, base: Base) -> None:
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in load(reference_adapter.weights_bytes).items()}
    adapter = parse_adapter(reference_adapter.config_bytes, save(tensors), base.config)
    reference = parse_adapter(reference_adapter.config_bytes, reference_adapter.weights_bytes, base.config)
    for module_id, lora in adapter.modules.items():
        torch.testing.assert_close(lora.a, reference.modules[module_id].a, atol=1e-2, rtol=1e-2)
