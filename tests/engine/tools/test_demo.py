"""Random checkpoints: the files transformers would write, loadable by it, with the demo tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.checkpoints import tiny_spec
from safetensors import safe_open
from safetensors.torch import load_file

from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.tools.demo import (
    BENCHMARK_SPEC,
    DEMO_SPEC,
    END_OF_TEXT_TOKEN,
    IM_END_TOKEN,
    train_demo_tokenizer,
    write_random_model,
)

pytestmark = pytest.mark.unit

TINY = tiny_spec()
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SPECS = {
    "llama": dataclasses.replace(TINY, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "mistral": dataclasses.replace(TINY, architecture="mistral", num_key_value_heads=1, seed=1),
    "qwen2": dataclasses.replace(
        TINY, architecture="qwen2", attention_bias=True, tie_word_embeddings=True, torch_dtype="bfloat16", seed=2
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write_random_model(tmp_path_factory.mktemp(name), spec) for name, spec in SPECS.items()}


def _json(path: Path) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(path.read_text())
    return value


def _rope(config: Any) -> dict[str, Any]:
    """Rope settings of a loaded transformers config: `rope_parameters` from 5.0, rope_theta/rope_scaling before."""
    if getattr(config, "rope_parameters", None):
        return dict(config.rope_parameters)
    return {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}


class TestWriteRandomModel:
    @pytest.mark.parametrize("name", sorted(SPECS))
    def test_config_json(self, folders: dict[str, Path], name: str) -> None:
        spec, config = SPECS[name], _json(folders[name] / "config.json")
        architecture = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        assert config["architectures"] == [architecture[name]]
        assert config["model_type"] == name
        assert config["head_dim"] == spec.hidden_size // spec.num_attention_heads
        for field in ("hidden_size", "num_key_value_heads", "intermediate_size", "vocab_size", "rope_scaling"):
            assert config[field] == getattr(spec, field)
        assert config["torch_dtype"] == spec.torch_dtype
        tokenizer = Tokenizer.from_dir(folders[name])
        assert config["bos_token_id"] == tokenizer.bos_token_id
        assert config["eos_token_id"] == tokenizer.token_to_id(END_OF_TEXT_TOKEN)

    @pytest.mark.parametrize("name", sorted(SPECS))
    def test_tensors(self, folders: dict[str, Path], name: str) -> None:
        spec = SPECS[name]
        tensors = load_file(folders[name] / "model.safetensors")
        kv = spec.num_key_value_heads * spec.head_dim
        assert tensors["model.embed_tokens.weight"].shape == (spec.vocab_size, spec.hidden_size)
        assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (kv, spec.hidden_size)
        assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (spec.hidden_size, spec.intermediate_size)
        assert ("lm_head.weight" in tensors) is not spec.tie_word_embeddings
        assert ("model.layers.0.self_attn.q_proj.bias" in tensors) is spec.attention_bias
        assert "model.layers.0.self_attn.o_proj.bias" not in tensors
        assert sum(t.numel() for t in tensors.values()) == spec.num_parameters
        assert {t.dtype for t in tensors.values()} == {getattr(torch, spec.torch_dtype)}
        assert torch.equal(
            tensors["model.norm.weight"], torch.ones(spec.hidden_size, dtype=tensors["model.norm.weight"].dtype)
        )
        std = tensors["model.layers.0.mlp.up_proj.weight"].float().std().item()
        assert std == pytest.approx(spec.init_std, rel=0.05)

    def test_same_spec_same_bytes_other_seed_other_weights(self, tmp_path: Path) -> None:
        first = write_random_model(tmp_path / "a", TINY)
        second = write_random_model(tmp_path / "b", TINY)
        third = write_random_model(tmp_path / "c", dataclasses.replace(TINY, seed=7))
        for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
            assert (first / file).read_bytes() == (second / file).read_bytes()
        assert (first / "model.safetensors").read_bytes() != (third / "model.safetensors").read_bytes()

    def test_eos_ids_cover_end_of_text_and_end_of_turn(self, folders: dict[str, Path]) -> None:
        tokenizer = Tokenizer.from_dir(folders["llama"])
        expected = {tokenizer.token_to_id(END_OF_TEXT_TOKEN), tokenizer.token_to_id(IM_END_TOKEN)}
        assert _json(folders["llama"] / "generation_config.json")["eos_token_id"] == sorted(expected)  # type: ignore[type-var]
        assert tokenizer.eos_token_ids == expected


class TestTransformersLoads:
    @pytest.mark.parametrize("name", sorted(SPECS))
    def test_model(self, folders: dict[str, Path], name: str) -> None:
        transformers = pytest.importorskip("transformers")
        spec, folder = SPECS[name], folders[name]
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert type(model).__name__ == _json(folder / "config.json")["architectures"][0]
        assert model.dtype == getattr(torch, spec.torch_dtype)
        config = model.config
        assert (config.num_key_value_heads, config.head_dim) == (spec.num_key_value_heads, spec.head_dim)
        assert config.tie_word_embeddings is spec.tie_word_embeddings
        rope = _rope(config)
        assert rope["rope_theta"] == spec.rope_theta
        assert rope["rope_type"] == (spec.rope_scaling or {}).get("rope_type", "default")
        if spec.rope_scaling:
            assert rope["factor"] == spec.rope_scaling["factor"]

        # transformers kept the file's weights (it re-initializes any it does not recognise).
        state = model.state_dict()
        for key, tensor in load_file(folder / "model.safetensors").items():
            assert torch.equal(state[key], tensor), key
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 9, 200]])).logits
        assert logits.shape == (1, 4, spec.vocab_size)
        assert torch.isfinite(logits).all()

    @pytest.mark.parametrize("name", ["llama", "qwen2"])
    def test_tokenizer_encodes_like_ours(self, folders: dict[str, Path], name: str) -> None:
        transformers = pytest.importorskip("transformers")
        reference = transformers.AutoTokenizer.from_pretrained(folders[name], local_files_only=True)
        ours = Tokenizer.from_dir(folders[name])
        texts = ["Hello, world!", "  leading and\n\ntrailing  ", "Grüße 你好 😀", "<|im_start|>user\nhi<|im_end|>", ""]
        for text in texts:
            assert reference(text)["input_ids"] == ours.encode(text), text
            assert reference(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_special_tokens=False)
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
        assert reference.apply_chat_template(messages, tokenize=False) == ours.apply_chat_template(
            messages, add_generation_prompt=False
        )
        rendered = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        assert list(ids) == ours.encode_chat(messages)
        assert reference.eos_token_id in ours.eos_token_ids


class TestPresets:
    def test_demo_tokenizer_fills_the_demo_vocab(self) -> None:
        # No padding rows: every id the demo model can sample decodes to text.
        assert train_demo_tokenizer(DEMO_SPEC.vocab_size).get_vocab_size() == DEMO_SPEC.vocab_size

    def test_benchmark_spec_has_about_50m_parameters(self, tmp_path: Path) -> None:
        assert 45_000_000 <= BENCHMARK_SPEC.num_parameters <= 60_000_000
        folder = write_random_model(tmp_path, BENCHMARK_SPEC)
        with safe_open(folder / "model.safetensors", framework="pt") as weights:
            counted = sum(_numel(weights, key) for key in weights.keys())  # noqa: SIM118
        assert counted == BENCHMARK_SPEC.num_parameters
        tokenizer = Tokenizer.from_dir(folder)
        assert tokenizer.vocab_size <= BENCHMARK_SPEC.vocab_size


def _numel(weights: Any, key: str) -> int:
    count = 1
    for size in weights.get_slice(key).get_shape():
        count *= size
    return count


class TestSpecValidation:
    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"architecture": "gpt2"}, "architecture"),
            ({"num_attention_heads": 5}, "multiple of num_attention_heads"),
            ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
            ({"vocab_size": 100}, "vocab_size must be at least"),
            ({"architecture": "qwen2"}, "attention_bias=True"),
            ({"attention_bias": True}, "attention_bias=False"),
            ({"torch_dtype": "int8"}, "torch_dtype"),
            ({"num_hidden_layers": 0}, "num_hidden_layers must be positive"),
        ],
    )
    def test_refuses(self, changes: dict[str, Any], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(TINY, **changes)
