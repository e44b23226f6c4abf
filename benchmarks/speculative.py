"""Speculative decoding against none, on the same model and engine, in one sitting.

Two workloads on the demo model (demo/model, greedy, 64 tokens out):
- copy: prompts that repeat a passage and start it a third time, the shape of edits and summaries, whose outputs
  repeat spans of their prompt;
- chat: the demo model's chat turns (ChatML), open questions about Python's documentation.
Each at concurrency 1, 4, 16 and 64 (the engine's max_num_seqs; 2 x concurrency requests, at least 8, all submitted
at once, so `concurrency` requests run at a time), with speculation off and with n-gram prompt lookup
(num_speculative_tokens 4, prompt_lookup 2..4, the engine's defaults otherwise). Runs alternate off / n-gram and
repeat; the medians are reported: output tokens per second, the ratio n-gram / off, and the acceptance figures
(kept / proposed, mean kept per verifying row-step). The draft-model method is not served yet and is not run.

    .venv/bin/python benchmarks/speculative.py [--repeats 3] [--threads 2]

writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.speculative_config import SpeculativeConfig

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo" / "model"
RESULTS = Path(__file__).parent / "results" / "speculative.json"
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
CONCURRENCY = (1, 4, 16, 64)
MAX_TOKENS = 64
PASSAGES = [
    'The "for" statement is used to iterate over the elements of a sequence (such as a string, tuple or list).',
    'The "if" statement is used for conditional execution: it selects exactly one of the suites.',
    'The "while" statement is used for repeated execution as long as an expression is true.',
    'The "try" statement specifies exception handlers and/or cleanup code for a group of statements.',
    'The "with" statement is used to wrap the execution of a block with methods defined by a context manager.',
    "The json module exposes an API familiar to users of the standard library marshal and pickle modules.",
]
QUESTIONS = [
    'Tell me about the "for" statement.',
    'What is the "json" module?',
    "What does the pathlib module do?",
    'Tell me about the "try" statement.',
    "How do I read a file line by line?",
    'What is the "with" statement for?',
    "Explain the difference between a list and a tuple.",
    'What is the "yield" keyword?',
]


def copy_prompts(count: int) -> list[Any]:
    prompts = []
    for i in range(count):
        passage = PASSAGES[i % len(PASSAGES)]
        half = passage[: len(passage) // 2]
        prompts.append(f"{passage}\n{passage}\n{half}")
    return prompts


def chat_prompts(llm: LLM, count: int) -> list[Any]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(count)
    ]


def measure(llm: LLM, prompts: list[Any]) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def speculation_totals(llm: LLM) -> dict[str, float]:
    speculator = llm.engine.scheduler.speculator
    if speculator is None:
        return {}
    counts = list(speculator.stats.by_adapter.values())
    proposed = sum(c.num_proposed for c in counts)
    accepted = sum(c.num_accepted for c in counts)
    steps = sum(c.num_steps for c in counts)
    return {
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": accepted / steps if steps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows: list[dict[str, Any]] = []
    for concurrency in CONCURRENCY:
        common = {"device": "cpu", "dtype": "float32", "max_num_seqs": concurrency, "num_threads": args.threads}
        engines = {"off": LLM(DEMO, **common), "ngram": LLM(DEMO, speculative_config=NGRAM, **common)}
        count = max(8, 2 * concurrency)
        workloads = {"copy": copy_prompts(count), "chat": chat_prompts(engines["off"], count)}
        for workload, prompts in workloads.items():
            for llm in engines.values():  # warm up: first-call costs out of the timed runs
                llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            runs: dict[str, list[dict[str, float]]] = {"off": [], "ngram": []}
            spec_llm = LLM(DEMO, speculative_config=NGRAM, **common)  # fresh books for this workload's figures
            for _ in range(args.repeats):
                runs["off"].append(measure(engines["off"], prompts))
                runs["ngram"].append(measure(spec_llm, prompts))
            off = statistics.median(r["tokens_per_s"] for r in runs["off"])
            ngram = statistics.median(r["tokens_per_s"] for r in runs["ngram"])
            row = {
                "workload": workload,
                "concurrency": concurrency,
                "requests": count,
                "off_tokens_per_s": round(off, 1),
                "ngram_tokens_per_s": round(ngram, 1),
                "ngram_vs_off": round(ngram / off, 3),
                **{k: round(v, 3) for k, v in speculation_totals(spec_llm).items()},
            }
            rows.append(row)
            print(json.dumps(row))

    result = {
        "benchmark": "speculative",
        "model": "demo/model (4.0M parameters, float32)",
        "max_tokens": MAX_TOKENS,
        "speculative_config": {
            "method": NGRAM.method,
            "num_speculative_tokens": NGRAM.num_speculative_tokens,
            "prompt_lookup_max": NGRAM.prompt_lookup_max,
            "prompt_lookup_min": NGRAM.prompt_lookup_min,
            "knee_tokens": 128,
        },
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
        "torch": torch.__version__,
        "rows": rows,
        "not_run": "draft_model: not served yet",
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
