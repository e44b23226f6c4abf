"""Mixture-of-experts bases (issue 38) beyond the family tests' paths (tests/engine/model/test_families.py runs
Mixtral, Qwen2-MoE and Qwen3-MoE through prefill, decode, chunked prefill with preemption, prefix hits and attention
LoRA): the fused expert layout transformers holds in memory loads as the per-expert one it saves, the grouped expert
compute equals a per-expert loop, and what is not served yet is refused by name."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.adapters import make_peft_adapter, peft_logits
from _support.checkpoints import VOCAB
from _support.recording import Recorder
from safetensors.torch import save_file

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.errors import CheckpointError
from loraplex.engine.lora import batch as batch_module
from loraplex.engine.lora.adapter import parse_adapter
from loraplex.engine.lora.errors import AdapterError
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.layers.moe import MoeConfig, MoeWeights, moe_mlp
from loraplex.kernels import native

pytestmark = pytest.mark.unit

ATOL = 1e-4


def _fused_copy(source: Path, target: Path, hf_model: Callable[[Path], Any]) -> Path:
    """The checkpoint in source/ rewritten with the tensors as transformers holds them in memory: each layer's
    experts fused ([experts, 2 * intermediate, hidden] and [experts, hidden, intermediate]) under `mlp.`."""
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    state = {k: v.contiguous() for k, v in hf_model(source).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_the_fused_expert_layout_loads_as_the_per_expert_one(
    variant: str, checkpoint: Callable[..., Path], hf_model: Any, tmp_path: Path
) -> None:
    saved = checkpoint(variant)
    fused = _fused_copy(saved, tmp_path / "fused", hf_model)
    prompt = [random.Random(1).randrange(2, VOCAB) for _ in range(40)]
    with torch.no_grad():
        expected = hf_model(saved)(torch.tensor([prompt])).logits[0, -1].float()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    answers = []
    for path in (saved, fused):
        llm = LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20, max_model_len=256)
        answers.append(llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)
        core = llm.engine
        core.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1))
        prepared = core.runner.prepare(core.scheduler.schedule())
        logits = core.model.compute_logits(core.model.forward(prepared.batch, core.runner.kv_caches))
        torch.testing.assert_close(logits[-1], expected, atol=ATOL, rtol=0)
    assert answers[0] == answers[1]


def test_grouped_experts_equal_a_loop_over_experts() -> None:
    """The grouped GEMMs against transformers' algorithm written out: each expert over its tokens in turn, outputs
    weighted and added to zeros in the order of the experts; both routing-weight conventions, in float32 and
    bfloat16 (where the order of the additions and the casts decide the bits)."""
    torch.manual_seed(0)
    e, h, i, k, n = 6, 32, 24, 3, 29
    for dtype in (torch.float32, torch.bfloat16):
        for normalize, float32_weights in ((True, True), (False, False)):
            config = MoeConfig(e, k, i, normalize, float32_weights, (True,))
            router = torch.randn(e, h).to(dtype)
            gate_up = (torch.randn(e, 2 * i, h) * 0.2).to(dtype)
            down = (torch.randn(e, h, i) * 0.2).to(dtype)
            x = torch.randn(n, h).to(dtype)
            weights = MoeWeights(router, gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())
            got = moe_mlp(x, weights, config)

            probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1)
            top, idx = torch.topk(probs, k, dim=-1)
            if normalize:
                top = top / top.sum(-1, keepdim=True)
            if not float32_weights:
                top = top.to(dtype)
            expected = torch.zeros_like(x)
            for expert in range(e):
                token, slot = torch.where(idx == expert)
                if not len(token):
                    continue
                g, u = torch.nn.functional.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
                out = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, down[expert])
                expected.index_add_(0, token, (out * top[token, slot, None]).to(dtype))
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)


def test_the_parameter_counts_of_a_sparse_base(checkpoint: Callable[..., Path], hf_model: Any) -> None:
    path = checkpoint("qwen3-moe")
    config = ModelConfig.from_dir(path)
    assert config.num_parameters() == sum(p.numel() for p in hf_model(path).parameters())
    assert config.moe is not None and config.moe.sparse_layers == (True, False, True)
    active = config.mlp_parameters(0, active=True)
    assert active == 8 * config.hidden_size + 3 * 3 * config.hidden_size * 32 < config.mlp_parameters(0)
    # Qwen2-MoE: the shared expert and its gate count in every token's active parameters.
    path = checkpoint("qwen2-moe")
    config = ModelConfig.from_dir(path)
    assert config.num_parameters() == sum(p.numel() for p in hf_model(path).parameters())
    assert config.moe is not None and config.moe.sparse_layers == (False, True)
    h = config.hidden_size
    assert config.mlp_parameters(1, active=True) == 6 * h + 2 * 3 * h * 32 + 3 * h * 48 + h
    skipped = (6 - 2) * 3 * h * 32  # the four experts of six a token's router does not pick, in layer 1
    assert config.active_parameters() == config.num_parameters() - skipped


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_expert_lora_equals_peft_through_each_kernel_path(
    kernels: str, checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapters on the experts (peft's target_parameters) and on attention, rows of three adapters and the base in
    one batch, prefill and decode: with the native operator (decode-sized (adapter, expert) runs, one lora_add per
    projection) and with the SGMV torch path (every run, as long prefill runs take it), peft's logits each step."""
    if kernels == "native" and not native.load():
        pytest.fail("the native CPU operators are not built: `make` builds them", pytrace=False)
    base = checkpoint("qwen3-moe")
    adapters = {
        "experts": make_peft_adapter(
            base, tmp_path / "experts", seed=1, r=8, lora_alpha=16, target_modules=[], target_parameters=EXPERTS
        ),
        "down-only": make_peft_adapter(
            base,
            tmp_path / "down",
            seed=2,
            r=4,
            lora_alpha=4,
            target_modules=[],
            target_parameters=EXPERTS[1:],
            use_rslora=True,
        ),
        "both": make_peft_adapter(
            base,
            tmp_path / "both",
            seed=3,
            r=6,
            lora_alpha=12,
            target_modules=["q_proj", "o_proj"],
            target_parameters=EXPERTS,
        ),
    }
    calls = 0
    lora_add = batch_module._lora_add

    def counted(*args: Any) -> None:
        nonlocal calls
        calls += 1
        lora_add(*args)

    monkeypatch.setattr(batch_module, "_lora_add", counted)
    if kernels == "torch":
        monkeypatch.setattr(batch_module, "SINGLE_THREAD_MAX_ROWS", -1)
    llm = LLM(base, dtype="float32", device="cpu", kv_budget=8 * 2**20, max_model_len=256)
    rng = random.Random(5)
    names: list[str | None] = ["experts", None, "both", "down-only", "experts", "both"]
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(5, 60))] for _ in names]
    recorders = [Recorder() for _ in names]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=[r]) for r in recorders]
    loras = [LoRARequest(name, adapters[name]) if name else None for name in names]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    for name, prompt, output, recorder in zip(names, prompts, outputs, recorders, strict=True):
        assert output.outputs[0].finish_reason == "length", output.error
        tokens = output.outputs[0].token_ids
        reference = peft_logits(base, adapters[name] if name else None, prompt + tokens)
        for step, logits in enumerate(recorder.steps):
            torch.testing.assert_close(logits, reference[len(prompt) - 1 + step], atol=ATOL, rtol=0)
    assert (calls > 0) == (kernels == "native")
    # The expert LoRA takes pool pages as the rest of an adapter does: more than an attention-only adapter's.
    entries = {e.ref.name: e for e in llm.engine.adapters.resident()}
    assert len(entries["experts"].pages) > 0 and entries["experts"].layout is not None


