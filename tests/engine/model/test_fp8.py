"""FP8 checkpoints as they ship (transformers' fp8 with block scales, AutoFP8's per-tensor, compressed-tensors' tensor,
channel and block strategies) load without a conversion step and serve the values they hold; `quantization="fp8"`
quantizes a 16/32-bit checkpoint at load; LoRA runs over both.

The checkpoints are written here from random test checkpoints by _support/fp8.py, with plain torch, beside a float32
twin holding the same values dequantized: the engine over the FP8 checkpoint must match the engine over the twin
to 1e-4, so a wrong scale layout, block expansion, fused stacking or row order shows. Against the original float
model (what FP8 costs), measured over 256 random positions of each random checkpoint:

| weights | cosine of logits (measured) | top-1 agreement (measured) |
|---|---|---|
| llama-gqa as each FP8 layout (blocks [128, 128] and [16, 32]) | >= 0.99 (0.9920-0.9930) | >= 0.72 (0.777-0.836) |
| `quantization="fp8"` at load: llama-gqa, qwen3, gemma3, phi3 | >= 0.985 (0.9888-0.9979) | >= 0.72 (0.773-0.953) |
| FP8 GEMMs (e4m3 activations): llama-gqa, fp8-block, ct-channel | >= 0.98 (0.9856-0.9867) | >= 0.72 (0.758-0.762) |

e4m3 keeps 3 mantissa bits, a relative error of up to 1/16 per weight whatever the scale's granularity (per tensor,
channel or block differ by under 0.002 in cosine here), where int8 per channel is exact to 1/254 of the row's
largest weight: FP8 sits between int8 (0.9996) and int4 (0.92) on these random checkpoints. The random phi3's
LongRoPE sharpens its attention, as in test_quantization.py.
(Random weights give near-flat logits, so top-1 there counts near ties; test_quantization.py's docstring says more.)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _support.adapters import make_peft_adapter, peft_logits
from _support.checkpoints import VOCAB
from _support.engine_runs import prefill_logits
from _support.fp8 import LAYOUTS, write_fp8
from _support.prequantized import edit_config
from safetensors.torch import load_file, save_file

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.errors import CheckpointError
from loraplex.kernels import quant_fp8
from loraplex.kernels.quant_fp8 import Fp8Weight, dequantize_fp8, fp8_gemm_supported, fp8_linear, quantize_fp8

pytestmark = pytest.mark.unit

VARIANTS = ["llama-gqa", "qwen2-bias", "qwen3", "phi3-partial"]  # phi3: fused qkv_proj and gate_up_proj
COSINE_FLOOR, TOP1_FLOOR = 0.99, 0.72
AT_LOAD_COSINE_FLOOR, AT_LOAD_TOP1_FLOOR = 0.985, 0.72
GEMM_COSINE_FLOOR = 0.98


def _llm(path: Path, **options: Any) -> LLM:
    return LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20, enable_prefix_caching=False, **options)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def _agreement(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    cosine = F.cosine_similarity(ours, reference, dim=-1).mean()
    top1 = (ours.argmax(-1) == reference.argmax(-1)).float().mean()
    return float(cosine), float(top1)


# --- the kernel -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("col_block", [128, 32, 48, 160])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_dequantized_matmul(col_block: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = 4000  # two tiles of the torch path (2^19 elements each)
    codes = (torch.randn(rows, 160, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(rows, -(-160 // col_block), generator=gen) + 0.1
    w = Fp8Weight(codes, scales, col_block)
    w_reference = codes.float() * scales.repeat_interleave(col_block, dim=1)[:, :160]
    torch.testing.assert_close(dequantize_fp8(w), w_reference, atol=0, rtol=0)
    x = torch.randn(5, 160, generator=gen).to(dtype)
    bias, residual = torch.randn(rows, generator=gen).to(dtype), torch.randn(5, rows, generator=gen).to(dtype)
    expected = x.float() @ w_reference.t() + bias.float() + residual.float()
    ours = fp8_linear(x, w, bias, residual=residual)
    assert ours.dtype == dtype
    tolerance = 1e-2 if dtype == torch.float32 else 0.05 * float(expected.abs().max())
    torch.testing.assert_close(ours.float(), expected, atol=tolerance, rtol=1e-3)


def _activation_quantized_product(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """What the FP8 GEMM path computes, in float32 arithmetic: x quantized to e4m3 per token and column block of
    the weight's scales, times the dequantized weight, block by block."""
    xf, weight = x.float(), dequantize_fp8(w)
    y = torch.zeros(x.shape[0], w.shape[0])
    for start in range(0, w.shape[1], w.col_block):
        part = xf[:, start : start + w.col_block]
        scale = (part.abs().amax(dim=1, keepdim=True) / 448).clamp(min=torch.finfo(torch.float32).tiny)
        quantized = (part / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        y += quantized @ weight[:, start : start + w.col_block].t()
    return y


@pytest.mark.parametrize("col_block", [128, 32, 160])  # 160: per row (one block)
def test_the_fp8_gemm_path_quantizes_activations_per_token_and_block(col_block: int) -> None:
    """The GEMM path (`torch._scaled_mm`, which torch also runs on the CPU, so the path is checked here; on CUDA it
    is taken where compute capability >= 8.9) equals its float32 emulation, and stays within e4m3's rounding of
    the activations (3 mantissa bits: relative 1/16 per value) of the weight-only product."""
    gen = torch.Generator().manual_seed(3)
    rows, width = 96, 160
    codes = (torch.randn(rows, width, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = Fp8Weight(codes, torch.rand(rows, -(-width // col_block), generator=gen) + 0.1, col_block)
    x = torch.randn(7, width, generator=gen)
    bias, residual = torch.randn(rows, generator=gen), torch.randn(7, rows, generator=gen)
    ours = fp8_linear(x, w, bias, residual=residual, fp8_gemm=True)
    expected = _activation_quantized_product(x, w) + bias + residual
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=1e-5)
    weight_only = fp8_linear(x, w, bias, residual=residual, fp8_gemm=False)
    error = (ours - weight_only).norm() / weight_only.norm()
    assert 0 < error < 0.05, f"relative error of the activations' rounding {error:.4f}"


def test_shapes_off_the_gemms_alignment_take_the_dequantizing_path() -> None:
    gen = torch.Generator().manual_seed(4)
    w = quantize_fp8(torch.randn(24, 40, generator=gen))  # 40 input features: not a multiple of 16
    x = torch.randn(3, 40, generator=gen)
    torch.testing.assert_close(fp8_linear(x, w, fp8_gemm=True), fp8_linear(x, w, fp8_gemm=False), atol=0, rtol=0)
    assert not fp8_gemm_supported(torch.device("cpu"))  # the CPU serves the weight-only path unless told


@pytest.mark.gpu
def test_fp8_gemms_on_a_gpu_that_has_them() -> None:
    """On CUDA the path is chosen by compute capability: >= 8.9 runs the GEMMs in FP8 and equals their emulation;
    below, the dequantizing path, equal to the weight-only product."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    for col_block in (128, 4096):
        codes = (torch.randn(512, 4096, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = Fp8Weight(codes, torch.rand(512, -(-4096 // col_block), generator=gen) + 0.1, col_block)
        x = torch.randn(33, 4096, generator=gen)
        ours = fp8_linear(x.to(device, torch.bfloat16), w.to(device)).float().cpu()
        gemm = fp8_gemm_supported(device)
        expected = (
            _activation_quantized_product(x.bfloat16(), w) if gemm else x.bfloat16().float() @ dequantize_fp8(w).t()
        )
        error = float((ours - expected).norm() / expected.norm())
        assert error < 1e-2, f"col_block {col_block}, fp8 gemm {gemm}: relative error {error:.5f}"


def test_rows_columns_and_stacking_keep_the_values() -> None:
    gen = torch.Generator().manual_seed(1)
    parts = [quantize_fp8(torch.randn(rows, 96, generator=gen)) for rows in (16, 8, 8)]
    stacked = Fp8Weight.stack(parts)
    torch.testing.assert_close(dequantize_fp8(stacked), torch.cat([dequantize_fp8(p) for p in parts]))
    order = torch.randperm(32, generator=gen)
    torch.testing.assert_close(dequantize_fp8(stacked.rows(order)), dequantize_fp8(stacked)[order])
    block = Fp8Weight((torch.randn(8, 96, generator=gen) * 20).to(torch.float8_e4m3fn), torch.rand(8, 3) + 0.5, 32)
    torch.testing.assert_close(dequantize_fp8(block.columns(32, 96)), dequantize_fp8(block)[:, 32:])
    with pytest.raises(ValueError, match="split a block"):
        block.columns(16, 96)
    # FP8 keeps a byte per weight and 4 per row and block of scales: half of bf16 and then some.
    assert stacked.nbytes() == 32 * 96 + 32 * 4


# --- checkpoints as they ship ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_an_fp8_checkpoint_serves_the_values_it_holds(
    variant: str, layout: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_fp8(checkpoint(variant), tmp_path / "fp8", layout)
    fp8, reference = _llm(path), _llm(path / "dequantized")
    assert fp8.engine.state().quantization == "fp8"
    assert all(isinstance(w, Fp8Weight) for w in fp8.engine.model.layers[0].projections())
    prompt = _prompt(1, 40)
    torch.testing.assert_close(prefill_logits(fp8, prompt), prefill_logits(reference, prompt), atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = fp8.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert ours == reference.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    # Weights as kept: a byte per weight, with their scales: about a quarter of float32's, half of bf16's.
    assert fp8.engine.model.projection_bytes() < 0.27 * reference.engine.model.projection_bytes()


@pytest.mark.parametrize("block", [(16, 32), (24, 48)], ids=["16x32", "24x48-partial"])
@pytest.mark.parametrize("layout", ["fp8-block", "ct-block"])
def test_small_blocks_tile_the_fused_projections(
    layout: str, block: tuple[int, int], checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Blocks smaller than the projections: several per matrix, partial ones at the edges, q/k/v and gate/up
    quantized apart and fused by the engine, the rotary row order applied to the expanded scales."""
    for variant in ("llama-gqa", "phi3-partial"):
        path = write_fp8(checkpoint(variant), tmp_path / variant, layout, block=block)
        prompt = _prompt(2, 33)
        torch.testing.assert_close(
            prefill_logits(_llm(path), prompt), prefill_logits(_llm(path / "dequantized"), prompt), atol=1e-4, rtol=0
        )


def test_an_fp8_lm_head_is_served_too(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_fp8(checkpoint("llama-gqa"), tmp_path / "fp8", "ct-channel", quantize_lm_head=True)
    fp8 = _llm(path)
    assert isinstance(fp8.engine.model.lm_head, Fp8Weight)
    prompt = _prompt(3, 20)
    torch.testing.assert_close(
        prefill_logits(fp8, prompt), prefill_logits(_llm(path / "dequantized"), prompt), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_stays_close_to_the_float_model(layout: str, checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    source = checkpoint("llama-gqa")
    prompt = _prompt(7, 256)
    reference = prefill_logits(_llm(source), prompt)
    for block in ((128, 128), (16, 32)) if layout.endswith("block") else ((128, 128),):
        path = write_fp8(source, tmp_path / f"{layout}-{block[0]}", layout, block=block)
        cosine, top1 = _agreement(prefill_logits(_llm(path), prompt), reference)
        assert cosine >= COSINE_FLOOR, f"{layout} {block}: cosine {cosine:.5f}"
        assert top1 >= TOP1_FLOOR, f"{layout} {block}: top-1 {top1:.3f}"
        assert cosine < 1 - 1e-7, "the weights were not quantized"


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel"])
def test_fp8_gemms_stay_close_to_the_float_model(
    layout: str, checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine on the FP8 GEMM path (taken on CUDA >= 8.9; forced here, torch runs it on the CPU too):
    activations rounded to e4m3 as well cost little more than the weights' rounding (measured in the docstring)."""
    source = checkpoint("llama-gqa")
    prompt = _prompt(7, 256)
    reference = prefill_logits(_llm(source), prompt)
    path = write_fp8(source, tmp_path / layout, layout)
    weight_only = prefill_logits(_llm(path), prompt)
    monkeypatch.setattr(quant_fp8, "fp8_gemm_supported", lambda device: True)
    gemms = prefill_logits(_llm(path), prompt)
    assert not torch.equal(gemms, weight_only), "the FP8 GEMM path was not taken"
    cosine, top1 = _agreement(gemms, reference)
    assert cosine >= GEMM_COSINE_FLOOR and top1 >= TOP1_FLOOR, f"{layout}: cosine {cosine:.5f}, top-1 {top1:.3f}"


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3", "gemma3", "phi3"])
def test_quantizing_to_fp8_at_load(variant: str, checkpoint: Callable[..., Path]) -> None:
    path = checkpoint(variant)
    prompt = _prompt(7, 256)
    plain = _llm(path)
    reference = prefill_logits(plain, prompt)
    fp8 = _llm(path, quantization="fp8")
    assert fp8.engine.state().quantization == "fp8"
    cosine, top1 = _agreement(prefill_logits(fp8, prompt), reference)
    assert cosine >= AT_LOAD_COSINE_FLOOR, f"{variant}: cosine {cosine:.5f}"
    assert top1 >= AT_LOAD_TOP1_FLOOR, f"{variant}: top-1 {top1:.3f}"
    # A byte per weight and 4 per row of scales: a quarter of float32's, and a little more at these narrow widths
    # (a row of 64 weights carries a 4-byte scale).
    assert fp8.engine.model.projection_bytes() < 0.27 * plain.engine.model.projection_bytes()


def test_a_bf16_checkpoint_quantized_to_fp8_serves_in_bf16(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("qwen3", torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", device="cpu", kv_budget=8 * 2**20, quantization="fp8")
    bf16 = LLM(path, dtype="bfloat16", device="cpu", kv_budget=8 * 2**20)
    # Half of bf16: a byte per weight, and 4 bytes of scale per row (0.525 at these narrow widths).
    assert llm.engine.model.projection_bytes() < 0.54 * bf16.engine.model.projection_bytes()
    out = llm.generate({"prompt_token_ids": _prompt(4, 30)}, SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("how", ["checkpoint", "at-load"])
def test_lora_over_fp8_weights(how: str, checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A peft LoRA over the FP8 base equals peft over the float model of the values the engine serves."""
    source = checkpoint("qwen3")
    adapter = make_peft_adapter(
        source, tmp_path / "adapter", seed=3, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    if how == "checkpoint":
        path = write_fp8(source, tmp_path / "fp8", "fp8-block", block=(16, 32))
        llm, served = _llm(path), path / "dequantized"
    else:
        llm = _llm(source, quantization="fp8")
        served = tmp_path / "served"
        _write_served_values(llm, source, served)
    prompt = _prompt(5, 24)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, lora_request=LoRARequest("a", adapter))[0].outputs[0]
    reference = peft_logits(served, adapter, prompt + out.token_ids).log_softmax(-1)
    for step, (token, top) in enumerate(zip(out.token_ids, out.logprobs or [], strict=True)):
        row = reference[len(prompt) - 1 + step]
        assert int(row.argmax()) == token, step
        for candidate, logprob in top.items():
            assert abs(logprob.logprob - float(row[candidate])) < 1e-3, (step, candidate)


def _write_served_values(llm: LLM, source: Path, target: Path) -> None:
    """A float checkpoint of the weights an at-load FP8 engine serves: its projections dequantized (the engine's
    fused, reordered rows mapped back by quantizing the checkpoint's own matrices the same way, per row)."""
    target.mkdir()
    tensors = load_file(source / "model.safetensors")
    for name, tensor in list(tensors.items()):
        if name.endswith("proj.weight"):
            tensors[name] = dequantize_fp8(quantize_fp8(tensor.float()))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    for file in source.iterdir():
        if file.name != "model.safetensors" and file.is_file():
            (target / file.name).write_bytes(file.read_bytes())
    assert llm.engine.model.layers  # the engine under test was loaded from `source`


# --- refusals, naming the field --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2'.*e4m3"),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"}, r"activation_scheme 'sometimes'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two positive integers"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, r"format 'pack-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            r"config_groups.g.weights: num_bits 4, type 'int'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"a": {"weights": {}}, "b": {"weights": {}}},
            },
            r"config_groups must hold one scheme",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}},
            },
            r"strategy 'group' is not supported",
        ),
    ],
)
def test_unsupported_fp8_configs_are_refused(
    spec: dict[str, Any], message: str, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = write_fp8(checkpoint("llama-gqa"), tmp_path / "fp8", "fp8-block")
    edit_config(path, quantization_config=spec)
    with pytest.raises(CheckpointError, match=message):
        _llm(path)


def test_a_missing_or_misshapen_scale_is_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_fp8(checkpoint("llama-gqa"), tmp_path / "fp8", "fp8-block", block=(16, 32))
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    scale = tensors.pop(name)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"no tensor '{name}'"):
        _llm(path)
    tensors[name] = scale[:, :1].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{name}'.*expected a float scale of shape \[4, 5\]"):
        _llm(path)


def test_fp8_tensors_without_a_config_saying_how_are_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_fp8(checkpoint("llama-gqa"), tmp_path / "fp8", "ct-channel")
    edit_config(path, quantization_config=None)
    with pytest.raises(CheckpointError, match=r"float8_e4m3fn.*names no FP8 scheme"):
        _llm(path)


def test_requantizing_an_fp8_checkpoint_is_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = write_fp8(checkpoint("llama-gqa"), tmp_path / "fp8", "ct-tensor")
    with pytest.raises(CheckpointError, match=r"already quantized \(FP8, compressed-tensors\)"):
        _llm(path, quantization="int8")


def test_the_config_written_is_the_shipped_one(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """What the test checkpoints say is what real ones say (field names a loader must read)."""
    path = write_fp8(checkpoint("llama-gqa"), tmp_path / "fp8", "fp8-block")
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    assert spec["quant_method"] == "fp8" and spec["weight_block_size"] == [128, 128]
    tensors = load_file(path / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    assert tensors["lm_head.weight"].dtype == torch.float32
