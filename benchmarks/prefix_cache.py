"""Prefix caching on a multi-turn chat trace: how much of the prompt comes from the cache, what that does to the time
to first token, and what the tenants pay with cache-aware prices.

The trace: 4 tenants, each with its own system prompt (512 tokens) and 3 conversations of 5-10 turns. Every turn
resends the whole history (system prompt, earlier questions and answers) plus a new question of 16-48 tokens, as
chat clients do; answers are 16-48 tokens. Each tenant has its own cache salt (as the platform sets it). Two
arrival patterns, each run with the prefix cache and without it on a random ~56M-parameter Llama:
- chat: conversations start 0.4 s apart (in a shuffled order) and a user reads and types for 0.3-1.2 s between
  an answer and the next question, as people do;
- burst: all 12 conversations start at once and every question follows its answer immediately (a stress case:
  a tenant's three conversations compute its system prompt side by side, before any of them can reuse it).

    .venv/bin/python benchmarks/prefix_cache.py [--threads 2]

writes benchmarks/results/prefix_cache.json. Prices are per 1M tokens (input 0.50, cached input 0.05 = a tenth,
output 1.50), the price book's default ratio; the tenant's bill is computed with and without the cached price.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.engine import SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

RESULTS = Path(__file__).parent / "results" / "prefix_cache.json"
NUM_TENANTS = 4
CONVERSATIONS_PER_TENANT = 3
SYSTEM_PROMPT_TOKENS = 512
TURNS = (5, 10)
QUESTION_TOKENS = (16, 48)
ANSWER_TOKENS = (16, 48)
ARRIVAL_GAP_S = 0.4
THINK_S = (0.3, 1.2)
PRICE_INPUT = Decimal("0.50")  # per 1M tokens
PRICE_CACHED = Decimal("0.05")
PRICE_OUTPUT = Decimal("1.50")


@dataclasses.dataclass(frozen=True)
class Conversation:
    tenant: int
    system: list[int]
    questions: list[list[int]]
    answer_lens: list[int]
    start_s: float  # when its first question arrives (chat pattern)
    think_s: list[float]  # the pause before each question after the first (chat pattern)


@dataclasses.dataclass
class Turn:
    tenant: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float


def make_trace(vocab: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(count)]

    conversations: list[Conversation] = []
    order = list(range(NUM_TENANTS * CONVERSATIONS_PER_TENANT))
    rng.shuffle(order)
    for tenant in range(NUM_TENANTS):
        system = tokens(SYSTEM_PROMPT_TOKENS)
        for _ in range(CONVERSATIONS_PER_TENANT):
            turns = rng.randint(*TURNS)
            conversations.append(
                Conversation(
                    tenant=tenant,
                    system=system,
                    questions=[tokens(rng.randint(*QUESTION_TOKENS)) for _ in range(turns)],
                    answer_lens=[rng.randint(*ANSWER_TOKENS) for _ in range(turns)],
                    start_s=order[len(conversations)] * ARRIVAL_GAP_S,
                    think_s=[rng.uniform(*THINK_S) for _ in range(turns)],
                )
            )
    return conversations


async def run_conversation(engine: AsyncEngine, conversation: Conversation, index: int, chat: bool) -> list[Turn]:
    history = list(conversation.system)
    turns = []
    if chat:
        await asyncio.sleep(conversation.start_s)
    for number, (question, answer_len) in enumerate(zip(conversation.questions, conversation.answer_lens, strict=True)):
        if chat and number:
            await asyncio.sleep(conversation.think_s[number])
        history += question
        params = SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True)
        started = time.perf_counter()
        first: float | None = None
        last = None
        async for output in engine.generate(
            list(history), params, f"c{index}-t{number}", cache_salt=f"tenant-{conversation.tenant}"
        ):
            if first is None and output.outputs[0].token_ids:
                first = time.perf_counter()
            last = output
        assert last is not None
        assert first is not None
        answer = last.outputs[0].token_ids
        turns.append(Turn(conversation.tenant, len(history), last.num_cached_tokens, len(answer), first - started))
        history += answer
    return turns


async def run_trace(model_dir: Path, trace: list[Conversation], prefix_caching: bool, chat: bool) -> dict[str, Any]:
    engine = await AsyncEngine.create(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            device="cpu",
            kv_budget=2 * 2**30,
            max_model_len=2048,
            enable_prefix_caching=prefix_caching,
        )
    )
    try:
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        async for _ in engine.generate([5] * 300, warm, "warm-up"):  # outside the clock: first-call allocations
            pass
        started = time.perf_counter()
        per_conversation = await asyncio.gather(
            *(run_conversation(engine, conversation, i, chat) for i, conversation in enumerate(trace))
        )
        elapsed = time.perf_counter() - started
    finally:
        await engine.shutdown()
    turns = [turn for conversation in per_conversation for turn in conversation]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    output = sum(t.output_tokens for t in turns)
    ttfts = sorted(t.ttft_s for t in turns)
    later = sorted(t.ttft_s for c in per_conversation for t in c[1:])  # turns that resend a history
    with_cache = (Decimal(prompt - cached) * PRICE_INPUT + Decimal(cached) * PRICE_CACHED + output * PRICE_OUTPUT) / (
        10**6
    )
    without_cache_pricing = (Decimal(prompt) * PRICE_INPUT + output * PRICE_OUTPUT) / 10**6
    return {
        "prefix_caching": prefix_caching,
        "seconds": elapsed,
        "turns": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "cached_fraction": cached / prompt,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(len(ttfts) * 0.9)],
        "ttft_later_turns_mean_s": statistics.fmean(later),
        "cost_usd_with_cache_pricing": str(with_cache.quantize(Decimal("0.000001"))),
        "cost_usd_without_cache_pricing": str(without_cache_pricing.quantize(Decimal("0.000001"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(Path(tmp) / "model", dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32"))
        trace = make_trace(BENCHMARK_SPEC.vocab_size)
        runs = {
            (pattern, caching): asyncio.run(run_trace(model_dir, trace, prefix_caching=caching, chat=pattern == "chat"))
            for pattern in ("chat", "burst")
            for caching in (True, False)
        }
    result: dict[str, Any] = {
        "machine": machine(args.threads),
        "trace": {
            "tenants": NUM_TENANTS,
            "conversations": len(trace),
            "system_prompt_tokens": SYSTEM_PROMPT_TOKENS,
            "turns": TURNS,
            "question_tokens": QUESTION_TOKENS,
            "answer_tokens": ANSWER_TOKENS,
            "chat_arrival_gap_s": ARRIVAL_GAP_S,
            "chat_think_s": THINK_S,
        },
        "prices_per_mtok_usd": {
            "input": str(PRICE_INPUT),
            "cached_input": str(PRICE_CACHED),
            "output": str(PRICE_OUTPUT),
        },
    }
    for pattern in ("chat", "burst"):
        cached, cold = runs[(pattern, True)], runs[(pattern, False)]
        saving = 1 - Decimal(cached["cost_usd_with_cache_pricing"]) / Decimal(cached["cost_usd_without_cache_pricing"])
        result[pattern] = {
            "with_prefix_cache": cached,
            "without_prefix_cache": cold,
            "ttft_ratio_mean": cached["ttft_mean_s"] / cold["ttft_mean_s"],
            "ttft_ratio_p50": cached["ttft_p50_s"] / cold["ttft_p50_s"],
            "tenant_saving_fraction": float(saving),
        }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
