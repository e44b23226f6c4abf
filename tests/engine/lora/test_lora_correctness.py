"""Multi-LoRA batches compute what peft computes, row by row (float32, 1e-4): mixed ranks and targets, rsLoRA,
alpha != r, rank patterns, base rows beside adapter rows, chunked prefill, preemption, eviction and reload."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.adapters import ADAPTER_SPECS, make_peft_adapter, peft_logits
from _support.recording import Recorder

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.lora import batch as batch_module
from loraplex.kernels import native

pytestmark = pytest.mark.unit

ATOL = 1e-4
VOCAB = 512


@pytest.fixture(scope="module")
def base_and_adapters(
    checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Path]]:
    base = checkpoint("llama-gqa")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: make_peft_adapter(base, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    return base, adapters


def _check(base: Path, adapter: Path | None, prompt: list[int], output: list[int], steps: list[torch.Tensor]) -> None:
    reference = peft_logits(base, adapter, prompt + output)
    assert len(steps) == len(output)
    for k, logits in enumerate(steps):
        expected = reference[len(prompt) - 1 + k]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        assert int(expected.argmax()) == output[k]


def _run_mixed(
    llm: LLM, base: Path, adapters: dict[str, Path], *, seed: int, rows: int = 16, outputs: tuple[int, int] = (4, 12)
) -> None:
    rng = random.Random(seed)
    names: list[str | None] = [*adapters, None, None]
    choices = [names[i % len(names)] for i in range(rows)]
    rng.shuffle(choices)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 100))] for _ in choices]
    recorders = [Recorder() for _ in choices]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(*outputs), ignore_eos=True, logits_processors=[r])
        for r in recorders
    ]
    loras = [LoRARequest(name, adapters[name]) if name else None for name in choices]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    for name, prompt, output, recorder in zip(choices, prompts, outputs, recorders, strict=True):
        assert output.outputs[0].finish_reason == "length", output.error
        assert output.lora_name == name
        _check(base, adapters[name] if name else None, prompt, output.outputs[0].token_ids, recorder.steps)


def test_mixed_batch_with_chunked_prefill_and_preemption(base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = base_and_adapters
    page_bytes = 2 * 2 * 2 * 16 * 16 * 4
    llm = LLM(
        base,
        dtype="float32",
        device="cpu",
        kv_budget=100 * page_bytes,  # the 8 adapters alone take 121 pages: idle ones are evicted for KV
        max_model_len=256,
        max_num_batched_tokens=48,
        max_num_seqs=12,
    )
    # Loads run on worker threads: on a busy machine they would finish one by one and the requests would start
    # too far apart to run out of pages. Once every adapter is in host memory, placing one is part of the step.
    warm_up = [LoRARequest(name, path) for name, path in adapters.items()]
    llm.generate([{"prompt_token_ids": [2, 3]}] * len(warm_up), SamplingParams(max_tokens=1), lora_request=warm_up)
    _run_mixed(llm, base, adapters, seed=1, outputs=(40, 80))
    assert llm.engine.num_preemptions > 0
    # Every KV page left is an idle prefix-cache block.
    assert llm.engine.pool.usage().by_kind["kv"] == llm.engine.state().prefix_cache_blocks


def test_adapters_evicted_and_reloaded(base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = base_and_adapters
    # 3 slots for 8 adapters and a host tier too small to keep them: every adapter is evicted and reloaded.
    llm = LLM(
        base,
        dtype="float32",
        device="cpu",
        kv_budget=8 * 2**20,
        max_model_len=256,
        max_loras=3,
        max_adapters_per_batch=3,
        lora_host_budget=1,
    )
    _run_mixed(llm, base, adapters, seed=2)
    _run_mixed(llm, base, adapters, seed=3)
    assert len(llm.engine.adapters.resident()) <= 3


def test_decode_steps_go_through_the_native_operator(
    base_and_adapters: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the native CPU operators built (`make` builds them), decode-sized LoRA steps call lora_add, and the
    rows still match peft: the torch path is not silently taken instead."""
    if not native.load():
        pytest.fail("the native CPU operators are not built: `make` builds them", pytrace=False)
    calls = 0
    lora_add = torch.ops.loraplex_cpu.lora_add

    def counted(*args: Any) -> None:
        nonlocal calls
        calls += 1
        lora_add(*args)

    monkeypatch.setattr(batch_module, "_lora_add", counted)
    base, adapters = base_and_adapters
    llm = LLM(base, dtype="float32", device="cpu", kv_budget=8 * 2**20, max_model_len=256)
    _run_mixed(llm, base, adapters, seed=4, rows=10)
    assert calls > 0
