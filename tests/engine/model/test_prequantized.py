"""Pre-quantized GPTQ and AWQ checkpoints load as the int4 weights they hold.

The tests write such checkpoints themselves from a random test checkpoint: round-to-nearest 4-bit codes per group,
packed the way each format's own packers do (GPTQ along the input features, AWQ along the outputs in its
0, 2, 4, 6, 1, 3, 5, 7 word order, GPTQ's original format storing zero - 1). The engine's logits over the packed
checkpoint must match the engine's over a float checkpoint that holds the same values dequantized here, with
no loraplex code, so a wrong unpacking order, transposition, zero offset, row order or act-order shows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.checkpoints import VOCAB
from _support.prequantized import edit_config, write_prequantized
from safetensors.torch import load_file, save_file

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.errors import CheckpointError
from loraplex.kernels.quant import int8_activations

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def float_activations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The int4 matmuls with float activations, whatever the CPU: these tests check the values a checkpoint holds
    are the values served, to 1e-4. With 8-bit activations (CPUs with VNNI or AMX, decision 0039) the logits move
    by more than that; test_a_prequantized_checkpoint_keeps_close_with_8_bit_activations covers that path."""
    monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", "0")
    int8_activations.cache_clear()
    yield
    int8_activations.cache_clear()


def _llm(path: Path, **options: Any) -> LLM:
    return LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20, enable_prefix_caching=False, **options)


def _logprobs(llm: LLM, prompt: list[int]) -> list[dict[int, float]]:
    """Greedy continuation's top-5 logprobs at each of 8 steps."""
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, logprobs=5))
    return [{t: lp.logprob for t, lp in step.items()} for step in out[0].outputs[0].logprobs or []]


PROMPT = [(7 * i + 3) % (VOCAB - 2) + 2 for i in range(40)]


@pytest.mark.parametrize(
    ("variant", "method", "group_size", "checkpoint_format"),
    [
        ("llama-gqa", "gptq", 32, "gptq"),
        ("qwen2-bias", "gptq", -1, "gptq"),
        ("llama-gqa", "gptq", 32, "gptq_v2"),
        ("llama-gqa", "awq", 32, "gptq"),
        ("qwen2-bias", "awq", 32, "gptq"),
    ],
)
def test_a_prequantized_checkpoint_serves_the_values_it_holds(
    variant: str,
    method: str,
    group_size: int,
    checkpoint_format: str,
    checkpoint: Callable[..., Path],
    tmp_path: Path,
) -> None:
    path = write_prequantized(checkpoint(variant), tmp_path, method, group_size, checkpoint_format=checkpoint_format)
    packed = _llm(path)
    reference = _llm(path / "dequantized")
    assert packed.engine.state().quantization == method
    ours, theirs = _logprobs(packed, PROMPT), _logprobs(reference, PROMPT)
    assert len(ours) == len(theirs) == 8
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.keys() == b.keys(), f"step {step}: top tokens differ"
        for token in a:
            assert abs(a[token] - b[token]) < 1e-4, (step, token, a[token], b[token])
    # Weights as kept: 4-bit codes with scales and zeros, well under the float checkpoint's projections.
    assert packed.engine.model.projection_bytes() < 0.4 * reference.engine.model.projection_bytes()


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_an_act_order_gptq_checkpoint_serves_the_values_it_holds(
    variant: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_prequantized(checkpoint(variant), tmp_path, "gptq", 32, act_order=True)
    packed, reference = _llm(path), _llm(path / "dequantized")
    layer = packed.engine.model.layers[0]
    assert layer.qkv_input_order is not None and layer.down_input_order is not None
    for step, (a, b) in enumerate(zip(_logprobs(packed, PROMPT), _logprobs(reference, PROMPT), strict=True)):
        assert a.keys() == b.keys(), f"step {step}: top tokens differ"
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a), (step, a, b)


def test_a_prequantized_checkpoint_keeps_close_with_8_bit_activations(
    checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32, act_order=True)
    reference = _logprobs(_llm(path / "dequantized"), PROMPT)[0]
    monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", "1")
    int8_activations.cache_clear()
    ours = _logprobs(_llm(path), PROMPT)[0]
    assert max(ours, key=ours.__getitem__) == max(reference, key=reference.__getitem__), (ours, reference)
    shared = ours.keys() & reference.keys()
    assert len(shared) >= 4, (ours, reference)
    # Measured: the first step's shared top-5 logprobs moved by 0.007-0.052 with 8-bit activations; under 1e-4 without.
    assert all(abs(ours[t] - reference[t]) < 0.2 for t in shared), (ours, reference)
    assert any(abs(ours[t] - reference[t]) > 1e-3 for t in shared), "the activations were not rounded"


def test_act_orders_the_engine_cannot_fuse_or_group_are_refused(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32, act_order=True)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.g_idx"
    original = tensors[name].clone()
    tensors[name] = tensors[name].flip(0).contiguous()  # a valid act-order, but not q's and v's
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn'.*q, k and v.*different act-order"):
        _llm(path)
    tensors[name] = torch.where(original == 0, 1, original).contiguous()  # group 0 empty, group 1 twice as large
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{name}' must give each of the 2 groups exactly 32"):
        _llm(path)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 32}, r"bits is 8.*4-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, r"AWQ version 'gemv'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, r"zero_point false"),
        ({"quant_method": "bitsandbytes", "bits": 4}, r"quant_method 'bitsandbytes'.*'gptq', 'awq', 'fp8'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"group_size must be"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, r"group_size 48 does not divide"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
            r"checkpoint_format 'marlin'",
        ),
    ],
)
def test_unsupported_prequantized_configs_are_refused(
    spec: dict[str, Any], message: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    edit_config(path, quantization_config=spec)
    with pytest.raises(CheckpointError, match=message):
        _llm(path)


def test_quantize_config_json_of_older_gptq_checkpoints_is_read(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    edit_config(path, quantization_config=None)
    (path / "quantize_config.json").write_text(json.dumps({k: v for k, v in spec.items() if k != "quant_method"}))
    llm = _llm(path)
    assert llm.engine.state().quantization == "gptq"
    assert _logprobs(llm, PROMPT)


def test_a_quantized_lm_head_is_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.qweight"] = torch.zeros(8, VOCAB, dtype=torch.int32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head is quantized \('lm_head.qweight'\)"):
        _llm(path)


def test_requantizing_a_prequantized_checkpoint_is_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "awq", 32)
    with pytest.raises(CheckpointError, match=r"already quantized \(AWQ, 4-bit\).*leave quantization unset"):
        _llm(path, quantization="int8")


def test_packed_tensors_without_a_quantization_config_are_refused(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    edit_config(path, quantization_config=None)
    with pytest.raises(CheckpointError, match=r"pre-quantized tensors.*no 'quantization_config'"):
        _llm(path)
