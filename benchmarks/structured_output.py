"""Structured outputs: what grammar masks cost the engine workload, and how long a schema takes to compile.

The engine workload of engine_throughput.py (64 requests of mixed lengths, all at once, on the random ~50M-parameter
Llama) runs with 0, 16 and all 64 of its requests under a JSON schema, alternating, in one sitting. The schema (an
array of at least 200 short strings) cannot be finished within any request's max_tokens, so every constrained row
is masked at every step and produces exactly as many tokens as the unconstrained run: the tokens/s compare like
for like. Since this machine's speed moves by 20 % between runs, the time spent filling and applying the masks is
also measured directly, as a share of each run. Compile time: the issue's kind of schema (nested objects, arrays,
enums, bounds, anyOf, patterns), cold (a new compiler: xgrammar's tokenizer tables made, then the schema compiled)
and from the cache.

    .venv/bin/python benchmarks/structured_output.py [--threads 2] [--repeats 2]

writes benchmarks/results/structured_output.json.
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
from engine_throughput import make_workload
from serve_launch import machine

import loraplex.engine.core.engine_core as engine_core_module
import loraplex.engine.core.sampler as sampler_module
from loraplex.engine import LLM, SamplingParams, StructuredOutputsParams
from loraplex.engine.core.structured_output import GrammarCompiler
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

RESULTS = Path(__file__).parent / "results" / "structured_output.json"


class Timed:
    """Wraps a module function and adds up the seconds spent in it: the masks' own cost, which the machine's
    run-to-run noise (often 20 % here) would hide in tokens/s."""

    def __init__(self, module: Any, name: str) -> None:
        self.seconds = 0.0
        self._inner = getattr(module, name)
        setattr(module, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


ENDLESS = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200}
COMPILE_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 32},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["name", "age"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "minItems": 1, "maxItems": 5},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "status": {"anyOf": [{"const": "open"}, {"const": "closed"}, {"type": "null"}]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
            "maxItems": 10,
        },
    },
    "required": ["id", "user", "tags"],
}
MODES = (0, 16, 64)
FILL = Timed(engine_core_module, "fill_bitmasks")  # the matchers fill the step's bitmask
ADJUST = Timed(sampler_module, "adjusted_logits")  # logits masked (and, for other rows, biased or penalized)


def run(llm: LLM, workload: Any, num_constrained: int) -> dict[str, Any]:
    """The workload with `num_constrained` requests under the schema, spread evenly over it."""
    spec = StructuredOutputsParams(json=ENDLESS)
    every = len(workload.prompts) // num_constrained if num_constrained else 0
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=m,
            ignore_eos=True,
            structured_outputs=spec if every and i % every == 0 and i // every < num_constrained else None,
        )
        for i, m in enumerate(workload.max_tokens)
    ]
    assert sum(p.structured_outputs is not None for p in params) == num_constrained
    fill_before, adjust_before = FILL.seconds, ADJUST.seconds
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.useful_tokens, (produced, workload.useful_tokens)
    fill, adjust = FILL.seconds - fill_before, ADJUST.seconds - adjust_before
    return {"seconds": elapsed, "tokens_per_s": produced / elapsed, "fill_s": fill, "adjust_s": adjust}


def compile_times(model_dir: Path, vocab_size: int) -> dict[str, float]:
    tokenizer = Tokenizer.from_dir(model_dir)
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size)
    spec = StructuredOutputsParams(json=COMPILE_SCHEMA)
    compiler.compile(StructuredOutputsParams(regex="a"))  # tokenizer tables, xgrammar's and ours
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(spec)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        compiler.compile(spec)
    cached = (time.perf_counter() - started) / 100
    return {"compiler_setup_s": setup, "schema_cold_s": cold, "schema_cached_s": cached}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model(Path(tmp) / "model", BENCHMARK_SPEC)
        config = ModelConfig.from_dir(model_dir)
        workload = make_workload(config.vocab_size)
        compile_result = compile_times(model_dir, config.vocab_size)
        llm = LLM(model_dir, dtype="float32", device="cpu", kv_budget=2 * 2**30, max_model_len=512)
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:4]], warm)
        llm.generate(
            [{"prompt_token_ids": workload.prompts[4]}],
            SamplingParams(max_tokens=8, ignore_eos=True, structured_outputs=StructuredOutputsParams(json=ENDLESS)),
        )
        runs: dict[str, list[dict[str, float]]] = {str(m): [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[str(mode)].append(run(llm, workload, mode))
    best = {mode: max(r["tokens_per_s"] for r in values) for mode, values in runs.items()}
    # The masks' share of each run's time, median over runs: fill + apply, over the run's seconds.
    mask_share = {
        mode: statistics.median((r["fill_s"] + r["adjust_s"]) / r["seconds"] for r in values)
        for mode, values in runs.items()
    }
    result = {
        "machine": machine(args.threads),
        "workload": {"requests": len(workload.prompts), "useful_output_tokens": workload.useful_tokens},
        "vocab": config.vocab_size,
        "schema": ENDLESS,
        "tokens_per_s": {"runs": runs, "best": best},
        "cost_vs_unconstrained": {mode: 1 - best[mode] / best["0"] for mode in best if mode != "0"},
        "mask_share_of_time": mask_share,
        "compile": compile_result,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
