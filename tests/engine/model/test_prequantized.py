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


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: word nibble i holds column ORDER[i]


def _signed32(values: torch.Tensor) -> torch.Tensor:
    return (((values + 2**31) % 2**32) - 2**31).to(torch.int32)


def _rtn(
    weight: torch.Tensor, g_idx: torch.Tensor, group_size: int, min_zero: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes [in, out], scales [G, out] (half), zeros [G, out] (ints) of a [out, in] float weight
    whose input feature k belongs to group g_idx[k]; zero points from `min_zero` up (GPTQ's original format stores
    zero - 1 in 4 bits, so it cannot hold 0)."""
    out_features, in_features = weight.shape
    w = weight.t()  # [in, out]
    by_group = w[torch.argsort(g_idx, stable=True)].reshape(in_features // group_size, group_size, out_features)
    low, high = by_group.amin(1).clamp(max=0), by_group.amax(1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-8).half()
    zeros = torch.round(-low / scales.float()).clamp(min_zero, 15)
    codes = (torch.round(w / scales.float()[g_idx]) + zeros[g_idx]).clamp(0, 15)
    return codes.long(), scales, zeros.long()


def _input_of(name: str) -> str:
    """The input a projection reads: q, k and v read the attention's, gate and up the MLP's, o and down their own."""
    block, module = name.rsplit(".", 2)[0], name.split(".")[-2]
    shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    return f"{block}.{shared.get(module, module)}"


def _pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, zero_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    in_features, out_features = codes.shape
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int64)
    for j in range(8):
        qweight |= codes[j::8] << (4 * j)
    stored = zeros - zero_offset
    qzeros = torch.zeros(zeros.shape[0], out_features // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= (stored[:, j::8] & 0xF) << (4 * j)
    return _signed32(qweight), _signed32(qzeros)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    rows, columns = values.shape
    packed = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_PACK_ORDER):
        packed |= values[:, column::8] << (4 * i)
    return _signed32(packed)


def _write_prequantized(
    source: Path,
    target: Path,
    method: str,
    group_size: int,
    *,
    checkpoint_format: str = "gptq",
    act_order: bool = False,
) -> Path:
    """`target`: source's checkpoint with its layers' projections in `method`'s 4-bit format; `target`/dequantized:
    the same values as a float32 checkpoint. `act_order`: GPTQ's desc_act, each group drawn from a random order of
    the input features, one order per input (q, k and v share theirs, as do gate and up: GPTQ orders by the
    input's Hessian)."""
    orders: dict[str, torch.Tensor] = {}
    dequantized = target / "dequantized"
    dequantized.mkdir(parents=True)
    tensors = load_file(source / "model.safetensors")
    float_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith("_proj.weight") and n.split(".")[-2] in PROJECTIONS]:
        weight = tensors.pop(name)
        prefix = name.removesuffix(".weight")
        size = weight.shape[1] if group_size == -1 else group_size
        offset = 1 if method == "gptq" and checkpoint_format == "gptq" else 0
        groups = torch.arange(weight.shape[1]) // size
        if act_order:
            seed = torch.Generator().manual_seed(len(orders))
            order = orders.setdefault(_input_of(name), torch.randperm(weight.shape[1], generator=seed))
            groups = torch.empty_like(groups)
            groups[order] = torch.arange(weight.shape[1]) // size  # feature order[j] is in group j // size
        codes, scales, zeros = _rtn(weight.float(), groups, size, min_zero=offset)
        float_tensors[name] = ((codes - zeros[groups]) * scales.float()[groups]).t().contiguous()
        if method == "gptq":
            tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = _pack_gptq(codes, zeros, offset)
            tensors[f"{prefix}.g_idx"] = groups.to(torch.int32)
        else:
            tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"] = _pack_awq(codes), _pack_awq(zeros)
        tensors[f"{prefix}.scales"] = scales
    for folder in (target, dequantized):
        for file in source.iterdir():
            if file.is_file() and file.name != "model.safetensors":
                (folder / file.name).write_bytes(file.read_bytes())
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    save_file(float_tensors, dequantized / "model.safetensors", metadata={"format": "pt"})
    if method == "gptq":
        spec: dict[str, Any] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": checkpoint_format,
        }
    else:
        spec = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    _edit_config(target, quantization_config=spec)
    return target


def _edit_config(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    for key, value in fields.items():
        if value is None:
            del config[key]
    (folder / "config.json").write_text(json.dumps(config))


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
    path = _write_prequantized(checkpoint(variant), tmp_path, method, group_size, checkpoint_format=checkpoint_format)
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
    path = _write_prequantized(checkpoint(variant), tmp_path, "gptq", 32, act_order=True)
    packed, reference = _llm(path), _llm(path / "dequantized")
    layer = packed.engine.model.layers[0]
    assert layer.qkv_input_order is not None and layer.down_input_order is not None
    for step, (a, b) in enumerate(zip(_logprobs(packed, PROMPT), _logprobs(reference, PROMPT), strict=True)):
        assert a.keys() == b.keys(), f"step {step}: top tokens differ"
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a), (step, a, b)


def test_a_prequantized_checkpoint_keeps_close_with_8_bit_activations(
    checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32, act_order=True)
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
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32, act_order=True)
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
        ({"quant_method": "bitsandbytes", "bits": 4}, r"quant_method 'bitsandbytes'.*'gptq' and 'awq'"),
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
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    _edit_config(path, quantization_config=spec)
    with pytest.raises(CheckpointError, match=message):
        _llm(path)


def test_quantize_config_json_of_older_gptq_checkpoints_is_read(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    spec = json.loads((path / "config.json").read_text())["quantization_config"]
    _edit_config(path, quantization_config=None)
    (path / "quantize_config.json").write_text(json.dumps({k: v for k, v in spec.items() if k != "quant_method"}))
    llm = _llm(path)
    assert llm.engine.state().quantization == "gptq"
    assert _logprobs(llm, PROMPT)


def test_a_quantized_lm_head_is_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.qweight"] = torch.zeros(8, VOCAB, dtype=torch.int32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head is quantized \('lm_head.qweight'\)"):
        _llm(path)


def test_requantizing_a_prequantized_checkpoint_is_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "awq", 32)
    with pytest.raises(CheckpointError, match=r"already quantized \(AWQ, 4-bit\).*leave quantization unset"):
        _llm(path, quantization="int8")


def test_packed_tensors_without_a_quantization_config_are_refused(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    path = _write_prequantized(checkpoint("llama-gqa"), tmp_path, "gptq", 32)
    _edit_config(path, quantization_config=None)
    with pytest.raises(CheckpointError, match=r"pre-quantized tensors.*no 'quantization_config'"):
        _llm(path)
