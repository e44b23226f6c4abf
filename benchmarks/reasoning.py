"""Reasoning effort tiers, measured: what each tier costs in tokens on the demo's thinking adapter, and what following
think blocks costs the engine.

1. tiers: the demo model with its `think` adapter (demo/adapters/think: a short think block, then the answer),
   served with the qwen3 parser and the demo budgets (none=0, minimal=8, low=16, medium=48, high=128), greedy, on
   the demo's sample questions. Per tier: mean reasoning and answer tokens, how many rows hit the budget (their
   block ends with the forced closing text), and the bill per 1,000 requests at the README tour's prices (input
   0.50, output 1.50 USD per 1M tokens; reasoning at the output price unless the price book sets its own).
2. overhead: the 56M benchmark model (engine/tools/demo.py's BENCHMARK_SPEC, float32), 32 chat requests at once,
   128 tokens out each, greedy, in three engines: no reasoning parser; the parser with no budget (the block is
   followed and counted, nothing forced); and a budget of 64 (the random model never closes its block, so every
   row has the closing text and end marker forced at token 64). Output tokens per second, median of the repeats,
   each run alternating the engines; the ratio of each to the first.

    .venv/bin/python benchmarks/reasoning.py [--repeats 5] [--threads 2]

writes benchmarks/results/reasoning.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.reasoning_config import ReasoningConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo" / "model"
THINK_DIR = REPO / "demo" / "adapters" / "think"
RESULTS = Path(__file__).parent / "results" / "reasoning.json"
DEMO_BUDGETS = {"none": 0, "minimal": 8, "low": 16, "medium": 48, "high": 128}
PRICES = {"input": 0.50, "output": 1.50}  # USD per 1M tokens, the README tour's
QUESTIONS = [
    'Tell me about the "for" statement.',
    'What is the "json" module?',
    "How do I write a class?",
    'Tell me about the "try" statement.',
    'What is the "with" statement?',
    'Explain the "import" statement.',
    'What is the "pathlib" module?',
    'Can you describe the "while" statement?',
]
NUM_ROWS = 32
MAX_TOKENS = 128


def tiers() -> dict[str, Any]:
    config = ReasoningConfig(parser="qwen3", budgets=DEMO_BUDGETS, default_effort="medium")
    llm = LLM(str(DEMO), reasoning=config, kv_budget=2**26)
    think = LoRARequest("think", str(THINK_DIR))
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    out: dict[str, Any] = {}
    for tier, budget in DEMO_BUDGETS.items():
        params = SamplingParams(temperature=0.0, max_tokens=200, thinking_token_budget=budget)
        kwargs = {"enable_thinking": False} if tier == "none" else None  # what the server passes for none
        results = llm.chat(conversations, params, lora_request=think, chat_template_kwargs=kwargs)
        reasoning = [r.outputs[0].reasoning.num_tokens if r.outputs[0].reasoning else 0 for r in results]
        completion = [len(r.outputs[0].token_ids) for r in results]
        prompts = [len(r.prompt_token_ids) for r in results]
        forced = sum(config.closing_text.strip() in r.outputs[0].text for r in results)
        cost = sum(p * PRICES["input"] + c * PRICES["output"] for p, c in zip(prompts, completion, strict=True))
        out[tier] = {
            "budget": budget,
            "mean_reasoning_tokens": statistics.mean(reasoning),
            "max_reasoning_tokens": max(reasoning),
            "mean_answer_tokens": statistics.mean(c - r for c, r in zip(completion, reasoning, strict=True)),
            "rows_at_budget": forced,
            "rows": len(results),
            "usd_per_1k_requests": cost / len(results) * 1000 / 1e6,
        }
        sample = results[0].outputs[0]
        out[tier]["sample"] = sample.text
        figures = out[tier]
        print(
            f"{tier:>8} (budget {budget:>3}): reasoning {figures['mean_reasoning_tokens']:6.1f} tokens "
            f"(max {max(reasoning)}), answer {figures['mean_answer_tokens']:5.1f}, "
            f"at budget {forced}/{len(results)}, ${figures['usd_per_1k_requests']:.4f} per 1k requests",
            flush=True,
        )
    return out


def overhead(repeats: int) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="reasoning-bench-"))
    write_random_model(folder, BENCHMARK_SPEC)
    reasoning = ReasoningConfig(parser="deepseek_r1")
    engines = {
        "off": LLM(str(folder), dtype="float32", kv_budget=2**29),
        "followed": LLM(str(folder), dtype="float32", kv_budget=2**29, reasoning=reasoning),
        "budget_64": LLM(str(folder), dtype="float32", kv_budget=2**29, reasoning=reasoning),
    }
    params = {
        "off": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        "followed": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, reasoning=True),
        "budget_64": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, thinking_token_budget=64),
    }
    conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}] for i in range(NUM_ROWS)]
    for llm in engines.values():  # warm-up
        llm.chat(conversations[:4], SamplingParams(temperature=0.0, max_tokens=8))
    runs: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for repeat in range(repeats):
        for name in order[repeat % len(order) :] + order[: repeat % len(order)]:
            started = time.perf_counter()
            results = engines[name].chat(conversations, params[name])
            seconds = time.perf_counter() - started
            tokens = sum(len(r.outputs[0].token_ids) for r in results)
            runs[name].append(tokens / seconds)
            if name == "budget_64":
                assert all(r.outputs[0].reasoning and r.outputs[0].reasoning.end for r in results)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {runs[n][-1]:.0f} tok/s" for n in order), flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratios = {
        name: statistics.median(v / off for v, off in zip(runs[name], runs["off"], strict=True)) for name in engines
    }
    return {"tokens_per_s": medians, "ratio_to_off": ratios, "runs": runs, "rows": NUM_ROWS, "max_tokens": MAX_TOKENS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "machine": machine(args.threads),
        "torch": torch.__version__,
        "tiers": tiers(),
        "overhead": overhead(args.repeats),
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