def test_expert_adapters_that_do_not_fit_are_refused(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    base = checkpoint("qwen3-moe")
    config = ModelConfig.from_dir(base)
    folder = make_peft_adapter(
        base, tmp_path / "experts", seed=1, r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS
    )
    raw_config = json.loads((folder / "adapter_config.json").read_text())
    weights = (folder / "adapter_model.safetensors").read_bytes()
    # target_parameters naming nothing of this base, and a rank the tensors do not have.
    for change, why in (
        ({"target_parameters": ["mlp.experts.w1"]}, "selects no parameter"),
        ({"r": 8}, "expected"),
    ):
        with pytest.raises(AdapterError, match=why):
            parse_adapter(json.dumps({**raw_config, **change}).encode(), weights, config)
    # Per-expert modules (transformers 4's layout of the experts) are refused by name.
    per_expert = _hand_made_adapter(tmp_path / "per-expert", "model.layers.0.mlp.experts.0.gate_proj", 64, 32)
    with pytest.raises(AdapterError, match="each expert's own modules"):
        parse_adapter(
            (per_expert / "adapter_config.json").read_bytes(),
            (per_expert / "adapter_model.safetensors").read_bytes(),
            config,
        )


def test_what_is_not_served_yet_is_refused_by_name(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = checkpoint("qwen3-moe")
    with pytest.raises(CheckpointError, match="quantization 'int8' of a mixture-of-experts base"):
        LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20, quantization="int8")
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="gpt-oss is not supported yet"):
        ModelConfig.from_dict({**raw, "architectures": ["GptOssForCausalLM"]})
    llm = LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20, max_model_len=256)
    # peft's all-linear on an MoE base adapts the router too (refused by name), and an adapter on the dense layer's
    # MLP modules (layer 1 here) is refused.
    config = ModelConfig.from_dir(path)
    dense = _hand_made_adapter(
        tmp_path / "dense-mlp", "model.layers.1.mlp.down_proj", config.intermediate_size, config.hidden_size
    )
    for name, adapter, why in (
        (
            "all",
            make_peft_adapter(path, tmp_path / "all", seed=0, r=4, lora_alpha=4, target_modules="all-linear"),
            "LoRA on a mixture-of-experts router (mlp.gate) is not supported",
        ),
        ("dense-mlp", dense, "LoRA on the dense MLP modules"),
    ):
        (out,) = llm.generate(
            {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1), lora_request=LoRARequest(name, adapter)
        )
        assert out.outputs[0].finish_reason == "error" and why in (out.error or ""), out.error


def _hand_made_adapter(folder: Path, module: str, in_features: int, out_features: int, rank: int = 4) -> Path:
    """A LoRA adapter in peft's file layout on one module, written without peft."""
    folder.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [module.rsplit(".", 1)[1]]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = f"base_model.model.{module}"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.randn(rank, in_features) * 0.05,
            f"{prefix}.lora_B.weight": torch.randn(out_features, rank) * 0.05,
        },
        str(folder / "adapter_model.safetensors"),
    )
    return folder
