"""LoraAdapterConfig selects modules and ranks exactly as PEFT does, checked against PEFT's own functions."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.lora import (
    MODULES,
    AdapterConfigError,
    AdapterError,
    LoraAdapterConfig,
    UnsupportedAdapterFeature,
    module_key,
)
from loraplex.engine.lora.base_modules import EMBEDDING_MODULES

pytestmark = pytest.mark.unit

KEYS = [module_key(layer, module) for layer in range(3) for module in MODULES]

NAMES = [
    "q_proj",
    "v_proj",
    "down_proj",
    "self_attn.k_proj",
    "mlp.up_proj",
    "model.layers.1.self_attn.o_proj",
    "layers.2.mlp.gate_proj",
    "proj",
    "c_attn",
]
REGEXES = [r".*\.(q|v)_proj", r"model\.layers\.[02]\..*", r".*mlp.*proj", "q_proj", r".*\.1\.self_attn\..*"]
PATTERN_KEYS = [
    "q_proj",
    "layers.1.self_attn.q_proj",
    r"model\.layers\.\d\.mlp\..*",
    "proj",
    "self_attn.(q|k)_proj",
    "^model.layers.0.self_attn.v_proj",
    r"layers\.2\..*",
    "mlp",
]

targets = st.lists(st.sampled_from(NAMES), max_size=4, unique=True) | st.sampled_from(REGEXES)
excludes = st.none() | st.lists(st.sampled_from(NAMES), max_size=2, unique=True) | st.sampled_from(REGEXES)
layers = st.none() | st.integers(0, 3) | st.lists(st.integers(0, 3), max_size=3, unique=True)
layer_patterns = st.none() | st.sampled_from(["layers", "model", ["blocks", "layers"], "h"])
patterns = st.dictionaries(st.sampled_from(PATTERN_KEYS), st.integers(1, 32), max_size=3)


def peft_targets(peft_config: Any, key: str) -> bool:
    from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists

    result = check_target_module_exists(peft_config, key)
    return bool(result) and not isinstance(result, _ExcludedModule)


@settings(max_examples=300, deadline=None)
@given(targets, excludes, layers, layer_patterns, patterns, patterns)
def test_module_selection_ranks_and_alphas_match_peft(
    target_modules: Any,
    exclude_modules: Any,
    layers_to_transform: Any,
    layers_pattern: Any,
    rank_pattern: dict[str, int],
    alpha_pattern: dict[str, int],
) -> None:
    from peft import LoraConfig
    from peft.utils.other import get_pattern_key

    if isinstance(target_modules, str):
        layers_to_transform = layers_pattern = None  # PEFT refuses both with a regex
    if layers_to_transform is None:
        layers_pattern = None  # PEFT refuses layers_pattern alone
    fields = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": target_modules,
        "exclude_modules": exclude_modules,
        "layers_to_transform": layers_to_transform,
        "layers_pattern": layers_pattern,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    peft_config = LoraConfig(**fields)
    if any(peft_targets(peft_config, name) for name in EMBEDDING_MODULES):
        with pytest.raises(UnsupportedAdapterFeature, match="target_modules"):
            LoraAdapterConfig.parse(json.dumps({"peft_type": "LORA", **fields}).encode())
        return
    ours = LoraAdapterConfig.parse(json.dumps({"peft_type": "LORA", **fields}).encode())
    for key in KEYS:
        assert ours.targets(key) == peft_targets(peft_config, key), key
        assert ours.rank_for(key) == rank_pattern.get(get_pattern_key(rank_pattern.keys(), key), 8), key
        assert ours.alpha_for(key) == alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), key), 16), key


def parse(**fields: Any) -> LoraAdapterConfig:
    return LoraAdapterConfig.parse(json.dumps({"peft_type": "LORA", **fields}).encode())


def test_defaults_are_peft_defaults() -> None:
    config = parse()
    assert (config.r, config.lora_alpha, config.use_rslora) == (8, 8.0, False)
    assert [key for key in KEYS if config.targets(key)] == [
        module_key(layer, module) for layer in range(3) for module in ("q_proj", "v_proj")
    ]


def test_all_linear_selects_every_projection() -> None:
    config = parse(target_modules="ALL-LINEAR")
    assert all(config.targets(key) for key in KEYS)
    assert not config.targets("lm_head")


def test_scaling_uses_the_module_rank_and_alpha() -> None:
    config = parse(r=16, lora_alpha=32, rank_pattern={"q_proj": 4}, alpha_pattern={"q_proj": 2})
    assert config.scaling_for(module_key(0, "q_proj")) == 2 / 4
    assert config.scaling_for(module_key(0, "v_proj")) == 32 / 16
    rslora = parse(r=16, lora_alpha=32, use_rslora=True, rank_pattern={"q_proj": 4})
    assert rslora.scaling_for(module_key(0, "q_proj")) == 32 / 2
    assert rslora.scaling_for(module_key(0, "v_proj")) == 32 / 4


def test_harmless_fields_and_unset_unknown_fields_are_accepted() -> None:
    parse(
        base_model_name_or_path="/home/trainer/llama",
        revision="main",
        inference_mode=True,
        task_type="CAUSAL_LM",
        lora_dropout=0.1,
        init_lora_weights="gaussian",
        auto_mapping={"base_model_class": "LlamaForCausalLM", "parent_library": "transformers.models.llama"},
        some_future_field=None,
        another_future_flag=False,
    )


def test_full_module_names_with_layers_to_transform_past_peft_condensing_are_refused() -> None:
    names = [key for key in KEYS if not key.endswith("o_proj")]  # 18 names + 2 below = PEFT's threshold of 20
    names += [module_key(5, "q_proj"), module_key(6, "q_proj")]
    with pytest.raises(AdapterConfigError, match="'target_modules'"):
        parse(target_modules=names, layers_to_transform=[0])
    parse(target_modules=names)


def test_too_many_pattern_entries_are_refused() -> None:
    with pytest.raises(AdapterConfigError, match="'rank_pattern'"):
        parse(rank_pattern={f"layers.{i}.q_proj": 4 for i in range(5000)})


def test_too_much_regex_work_in_all_is_refused() -> None:
    many = {f".*a{i}.*b.*": 4 for i in range(12)}
    with pytest.raises(AdapterConfigError, match="repetitions in all"):
        parse(rank_pattern=many)


@pytest.mark.parametrize("pattern", ["(a+)+b", "(.*)*x", "(a|aa)*c", r"(\w+\.?)+!", "(x+x+)+y"])
def test_catastrophic_regexes_are_refused_quickly(pattern: str) -> None:
    start = time.perf_counter()
    with pytest.raises(AdapterConfigError, match="could take very long"):
        parse(target_modules=pattern)
    assert time.perf_counter() - start < 0.5


def test_the_worst_accepted_regex_matches_quickly() -> None:
    config = parse(
        target_modules=r".*.*.*q_proj", rank_pattern={".*.*.*z": 4}, alpha_pattern={"[a-z.]*[a-z.0-9]*[0-9_a-z]*Z": 2}
    )
    names = [module_key(layer, module) for layer in range(80) for module in MODULES]
    start = time.perf_counter()
    for name in names:
        config.targets(name)
        config.rank_for(name)
        config.alpha_for(name)
    assert time.perf_counter() - start < 2.0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=10,
)
FIELDS = [
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "init_lora_weights",
    "auto_mapping",
    "bias",
    "fan_in_fan_out",
    "use_dora",
]


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), JSON_VALUES, max_size=6), st.booleans())
def test_any_json_config_parses_or_raises_an_adapter_error(fields: dict[str, Any], lora: bool) -> None:
    if lora:
        fields["peft_type"] = "LORA"
    try:
        config = LoraAdapterConfig.parse(json.dumps(fields).encode())
    except AdapterError:
        return
    for key in KEYS:
        config.targets(key)
        assert config.rank_for(key) >= 1
        assert math.isfinite(config.scaling_for(key))
