"""Speculative decoding against none, on the same model and engine, in one sitting.

Two workloads on the demo model (demo/model, greedy, 64 tokens out), every other request on the demo's "upper"
LoRA adapter (so the figures per adapter are the base model's and the adapter's):
- copy: the second turn of a chat in which the user asks the model to say its first answer again (the model's own
  greedy answer is in the prompt): outputs that repeat spans of their prompt, the shape of edits and summaries;
- chat: the demo model's first chat turns (ChatML), open questions about Python's documentation.
Each at concurrency 1, 4, 16 and 64 (the engine's max_num_seqs; 2 x concurrency requests, at least 8, all submitted
at once, so `concurrency` requests run at a time), with speculation off, with n-gram prompt lookup
(num_speculative_tokens 4, prompt_lookup 2..4) and with a draft model (the demo model's first layer with its
embeddings, norm and head: engine/tools/draft.py, num_speculative_tokens 4; `upper` carries a draft counterpart, its
own first layer, in a `draft/` folder); the engine's defaults otherwise, the load-adaptive policy and its gate
included. A second engine without speculation (off_again) runs beside them: its ratio to off is the noise of the
sitting. Runs alternate (each repeat starting one engine later) and repeat; reported: each engine's median output
tokens per second and every run, each method's ratio to off (the median over repeats of its run over off's run in
the same repeat), and the acceptance figures per adapter (kept / proposed, mean kept per verifying row-step, emitted
per verifying row-step).

    .venv/bin/python benchmarks/speculative.py [--repeats 7] [--threads 2]

writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.speculative_config import SpeculativeConfig
from loraplex.engine.tools.draft import make_truncated_draft, make_truncated_draft_adapter

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo" / "model"
UPPER_DIR = REPO / "demo" / "adapters" / "upper"
RESULTS = Path(__file__).parent / "results" / "speculative.json"
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
DRAFT_LAYERS = 1
CONCURRENCY = (1, 4, 16, 64)
MAX_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
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


def chat_prompts(llm: LLM, count: int) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(count)
    ]


def copy_prompts(llm: LLM, count: int, upper: LoRARequest) -> list[str]:
    """Second turns: the question, the model's own first answer (greedy, as the adapter of the request's slot gives
    it), and a request to say it again."""
    tokenizer = llm.get_tokenizer()
    first = llm.generate(
        chat_prompts(llm, count),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        lora_request=loras(count, upper),
    )
    return [
        tokenizer.apply_chat_template(
            [
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
                {"role": "assistant", "content": first[i].outputs[0].text},
                {"role": "user", "content": "Say that again, please."},
            ]
        )
        for i in range(count)
    ]


def loras(count: int, upper: LoRARequest) -> list[LoRARequest | None]:
    return [upper if i % 2 else None for i in range(count)]


def measure(llm: LLM, prompts: list[str], upper: LoRARequest) -> dict[str, float]:
    gc.collect()
    gc.disable()  # a collection inside one engine's run and not another's is noise, not the engine
    try:
        started = time.perf_counter()
        outputs = llm.generate(prompts, GREEDY, lora_request=loras(len(prompts), upper))
        elapsed = time.perf_counter() - started
    finally:
        gc.enable()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed}


def speculation_figures(llm: LLM) -> dict[str, dict[str, float]]:
    """Acceptance per adapter ("base" for the base model), from the speculator's books (the /metrics counters)."""
    speculator = llm.engine.scheduler.speculator
    assert speculator is not None
    figures = {}
    for adapter, c in sorted(speculator.stats.by_adapter.items()):
        figures[adapter or "base"] = {
            "proposed": c.num_proposed,
            "accepted": c.num_accepted,
            "acceptance_rate": round(c.num_accepted / c.num_proposed, 3) if c.num_proposed else 0.0,
            "mean_accepted_length": round(c.num_accepted / c.num_steps, 3) if c.num_steps else 0.0,
            "mean_emitted_length": round(c.num_emitted / c.num_steps, 3) if c.num_steps else 0.0,
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workdir = Path(tempfile.mkdtemp(prefix="loraplex-speculative-"))
    draft_dir = make_truncated_draft(DEMO, workdir / "draft", DRAFT_LAYERS)
    # The demo's upper adapter with its draft counterpart (the same cut of its layers) beside its files; the engines
    # without a draft read only its two files.
    upper_dir = workdir / "upper"
    shutil.copytree(UPPER_DIR, upper_dir)
    make_truncated_draft_adapter(UPPER_DIR, upper_dir / "draft", DRAFT_LAYERS)
    upper = LoRARequest("upper", str(upper_dir))
    configs = {
        "ngram": NGRAM,
        "draft": SpeculativeConfig(method="draft_model", model=draft_dir, num_speculative_tokens=4),
    }

    rows: list[dict[str, Any]] = []
    for concurrency in CONCURRENCY:
        common = {"device": "cpu", "dtype": "float32", "max_num_seqs": concurrency, "num_threads": args.threads}
        off = LLM(DEMO, **common)
        count = max(8, 2 * concurrency)
        workloads = {"copy": copy_prompts(off, count, upper), "chat": chat_prompts(off, count)}
        for workload, prompts in workloads.items():
            # Fresh engines per workload: each one's books are this workload's figures.
            # A second engine without speculation (off_again): its ratio to off is this machine's noise, the yardstick
            # of every other ratio in the row.
            engines = {"off": off, "off_again": LLM(DEMO, **common)} | {
                name: LLM(DEMO, speculative_config=c, **common) for name, c in configs.items()
            }
            for llm in engines.values():  # warm up: first-call costs (adapter loads) out of the timed runs
                llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), lora_request=loras(2, upper))
            runs: dict[str, list[float]] = {name: [] for name in engines}
            names = list(engines)
            for repeat in range(args.repeats):
                # Each repeat starts with the next engine: none always runs right after the same other.
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    runs[name].append(measure(engines[name], prompts, upper)["tokens_per_s"])
            row: dict[str, Any] = {"workload": workload, "concurrency": concurrency, "requests": count}
            for name, values in runs.items():
                row[f"{name}_tokens_per_s"] = round(statistics.median(values), 1)
                row[f"{name}_runs"] = [round(value, 1) for value in values]
            # Ratios are paired: each repeat's run over off's run of the same repeat, then the median of those, so a
            # machine that drifts over the sitting (it does: minutes-long swings of 20%) moves both sides of a ratio.
            for name in ("off_again", *configs):
                paired = [mine / off for mine, off in zip(runs[name], runs["off"], strict=True)]
                row[f"{name}_vs_off"] = round(statistics.median(paired), 3)
            for name in configs:
                row[f"{name}_acceptance"] = speculation_figures(engines[name])
            rows.append(row)
            print(json.dumps(row))

    result = {
        "benchmark": "speculative",
        "model": "demo/model (4.0M parameters, float32), every other request on the demo's upper adapter",
        "max_tokens": MAX_TOKENS,
        "speculative_configs": {
            "ngram": {
                "method": "ngram",
                "num_speculative_tokens": NGRAM.num_speculative_tokens,
                "prompt_lookup_max": NGRAM.prompt_lookup_max,
                "prompt_lookup_min": NGRAM.prompt_lookup_min,
            },
            "draft": {
                "method": "draft_model",
                "model": f"demo/model's first {DRAFT_LAYERS} layer(s) (engine/tools/draft.py)",
                "upper_counterpart": f"upper's first {DRAFT_LAYERS} layer(s) in its draft/ folder",
                "num_speculative_tokens": 4,
            },
            "knee_tokens": 128,
        },
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": {**machine(args.threads), "python": platform.python_version()},
        "torch": torch.__version__,
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
