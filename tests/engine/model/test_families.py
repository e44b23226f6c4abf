"""Every new base family computes what transformers (and peft, for adapters) computes, through every path: prefill
logits at every position and greedy decoding over prompts longer than the sliding windows, chunked prefill with
preemption, prefix-cache hits, and a mixed batch of base rows and LoRA rows (Phi-3's fused qkv_proj and gate_up_proj
included); LongRoPE's short and long factors; float32, 1e-4. The variants are in _support/checkpoints.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.adapters import make_peft_adapter, peft_logits
from _support.checkpoints import FAMILY_VARIANTS, MOE_VARIANTS, VARIANTS, VOCAB
from _support.engine_runs import assert_same_runs, decode_run, prefill_logits
from _support.recording import Recorder

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore

pytestmark = pytest.mark.unit

ATOL = 1e-4


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def _hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def _check_steps(reference: torch.Tensor, prompt: list[int], output: list[int], steps: list[torch.Tensor]) -> None:
    assert len(steps) == len(output)
    for k, logits in enumerate(steps):
        expected = reference[len(prompt) - 1 + k]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=lambda m, k=k: f"decode step {k}: {m}")
        assert int(expected.argmax()) == output[k], f"greedy token {k} differs from the reference"


def _window(variant: str) -> int | None:
    window = VARIANTS[variant].get("sliding_window")
    return window if isinstance(window, int) else None


def _prompt_lengths(variant: str) -> list[int]:
    """Prompts past every window; for LongRoPE, one within the original context (short factors, staying there while
    it decodes) and one past it (long factors)."""
    original = VARIANTS[variant].get("original_max_position_embeddings")
    if isinstance(original, int):
        return [original - 30, original + 30]
    return [90]


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_prefill_logits_at_every_position(variant: str, checkpoint: Callable[..., Path], hf_model: Any) -> None:
    path = checkpoint(variant)
    for length in _prompt_lengths(variant):
        core = EngineCore(EngineConfig(model=path, dtype="float32", device="cpu", kv_budget=8 * 2**20))
        prompt = _prompt(random.Random(length), length)
        window = _window(variant)
        assert window is None or length > window
        core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1))
        prepared = core.runner.prepare(core.scheduler.schedule())
        ours = core.model.compute_logits(core.model.forward(prepared.batch, core.runner.kv_caches))
        torch.testing.assert_close(ours, _hf_logits(hf_model(path), prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_decode_logits_and_greedy_tokens(variant: str, checkpoint: Callable[..., Path], hf_model: Any) -> None:
    path = checkpoint(variant)
    hf = hf_model(path)
    llm = LLM(path, dtype="float32", device="cpu", kv_budget=8 * 2**20)
    for length in _prompt_lengths(variant):
        prompt = _prompt(random.Random(2 + length), length)
        recorder = Recorder()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logits_processors=[recorder])
        (output,) = llm.generate({"prompt_token_ids": prompt}, params)
        tokens = output.outputs[0].token_ids
        _check_steps(_hf_logits(hf, prompt + tokens), prompt, tokens, recorder.steps)
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert tokens == generated[0, length:].tolist()


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_batch_with_chunked_prefill_preemption_and_prefix_hits(
    variant: str, checkpoint: Callable[..., Path], hf_model: Any
) -> None:
    path = checkpoint(variant)
    hf = hf_model(path)
    rng = random.Random(3)
    # A window caps what a sequence holds (its window's blocks, not all of them): a smaller pool still preempts.
    blocks = 40 if _window(variant) is None else 16
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        kv_budget=blocks * _page_bytes(path),
        max_model_len=256,
        max_num_batched_tokens=48,
        block_size=16,
    )
    shared = _prompt(rng, 70)  # a prefix several prompts start with: later ones find its blocks cached
    prompts = [
        shared + _prompt(rng, rng.randint(3, 30)) if i % 3 == 0 else _prompt(rng, _length(variant, rng))
        for i in range(16)
    ]
    recorders = [Recorder() for _ in prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(5, 30), ignore_eos=True, logits_processors=[r])
        for r in recorders
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    for prompt, output, recorder in zip(prompts, outputs, recorders, strict=True):
        tokens = output.outputs[0].token_ids
        _check_steps(_hf_logits(hf, prompt + tokens), prompt, tokens, recorder.steps)

    # The shared prefix again, twice, alone: the second finds its blocks in the prefix cache (with windows, the pages
    # of the blocks its window reads too, which the pressure above may have evicted, so the first puts them back), and
    # the answers are still transformers'.
    for attempt in range(2):
        recorder = Recorder()
        prompt = [*shared, *_prompt(rng, 5)]
        (again,) = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logits_processors=[recorder]),
        )
        if attempt or _window(variant) is None:
            assert (again.num_cached_tokens or 0) >= 64
        tokens = again.outputs[0].token_ids
        _check_steps(_hf_logits(hf, prompt + tokens), prompt, tokens, recorder.steps)


def _length(variant: str, rng: random.Random) -> int:
    """A prompt length up to 130; for LongRoPE, one whose sequence stays on one side of the original context (a short
    prompt keeps the short factors while it decodes past it, which no transformers forward reproduces: decision
    0045)."""
    original = VARIANTS[variant].get("original_max_position_embeddings")
    if not isinstance(original, int):
        return rng.randint(3, 130)
    return rng.choice([rng.randint(3, original - 30), rng.randint(original + 1, 130)])


def _page_bytes(path: Path) -> int:
    """One 16-token block of this checkpoint's KV in every layer (float32), as its engine sizes it: a page, or for a
    model of sliding and global layers one page per KV group (so every family gets the same memory)."""
    core = EngineCore(
        EngineConfig(model=path, dtype="float32", device="cpu", kv_budget=2**20, block_size=16, max_model_len=256)
    )
    return core.pool.page_bytes * core.kv_groups.num_groups


def _adapter_specs(variant: str) -> dict[str, dict[str, Any]]:
    if VARIANTS[variant]["arch"] == "phi3":
        return {
            "fused-all": {
                "r": 8,
                "lora_alpha": 16,
                "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
            },
            "fused-qkv": {"r": 16, "lora_alpha": 8, "target_modules": ["qkv_proj"], "use_rslora": True},
        }
    if variant in MOE_VARIANTS:  # attention only, experts only (peft's target_parameters) and both
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        return {
            "attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            "experts": {"r": 4, "lora_alpha": 8, "target_modules": [], "target_parameters": experts},
            "both-rslora": {
                "r": 16,
                "lora_alpha": 8,
                "target_modules": ["q_proj", "v_proj"],
                "target_parameters": experts[1:],
                "use_rslora": True,
            },
        }
    return {
        "attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "all": {"r": 16, "lora_alpha": 8, "target_modules": "all-linear"},
    }


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_mixed_batch_of_base_and_lora_rows(variant: str, checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    base = checkpoint(variant)
    adapters = {
        name: make_peft_adapter(base, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(_adapter_specs(variant).items())
    }
    llm = LLM(base, dtype="float32", device="cpu", kv_budget=8 * 2**20, max_num_batched_tokens=64)
    rng = random.Random(4)
    names: list[str | None] = [*adapters, None]
    choices = [names[i % len(names)] for i in range(9)]
    prompts = [_prompt(rng, _length(variant, rng)) for _ in choices]
    recorders = [Recorder() for _ in choices]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logits_processors=[r]) for r in recorders]
    loras = [LoRARequest(name, adapters[name]) if name else None for name in choices]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    for name, prompt, output, recorder in zip(choices, prompts, outputs, recorders, strict=True):
        assert output.outputs[0].finish_reason == "length", output.error
        tokens = output.outputs[0].token_ids
        reference = peft_logits(base, adapters[name] if name else None, prompt + tokens)
        _check_steps(reference, prompt, tokens, recorder.steps)


# --- tensor parallelism and n-gram speculation, on Qwen3 and Gemma 3 ------------------------------------------------


@pytest.mark.parametrize("variant", ["qwen3", "gemma3"])
def test_tensor_parallel_computes_the_unsplit_model(variant: str, checkpoint: Callable[..., Path]) -> None:
    path = checkpoint(variant)
    options: dict[str, Any] = {"max_model_len": 256, "max_num_batched_tokens": 48, "kv_budget": 8 * 2**20}
    split = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, **options)
    whole = LLM(path, dtype="float32", device="cpu", **options)
    try:
        rng = random.Random(5)
        prompt = _prompt(rng, 90)
        torch.testing.assert_close(prefill_logits(split, prompt), prefill_logits(whole, prompt), atol=ATOL, rtol=0)
        prompts = [_prompt(rng, rng.randint(3, 110)) for _ in range(8)]
        max_tokens = [rng.randint(4, 20) for _ in prompts]
        assert_same_runs(decode_run(split, prompts, max_tokens), decode_run(whole, prompts, max_tokens))
    finally:
        split.close()
        whole.close()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.mark.parametrize("variant", ["qwen3", "gemma3"])
def test_ngram_speculation_answers_as_without_it(variant: str, trained_checkpoint: Callable[[str], Path]) -> None:
    """On a checkpoint trained on a bigram language, whose greedy answers fall into cycles, so prompt lookup finds
    proposals; base and LoRA-free rows, chunked prefill."""
    path = trained_checkpoint(variant)
    rng = random.Random(6)
    prompts = [{"prompt_token_ids": _prompt(rng, rng.randint(30, 80))} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "kv_budget": 8 * 2**20,
        "max_num_batched_tokens": 48,
    }
    plain = LLM(path, **options)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    speculative = LLM(
        path, speculative_config=NGRAM, speculative_knee_tokens=64, speculative_use_clock=False, **options
    )
    got = [o.outputs[0].token_ids for o in speculative.generate(prompts, params)]
    assert got == expected
    speculator = speculative.engine.scheduler.speculator
    assert speculator is not None
    counts = list(speculator.stats.by_adapter.values())
    assert sum(c.num_proposed for c in counts) > 0
    assert sum(c.num_accepted for c in counts) > 0
