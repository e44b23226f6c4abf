"""The engine computes what transformers computes: prefill logits at every position, every decode step's logits,
and the same greedy tokens, alone and inside batches with chunked prefill and preemption (float32, 1e-4)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.checkpoints import VARIANTS, VOCAB
from _support.recording import Recorder

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.kernels.paths import cpu_matmul

pytestmark = pytest.mark.unit

ATOL = 1e-4


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def _hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def _check_against_transformers(hf: Any, prompt: list[int], output_ids: list[int], steps: list[torch.Tensor]) -> None:
    reference = _hf_logits(hf, prompt + output_ids)
    assert len(steps) == len(output_ids)
    for k, logits in enumerate(steps):
        expected = reference[len(prompt) - 1 + k]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=lambda m, k=k: f"decode step {k}: {m}")
        assert int(expected.argmax()) == output_ids[k], f"greedy token {k} differs from transformers"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_at_every_position(variant: str, checkpoint: Callable[..., Path], hf_model: Any) -> None:
    path = checkpoint(variant)
    core = EngineCore(EngineConfig(model=path, dtype="float32", device="cpu", kv_budget=8 * 2**20))
    prompt = _prompt(random.Random(1), 90)
    core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1))
    # The engine's own step path, keeping the logits of every position instead of only the last.
    prepared = core.runner.prepare(core.scheduler.schedule())
    hidden = core.model.forward(prepared.batch, core.runner.kv_caches)
    ours = core.model.compute_logits(hidden)
    torch.testing.assert_close(ours, _hf_logits(hf_model(path), prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_logits_and_greedy_tokens(variant: str, checkpoint: Callable[..., Path], hf_model: Any) -> None:
    path = checkpoint(variant)
    llm = LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20)
    prompt = _prompt(random.Random(2), 70)
    recorder = Recorder()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logits_processors=[recorder])
    (output,) = llm.generate({"prompt_token_ids": prompt}, params)
    completion = output.outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 24
    _check_against_transformers(hf_model(path), prompt, completion.token_ids, recorder.steps)

    hf = hf_model(path)
    generated = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert completion.token_ids == generated[0, len(prompt) :].tolist()


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_batch_with_chunked_prefill_and_preemption(
    variant: str, checkpoint: Callable[..., Path], hf_model: Any
) -> None:
    path = checkpoint(variant)
    rng = random.Random(3)
    # 40 pages of 16 tokens for 16 requests needing about 150: preemption is certain. A 48-token step budget
    # splits every prompt longer than that over several steps.
    page_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers * (k, v) * kv heads * block * head_dim * float32
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        kv_budget=40 * page_bytes,
        max_model_len=256,
        max_num_batched_tokens=48,
        block_size=16,
    )
    prompts = [_prompt(rng, rng.randint(3, 130)) for _ in range(16)]
    recorders = [Recorder() for _ in prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(5, 30), ignore_eos=True, logits_processors=[r])
        for r in recorders
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    assert max(len(p) for p in prompts) > 48
    hf = hf_model(path)
    for prompt, param, output, recorder in zip(prompts, params, outputs, recorders, strict=True):
        completion = output.outputs[0]
        assert len(completion.token_ids) == param.max_tokens
        # A preempted request recomputes but samples each position once: one recorded step per token.
        _check_against_transformers(hf, prompt, completion.token_ids, recorder.steps)
    # Every KV page left is an idle prefix-cache block.
    assert llm.engine.pool.usage().by_kind["kv"] == llm.engine.state().prefix_cache_blocks


def test_preempted_output_equals_unpreempted(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama-gqa")
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": _prompt(rng, rng.randint(10, 100))} for _ in range(12)]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=25, ignore_eos=True) for i in range(12)
    ]
    roomy = LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20, max_model_len=256)
    tight = LLM(path, dtype="float32", device="cpu", kv_budget=30 * 8192, max_model_len=256, max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]  # type: ignore[arg-type]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]  # type: ignore[arg-type]
    assert tight.engine.num_preemptions > 0
    assert roomy.engine.num_preemptions == 0
    assert got == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_and_agree(
    dtype: torch.dtype, checkpoint: Callable[..., Path], hf_model: Any
) -> None:
    path = checkpoint("llama-gqa", dtype)
    prompt = _prompt(random.Random(5), 40)
    # Served in its own dtype, the model tracks transformers' float32 run of the same (rounded) weights.
    core = EngineCore(
        EngineConfig(
            model=path, dtype="bfloat16" if dtype == torch.bfloat16 else "float16", device="cpu", kv_budget=4 * 2**20
        )
    )
    assert core.dtype == dtype
    core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1))
    prepared = core.runner.prepare(core.scheduler.schedule())
    ours = core.model.compute_logits(core.model.forward(prepared.batch, core.runner.kv_caches))
    reference = _hf_logits(hf_model(path), prompt)
    assert (ours - reference).abs().max() < 0.25
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    # auto serves half checkpoints in float32 on a CPU.
    assert EngineCore(EngineConfig(model=path, device="cpu", kv_budget=4 * 2**20)).dtype == torch.float32


@pytest.fixture(params=["blas", "onednn"])
def cpu_matmul_library(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each library that multiplies float32 weights on a CPU (kernels/paths.py), whichever this CPU would
    pick: the suite's other tests run the CPU's own choice."""
    monkeypatch.setenv("LORAPLEX_CPU_MATMUL", request.param)
    cpu_matmul.cache_clear()
    assert cpu_matmul() == request.param
    yield request.param
    monkeypatch.undo()
    cpu_matmul.cache_clear()


def test_float32_weights_take_their_librarys_layout(checkpoint: Callable[..., Path], cpu_matmul_library: str) -> None:
    """On a CPU, float32 projections and an untied lm_head are stored input-major for MKL (its faster layout at
    decode sizes, docs/decisions/0017) and row-major for oneDNN (0055); half types and a tied lm_head (the
    embedding table itself) stay row-major."""
    untied = EngineCore(EngineConfig(model=checkpoint("llama-gqa"), dtype="float32", device="cpu", kv_budget=2**20))
    layer = untied.model.layers[0]
    for weight in (layer.qkv, layer.o, layer.gate_up, layer.down, untied.model.lm_head):
        assert isinstance(weight, torch.Tensor)
        if cpu_matmul_library == "blas":
            assert weight.t().is_contiguous() and not weight.is_contiguous()
        else:
            assert weight.is_contiguous()
    assert untied.model.embed.is_contiguous()

    tied = EngineCore(EngineConfig(model=checkpoint("llama-tied"), dtype="float32", device="cpu", kv_budget=2**20))
    assert tied.model.lm_head is tied.model.embed and tied.model.embed.is_contiguous()

    half = EngineCore(EngineConfig(model=checkpoint("llama-gqa"), dtype="bfloat16", device="cpu", kv_budget=2**20))
    assert half.model.layers[0].qkv.is_contiguous() and half.model.lm_head.is_contiguous()


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_each_cpu_matmul_library_computes_what_transformers_computes(
    variant: str, checkpoint: Callable[..., Path], hf_model: Any, cpu_matmul_library: str
) -> None:
    """Prefill and decode logits and greedy tokens through oneDNN's and MKL's matmuls alike (a bias included)."""
    path = checkpoint(variant)
    llm = LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20)
    rng = random.Random(7)
    prompts = [_prompt(rng, n) for n in (5, 40, 90)]
    recorders = [Recorder() for _ in prompts]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=[r]) for r in recorders]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output, recorder in zip(prompts, outputs, recorders, strict=True):
        _check_against_transformers(hf_model(path), prompt, list(output.outputs[0].token_ids), recorder.steps)
