"""What a split model serves on top of its base: mixed LoRA batches equal peft row by row (adapters split as S-LoRA
splits them, loaded, evicted and reloaded in step on every rank), and quantized weights (int8, int4, GPTQ) equal
their unsplit result (act-order GPTQ too); a split that would cut int4 groups is refused with a clear error."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _support.adapters import ADAPTER_SPECS, make_peft_adapter, peft_logits
from _support.checkpoints import VOCAB, make_checkpoint
from _support.prequantized import write_prequantized
from _support.recording import Recorder

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.errors import CheckpointError
from loraplex.kernels.quant import int8_activations

pytestmark = pytest.mark.unit

ATOL = 1e-4

ADAPTERS = {name: ADAPTER_SPECS[name] for name in ("r8-attn", "r64-all-rslora", "r8-mlp", "pattern")}


@pytest.fixture
def engines() -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(path: Path, size: int, **options: Any) -> LLM:
        made.append(LLM(path, dtype="float32", device="cpu", tensor_parallel_size=size, **options))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


@pytest.fixture
def weight_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Quantized matmuls with float activations in this process and in the ranks it starts (they read the variable
    at their start): what the weights hold is what is compared, to 1e-4."""
    monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", "0")
    int8_activations.cache_clear()
    yield
    int8_activations.cache_clear()


def _greedy(
    llm: LLM, prompts: list[list[int]], max_tokens: int, loras: list[LoRARequest | None] | None = None
) -> list[tuple[list[int], list[torch.Tensor]]]:
    recorders = [Recorder() for _ in prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logits_processors=[r]) for r in recorders
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    for output in outputs:
        assert output.outputs[0].finish_reason == "length", output.error
    return [(o.outputs[0].token_ids, r.steps) for o, r in zip(outputs, recorders, strict=True)]


def _assert_same(
    ours: list[tuple[list[int], list[torch.Tensor]]], theirs: list[tuple[list[int], list[torch.Tensor]]]
) -> None:
    for row, ((tokens, steps), (ref_tokens, ref_steps)) in enumerate(zip(ours, theirs, strict=True)):
        assert tokens == ref_tokens, f"row {row}"
        for a, b in zip(steps, ref_steps, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 80))] for _ in range(count)]


def test_mixed_lora_batches_equal_peft(
    checkpoint: Callable[..., Path], tmp_path: Path, engines: Callable[..., LLM]
) -> None:
    base = checkpoint("llama-gqa")
    adapters = {
        name: make_peft_adapter(base, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    # Two slots and no host tier for four adapters: every adapter is placed, evicted and placed again, and each
    # rank's pages must follow rank 0's slot table through all of it.
    llm = engines(
        base, 2, kv_budget=8 * 2**20, max_model_len=256, max_loras=2, max_adapters_per_batch=2, lora_host_budget=1
    )
    rng = random.Random(5)
    for round_seed in (1, 2):
        names: list[str | None] = [*adapters, None, None]
        choices = [names[i % len(names)] for i in range(12)]
        rng.shuffle(choices)
        prompts = _prompts(round_seed, len(choices))
        loras = [LoRARequest(name, adapters[name]) if name else None for name in choices]
        runs = _greedy(llm, prompts, 6, loras)
        for name, prompt, (tokens, steps) in zip(choices, prompts, runs, strict=True):
            reference = peft_logits(base, adapters[name] if name else None, prompt + tokens)
            for k, logits in enumerate(steps):
                torch.testing.assert_close(logits, reference[len(prompt) - 1 + k], atol=ATOL, rtol=0)
    assert len(llm.engine.adapters.resident()) <= 2


@pytest.mark.usefixtures("weight_only")
def test_int8_weights_split_equal_unsplit(checkpoint: Callable[..., Path], engines: Callable[..., LLM]) -> None:
    path = checkpoint("qwen2-bias")
    prompts = _prompts(3, 4)
    split = engines(path, 2, quantization="int8", kv_budget=8 * 2**20)
    whole = engines(path, 1, quantization="int8", kv_budget=8 * 2**20)
    _assert_same(_greedy(split, prompts, 8), _greedy(whole, prompts, 8))


def test_int8_with_8_bit_activations_stays_close_to_unsplit(
    trained_checkpoint: Callable[[str], Path], engines: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 8-bit activations a row-parallel rank rounds its slice of the input with its own scale per token, not the
    whole row's: the logits move a little (decision 0040), a trained model's greedy tokens do not."""
    monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", "1")
    int8_activations.cache_clear()
    try:
        path = trained_checkpoint("llama-gqa")
        prompts = _prompts(4, 4)
        split = _greedy(engines(path, 2, quantization="int8", kv_budget=8 * 2**20), prompts, 8)
        whole = _greedy(engines(path, 1, quantization="int8", kv_budget=8 * 2**20), prompts, 8)
    finally:
        int8_activations.cache_clear()
    worst = 0.0
    for (tokens, steps), (ref_tokens, ref_steps) in zip(split, whole, strict=True):
        assert tokens == ref_tokens
        for a, b in zip(steps, ref_steps, strict=True):
            worst = max(worst, float((a - b).abs().max()))
    assert worst < 0.3  # decision 0040 has the measured figure


@pytest.mark.usefixtures("weight_only")
def test_int4_weights_split_on_group_boundaries(tmp_path: Path, engines: Callable[..., LLM]) -> None:
    # Widths whose halves are whole int4 groups of 128: q (4 heads of 64) and the MLP.
    path = make_checkpoint(tmp_path / "wide", "llama-gqa", hidden_size=256, intermediate_size=256)
    prompts = _prompts(5, 3)
    split = engines(path, 2, quantization="int4", kv_budget=8 * 2**20)
    whole = engines(path, 1, quantization="int4", kv_budget=8 * 2**20)
    _assert_same(_greedy(split, prompts, 6), _greedy(whole, prompts, 6))


def test_int4_groups_that_ranks_would_cut_are_refused(checkpoint: Callable[..., Path]) -> None:
    # o_proj reads 64 features: int4 takes groups of 64, which 2 ranks of 32 features each would cut.
    with pytest.raises(CheckpointError, match="int4 groups of 64 input features do not split evenly over 2 ranks"):
        LLM(checkpoint("llama-gqa"), dtype="float32", device="cpu", quantization="int4", tensor_parallel_size=2)


@pytest.mark.usefixtures("weight_only")
@pytest.mark.parametrize(("method", "act_order"), [("gptq", False), ("gptq", True), ("awq", False)])
def test_prequantized_checkpoints_load_split(
    method: str, act_order: bool, checkpoint: Callable[..., Path], tmp_path: Path, engines: Callable[..., LLM]
) -> None:
    """Split on their group boundaries; an act-order checkpoint's o and down columns, scattered over every group,
    are kept dequantized by each rank, which serves the same values."""
    path = write_prequantized(checkpoint("llama-gqa"), tmp_path / method, method, 16, act_order=act_order)
    prompts = _prompts(6, 3)
    split = engines(path, 2, kv_budget=8 * 2**20)
    assert split.engine.state().quantization == method
    _assert_same(_greedy(split, prompts, 6), _greedy(engines(path, 1, kv_budget=8 * 2**20), prompts, 6))
