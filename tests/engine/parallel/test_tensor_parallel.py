"""A model split over 2 or 4 ranks (gloo, one CPU process each) computes what the unsplit engine computes: prefill
logits at every position and every decode step's logits within 1e-4 in float32, the same greedy tokens, with chunked
prefill and preemption; for grouped-query attention with fewer KV heads than ranks (replicated KV heads), Qwen2's
biases, and tied embeddings (a vocabulary-parallel lm_head)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _support.checkpoints import VOCAB
from _support.engine_runs import ATOL, assert_same_runs, decode_run, prefill_logits

from loraplex.engine import LLM

pytestmark = pytest.mark.unit


def _llm(path: Path, size: int, **options: object) -> LLM:
    return LLM(path, dtype="float32", device="cpu", tensor_parallel_size=size, **options)  # type: ignore[arg-type]


@pytest.fixture
def engines() -> Iterator[Callable[..., LLM]]:
    """engines(path, size, **options) -> an LLM, closed (its ranks stopped) after the test."""
    made: list[LLM] = []

    def make(path: Path, size: int, **options: object) -> LLM:
        made.append(_llm(path, size, **options))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


@pytest.mark.parametrize(
    ("variant", "size", "kv_heads"),
    [
        ("llama-gqa", 2, 2),  # 2 KV heads: one per rank
        ("llama-gqa", 4, 2),  # 2 KV heads over 4 ranks: each replicated on two
        ("llama3-rope", 2, 1),  # one KV head, on both ranks
        ("qwen2-bias", 2, 2),  # q/k/v biases split with their rows
        ("llama-tied", 4, 4),  # the tied lm_head is the vocabulary-parallel embedding
    ],
)
def test_split_model_computes_the_unsplit_logits(
    variant: str, size: int, kv_heads: int, checkpoint: Callable[..., Path], engines: Callable[..., LLM]
) -> None:
    path = checkpoint(variant)
    # A small step budget splits the longer prompts over steps. The budget (per rank) holds 17 pages of the whole
    # model's KV heads, 2 * 17 or 4 * 17 of a rank's: the batch below needs about 50 of them, so both preempt.
    page_bytes = 2 * 2 * kv_heads * 16 * 16 * 4  # layers * (k, v) * kv heads * block * head_dim * float32
    options = {"max_model_len": 256, "max_num_batched_tokens": 48, "kv_budget": 17 * page_bytes}
    split, whole = engines(path, size, **options), engines(path, 1, **options)
    assert split.engine.model.config.num_heads == 4 // size

    rng = random.Random(size)
    prompt = [rng.randrange(2, VOCAB) for _ in range(90)]
    torch.testing.assert_close(prefill_logits(split, prompt), prefill_logits(whole, prompt), atol=ATOL, rtol=0)

    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 110))] for _ in range(12)]
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    assert_same_runs(decode_run(split, prompts, max_tokens), decode_run(whole, prompts, max_tokens))
    assert whole.engine.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    if size * 17 < 50:
        assert split.engine.num_preemptions > 0


def test_each_rank_keeps_its_share(checkpoint: Callable[..., Path], engines: Callable[..., LLM]) -> None:
    """Rank 0 holds its shard only (the engine reports all ranks' weights), and its pages hold its KV heads."""
    path = checkpoint("llama-gqa")
    whole, split = engines(path, 1, kv_budget=2**20), engines(path, 2, kv_budget=2**20)
    assert split.engine.model.weight_bytes() < 0.6 * whole.engine.model.weight_bytes()
    assert split.engine.state().weight_bytes == pytest.approx(whole.engine.state().weight_bytes, rel=0.01)
    assert split.engine.pool.page_bytes * 2 == whole.engine.pool.page_bytes
    assert split.engine.pool.num_pages == 2 * whole.engine.pool.num_pages  # the same budget per rank
    assert len(split.engine.worker_pids) == 1
