"""parse_adapter refuses what it cannot serve, with the error class and a message that names the culprit."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.lora import (
    AdapterConfigError,
    AdapterError,
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterValueError,
    UnsupportedAdapterFeature,
    parse_adapter,
)

pytestmark = pytest.mark.unit

Base = Any  # fixture types from conftest.py
Files = Any

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
V1 = "base_model.model.model.layers.1.self_attn.v_proj"


def refused(files: Files, base: Base, error: type[AdapterError], *culprits: str, **kwargs: Any) -> AdapterError:
    """Parse, expect `error`, and check the message names every culprit."""
    with pytest.raises(error) as caught:
        parse_adapter(*files.encode(), base.config, **kwargs)
    message = str(caught.value)
    for culprit in culprits:
        assert culprit in message, message
    return caught.value


def test_the_unmodified_reference_files_parse(files: Files, base: Base) -> None:
    adapter = parse_adapter(*files.encode(), base.config)
    assert len(adapter.modules) == 4 * 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("lora_bias", True),
        ("trainable_token_indices", [1, 2]),
        ("layer_replication", [[0, 2]]),
        ("alora_invocation_tokens", [5, 6]),
        ("use_qalora", True),
        ("megatron_config", {"tensor_model_parallel_size": 2}),
        ("velora_config", {"num_groups": 4}),
        ("monteclora_config", {"num_samples": 2}),
        ("kasa_config", {"beta": 1e-4}),
        ("arrow_config", {"top_k": 2}),
        ("use_bdlora", {"lora_a_is_blockdiagonal": True}),
        ("a_feature_from_a_newer_peft", True),
        ("peft_type", "IA3"),
        ("bias", "all"),
        ("bias", "lora_only"),
        ("fan_in_fan_out", True),
        ("init_lora_weights", "pissa"),
        ("init_lora_weights", "pissa_niter_4"),
        ("init_lora_weights", "olora"),
        ("init_lora_weights", "corda"),
        ("init_lora_weights", "loftq"),
        ("init_lora_weights", "lora_ga"),
        ("auto_mapping", {"base_model_class": "MyModel", "parent_library": "my_package.modeling"}),
        ("auto_mapping", "custom"),
    ],
)
def test_unsupported_features_are_refused_by_name(field: str, value: Any, files: Files, base: Base) -> None:
    files.config[field] = value
    error = refused(files, base, UnsupportedAdapterFeature, f"'{field}'")
    assert error.field == field


def test_target_parameters_on_a_dense_base_are_refused(files: Files, base: Base) -> None:
    """peft's target_parameters adapt a mixture-of-experts base's experts (tests/engine/model/test_moe.py); a dense
    base has no such parameter."""
    files.config["target_parameters"] = ["mlp.experts.gate_up_proj"]
    error = refused(files, base, AdapterConfigError, "'target_parameters'", "selects no parameter", "has none")
    assert error.field == "target_parameters"


@pytest.mark.parametrize(
    ("target_modules", "culprit"),
    [
        (["q_proj", "lm_head"], "lm_head"),
        (["q_proj", "embed_tokens"], "model.embed_tokens"),
        (["model.embed_tokens"], "model.embed_tokens"),
        (r".*(q_proj|lm_head)", "lm_head"),
    ],
)
def test_embedding_and_output_targets_are_refused(target_modules: Any, culprit: str, files: Files, base: Base) -> None:
    files.config["target_modules"] = target_modules
    error = refused(files, base, UnsupportedAdapterFeature, "'target_modules'", culprit)
    assert error.field == "target_modules"


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("r", "8", "'8'"),
        ("r", 0, "0"),
        ("r", 8.0, "8.0"),
        ("lora_alpha", "16", "'16'"),
        ("lora_alpha", math.inf, "inf"),
        ("use_rslora", "yes", "'yes'"),
        ("target_modules", 5, "5"),
        ("target_modules", ["q_proj", 3], "3"),
        ("target_modules", "(q_proj", "(q_proj"),
        ("target_modules", "(.*)*q_proj", "repetition inside a repetition"),
        ("target_modules", "(qq|k)+_proj", "alternation inside a repetition"),
        ("target_modules", ".*.*.*.*q_proj", "repetitions"),
        ("exclude_modules", 1, "1"),
        ("layers_to_transform", "0", "'0'"),
        ("layers_to_transform", [-1], "-1"),
        ("layers_pattern", 3, "3"),
        ("rank_pattern", {"q_proj": 0}, "rank_pattern.q_proj"),
        ("rank_pattern", {"(": 4}, "'('"),
        ("rank_pattern", ["q_proj"], "['q_proj']"),
        ("alpha_pattern", {"q_proj": "x"}, "alpha_pattern.q_proj"),
        ("init_lora_weights", "magic", "'magic'"),
    ],
)
def test_bad_config_fields_are_named(field: str, value: Any, shown: str, files: Files, base: Base) -> None:
    files.config[field] = value
    error = refused(files, base, AdapterConfigError, f"'{field}", shown)
    assert error.field is not None and error.field.startswith(field)


def test_layers_to_transform_with_a_regex_is_refused(files: Files, base: Base) -> None:
    files.config.update(target_modules=".*q_proj", layers_to_transform=[0])
    refused(files, base, AdapterConfigError, "'layers_to_transform'", "'target_modules'")


def test_layers_pattern_needs_layers_to_transform(files: Files, base: Base) -> None:
    files.config.update(layers_pattern="layers", layers_to_transform=None)
    refused(files, base, AdapterConfigError, "'layers_pattern'")


def test_missing_peft_type_and_non_json_config(files: Files, base: Base) -> None:
    del files.config["peft_type"]
    refused(files, base, AdapterConfigError, "'peft_type'")
    _, weights = files.encode()
    for config_bytes in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(AdapterFormatError, match=r"adapter_config\.json"):
            parse_adapter(config_bytes, weights, base.config)


def test_a_missing_lora_b_is_named(files: Files, base: Base) -> None:
    del files.tensors[f"{Q0}.lora_B.weight"]
    error = refused(files, base, AdapterFormatError, f"{Q0}.lora_A.weight", f"{Q0}.lora_B.weight")
    assert error.field == f"{Q0}.lora_B.weight"


def test_a_wrong_shape_is_named(files: Files, base: Base) -> None:
    files.tensors[f"{V1}.lora_A.weight"] = torch.zeros(8, 48)
    refused(files, base, AdapterShapeError, f"{V1}.lora_A.weight", "[8, 48]", "[8, 64]")


def test_b_with_the_wrong_output_size_is_named(files: Files, base: Base) -> None:
    files.tensors[f"{Q0}.lora_B.weight"] = torch.zeros(32, 8)  # kv_size, not q_size
    refused(files, base, AdapterShapeError, f"{Q0}.lora_B.weight", "[64, 8]")


def test_a_rank_that_disagrees_with_the_config_is_refused(files: Files, base: Base) -> None:
    files.tensors[f"{Q0}.lora_A.weight"] = torch.zeros(4, 64)
    files.tensors[f"{Q0}.lora_B.weight"] = torch.zeros(64, 4)
    refused(files, base, AdapterShapeError, f"{Q0}.lora_A.weight", "rank 8")


def test_a_rank_over_the_limit_names_the_module_and_both_numbers(files: Files, base: Base) -> None:
    files.config["rank_pattern"] = {"model.layers.1.self_attn.v_proj": 16}
    files.tensors[f"{V1}.lora_A.weight"] = torch.zeros(16, 64)
    files.tensors[f"{V1}.lora_B.weight"] = torch.zeros(32, 16)
    error = refused(files, base, AdapterRankError, "model.layers.1.self_attn.v_proj", "16", "12", max_rank=12)
    assert error.field == "model.layers.1.self_attn.v_proj"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("half", ["A", "B"])
def test_non_finite_values_name_the_tensor(bad: float, half: str, files: Files, base: Base) -> None:
    files.tensors[f"{V1}.lora_{half}.weight"][0, 0] = bad
    error = refused(files, base, AdapterValueError, f"{V1}.lora_{half}.weight")
    assert error.field == f"{V1}.lora_{half}.weight"


def test_values_that_overflow_the_serving_dtype_are_refused(files: Files, base: Base) -> None:
    files.tensors[f"{V1}.lora_B.weight"][0, 0] = 60000.0  # finite in f32, x2 scaling overflows f16
    refused(files, base, AdapterValueError, f"{V1}.lora_B.weight", "float16", dtype=torch.float16)


def test_unsupported_tensor_dtypes_are_refused(files: Files, base: Base) -> None:
    files.tensors[f"{V1}.lora_A.weight"] = files.tensors[f"{V1}.lora_A.weight"].double()
    refused(files, base, AdapterFormatError, f"{V1}.lora_A.weight", "F64")


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("base_model.model.model.norm.weight", "expected names like"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", "embeddings"),
        ("base_model.model.lm_head.lora_A.weight", "output layer"),
        (f"{Q0}.lora_B.bias", "biases"),
        (f"{Q0}.lora_magnitude_vector", "DoRA"),
        ("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", "self_attn.qkv_proj"),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "mlp.q_proj"),
        ("model.layers.0.self_attn.q_proj.lora_A.weight", "expected names like"),
    ],
)
def test_unknown_tensors_are_named(name: str, hint: str, files: Files, base: Base) -> None:
    files.tensors[name] = torch.zeros(8, 64)
    error = refused(files, base, AdapterFormatError, f"'{name}'", hint)
    assert error.field == name


def test_a_layer_out_of_range_is_named(files: Files, base: Base) -> None:
    for half, shape in (("A", (8, 64)), ("B", (64, 8))):
        files.tensors[f"base_model.model.model.layers.3.self_attn.q_proj.lora_{half}.weight"] = torch.zeros(shape)
    refused(files, base, AdapterShapeError, "layers.3.self_attn.q_proj", "3 layers")


def test_a_module_the_config_does_not_target_is_refused(files: Files, base: Base) -> None:
    files.config["target_modules"] = ["q_proj", "k_proj", "up_proj"]
    error = refused(files, base, AdapterFormatError, "model.layers.0.self_attn.v_proj", "target_modules")
    assert error.field == "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"


def test_a_targeted_module_without_tensors_is_refused(files: Files, base: Base) -> None:
    files.config["target_modules"] = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
    refused(files, base, AdapterFormatError, "model.layers.0.mlp.down_proj")


def test_an_empty_adapter_is_refused(files: Files, base: Base) -> None:
    files.tensors.clear()
    refused(files, base, AdapterFormatError, "no LoRA tensors")


def test_a_config_that_selects_nothing_is_refused(files: Files, base: Base) -> None:
    files.config["target_modules"] = ["c_attn"]
    refused(files, base, AdapterConfigError, "target_modules", "selects no module")


def test_both_key_spellings_for_one_module_are_refused(files: Files, base: Base) -> None:
    files.tensors[f"{Q0}.lora_A.default.weight"] = files.tensors[f"{Q0}.lora_A.weight"].clone()
    refused(files, base, AdapterFormatError, f"{Q0}.lora_A")


def test_weights_over_the_size_limit_are_refused(files: Files, base: Base) -> None:
    refused(files, base, AdapterFormatError, "adapter_model.safetensors", "1000", max_bytes=1000)


def test_malformed_safetensors_is_refused_naming_the_file(files: Files, base: Base) -> None:
    config, weights = files.encode()
    with pytest.raises(AdapterFormatError, match=r"adapter_model\.safetensors"):
        parse_adapter(config, weights[:-3], base.config)


def test_messages_do_not_mention_the_base_model_path(files: Files, base: Base) -> None:
    files.config["base_model_name_or_path"] = "/home/someone/secret-model"
    files.config["use_dora"] = True
    error = refused(files, base, UnsupportedAdapterFeature, "use_dora")
    assert "secret-model" not in str(error)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_weights_parse_or_raise_an_adapter_error(
    flips: list[tuple[int, int]], reference_adapter: Any, base: Base
) -> None:
    data = bytearray(reference_adapter.weights_bytes)
    header_end = 8 + int.from_bytes(data[:8], "little")
    for position, value in flips:
        # Mostly the header, where structure lives; sometimes the values.
        data[position % (header_end if position % 4 else len(data))] = value
    with contextlib.suppress(AdapterError):
        parse_adapter(reference_adapter.config_bytes, bytes(data), base.config)


def test_structure_is_checked_before_values(files: Files, base: Base) -> None:
    files.tensors[f"{Q0}.lora_A.weight"][0, 0] = math.nan
    files.tensors["base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"] = torch.zeros(100, 8)
    refused(files, base, AdapterShapeError, "layers.2.mlp.up_proj.lora_B.weight")
