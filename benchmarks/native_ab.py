"""What the native CPU operators (kernels/csrc/cpu_ops.cpp) give end to end: the LoRA benchmark's workload (64
requests on the ~56M random Llama, 32 adapters of ranks 8-64 on all linear layers) through one warm engine, the
operators switched off and on in turn in the same process, base-only and with adapters, for --rounds rounds.

One engine for all runs, its prefix cache off: the runs repeat the same prompts, which a prefix cache would serve
from its blocks after the first (the "fresh engine runs slower" gap an earlier version of this script showed was
that, not a cold engine: docs/decisions/0036-native-cpu-operators.md).

    .venv/bin/python benchmarks/native_ab.py [--rounds 2] [--threads 2]

writes benchmarks/results/native_ab.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch
from engine_throughput import make_workload
from lora_throughput import NUM_ADAPTERS, make_adapters, popularity
from serve_launch import machine

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model
from loraplex.kernels import native
from loraplex.kernels import paged_attention as attention

RESULTS = Path(__file__).parent / "results" / "native_ab.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.load():
        raise SystemExit("the native operators are not built: run `make native` first")
    enabled = {"on": True}
    # Attention asks kernels.native at each call; LoRA decides when its engine is built: both switched here.
    attention.native = types.SimpleNamespace(load=lambda: enabled["on"])  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_random_model(root / "model", dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32"))
        config = ModelConfig.from_dir(model_dir)
        workload = make_workload(config.vocab_size)
        adapters = make_adapters(root, config)
        loras = [LoRARequest(adapters[i][0], adapters[i][1]) for i in popularity()]
        llm = LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            kv_budget=2 * 2**30,
            max_model_len=512,
            max_num_batched_tokens=8192,
            max_adapters_per_batch=NUM_ADAPTERS,
            max_loras=NUM_ADAPTERS,
            # Every run repeats the same prompts: with the prefix cache on, all but the first would skip their
            # prefill, which is what made an earlier version's "warm engine" figures look faster than a fresh one's.
            enable_prefix_caching=False,
        )
        lora_compute = llm.engine.runner.lora
        assert lora_compute is not None
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        distinct = list({id(lora): lora for lora in loras}.values())
        llm.generate([{"prompt_token_ids": workload.prompts[0]}] * len(distinct), warm, lora_request=distinct)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
        prompts = [{"prompt_token_ids": p} for p in workload.prompts]
        runs: list[dict[str, Any]] = []
        for round_index in range(args.rounds):
            for on in (False, True):
                enabled["on"] = on
                lora_compute._native = on
                for kind, requests in (("base", None), ("lora", loras)):
                    start = time.perf_counter()
                    llm.generate(prompts, params, lora_request=requests)
                    rate = workload.useful_tokens / (time.perf_counter() - start)
                    runs.append({"round": round_index, "native": on, "kind": kind, "tokens_per_s": rate})
                    print(f"round {round_index} native={'on' if on else 'off'} {kind}: {rate:.0f} tok/s", flush=True)

    def best(on: bool, kind: str) -> float:
        return max(r["tokens_per_s"] for r in runs if r["native"] == on and r["kind"] == kind)

    summary = {
        kind: {"off": best(False, kind), "on": best(True, kind), "speedup": best(True, kind) / best(False, kind)}
        for kind in ("base", "lora")
    }
    summary["lora_over_base"] = {state: summary["lora"][state] / summary["base"][state] for state in ("off", "on")}
    document = {
        "machine": machine(args.threads),
        "torch": torch.__version__,
        "workload": {"requests": len(workload.prompts), "useful_output_tokens": workload.useful_tokens},
        "adapters": NUM_ADAPTERS,
        "runs": runs,
        "best": summary,
    }
    RESULTS.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
