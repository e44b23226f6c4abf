"""Throughput and weight memory of quantized base weights, with LoRA adapters active.

The multi-LoRA benchmark's workload (benchmarks/lora_throughput.py: 64 requests of mixed lengths on the ~56M-parameter
random Llama, 32 adapters of ranks 8-64 on all linear layers, Zipf popularity), per weight mode: float32, bf16, int8
and int4 (the quantized modes with float32 activations, the CPU default, and with bf16 activations). The checkpoint
is written in bf16, as real ones are; float32 upcasts it. Each mode reports tokens/s over the whole trace (one
`LLM.generate` call, adapters loaded beforehand; the best of `--rounds` runs, modes interleaved, since the machine
is shared), the weight bytes the engine reports, and the resident
memory a fresh process adds while it loads the model (peak and after), which shows whether quantizing at load ever
held a float copy of the whole model.

    .venv/bin/python benchmarks/quant_throughput.py [--threads 2] [--requests 64] [--rounds 2] [--modes float32,int8]

writes benchmarks/results/quant_throughput.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine_throughput import Workload, make_workload
from lora_throughput import NUM_ADAPTERS, make_adapters, popularity
from serve_launch import machine

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model
from loraplex.kernels.quant import int8_activations

RESULTS = Path(__file__).parent / "results" / "quant_throughput.json"

# name -> (dtype: activations and unquantized weights, quantization)
MODES: dict[str, tuple[str, str | None]] = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "fp8": ("float32", "fp8"),
    "int8-bf16": ("bfloat16", "int8"),
    "int4-bf16": ("bfloat16", "int4"),
}


def run(
    model_dir: Path,
    workload: Workload,
    loras: list[LoRARequest | None],
    *,
    dtype: str,
    quantization: str | None,
    threads: int,
) -> dict[str, Any]:
    started = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype=dtype,  # type: ignore[arg-type]
        quantization=quantization,  # type: ignore[arg-type]
        device="cpu",
        kv_budget=1 * 2**30,
        max_model_len=512,
        max_num_batched_tokens=8192,
        max_adapters_per_batch=NUM_ADAPTERS,
        max_loras=NUM_ADAPTERS,
        num_threads=threads,
    )
    load_seconds = time.perf_counter() - started
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Warm-up outside the clock; also loads every adapter into the pool (loads run ahead of a real trace).
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:4]], warm)
    distinct = list({id(lora): lora for lora in loras if lora is not None}.values())
    llm.generate([{"prompt_token_ids": workload.prompts[0]}] * len(distinct), warm, lora_request=distinct)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.useful_tokens, (produced, workload.useful_tokens, [o.error for o in outputs])
    return {
        "dtype": dtype,
        "quantization": quantization,
        "seconds": elapsed,
        "tokens_per_s": workload.useful_tokens / elapsed,
        "load_seconds": load_seconds,
        "weight_bytes": llm.engine.weight_bytes,
        "projection_bytes": llm.engine.model.projection_bytes(),
    }


# Peak resident memory while LLM(...) loads, over the resident memory just before (Linux: writing 5 to clear_refs
# resets the peak, VmHWM). The page pool is kept tiny, so this is the weights and what loading them costs.
_LOAD_RSS = """
import sys
from loraplex.engine import LLM
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
before = kib("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
llm = LLM(sys.argv[1], dtype=sys.argv[2], quantization=None if sys.argv[3] == "-" else sys.argv[3], device="cpu",
          kv_budget=4 * 2**20, max_model_len=128, num_threads=1)
print((kib("VmHWM:") - before) * 1024, (kib("VmRSS:") - before) * 1024)
"""


def load_rss(model_dir: Path, dtype: str, quantization: str | None) -> tuple[int, int]:
    """(peak, final) resident bytes a fresh process adds while it loads the model."""
    args = [str(model_dir), dtype, quantization or "-"]
    done = subprocess.run([sys.executable, "-c", _LOAD_RSS, *args], check=True, capture_output=True, text=True)
    peak, final = done.stdout.split()[-2:]
    return int(peak), int(final)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="The first N requests of the 64-request trace.")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--rounds", type=int, default=2, help="Runs per mode, modes interleaved; the best counts (a shared machine)."
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_random_model(root / "model", dataclasses.replace(BENCHMARK_SPEC, torch_dtype="bfloat16"))
        config = ModelConfig.from_dir(model_dir)
        full = make_workload(config.vocab_size)
        workload = Workload(prompts=full.prompts[: args.requests], max_tokens=full.max_tokens[: args.requests])
        adapters = make_adapters(root, config)
        owners = popularity()[: args.requests]
        loras: list[LoRARequest | None] = [LoRARequest(adapters[i][0], adapters[i][1]) for i in owners]
        for round_index in range(args.rounds):
            for name in modes:
                dtype, quantization = MODES[name]
                entry = run(model_dir, workload, loras, dtype=dtype, quantization=quantization, threads=args.threads)
                print(f"{round_index} {name:10s} {entry['tokens_per_s']:7.1f} tok/s  {entry['weight_bytes']} B")
                best = results.get(name)
                runs = [*(best["tokens_per_s_runs"] if best else []), entry["tokens_per_s"]]
                if best is None or entry["tokens_per_s"] > best["tokens_per_s"]:
                    results[name] = entry
                results[name]["tokens_per_s_runs"] = runs
        for name in modes:
            dtype, quantization = MODES[name]
            results[name]["load_peak_rss_bytes"], results[name]["load_final_rss_bytes"] = load_rss(
                model_dir, dtype, quantization
            )

    reference = results.get("bfloat16")
    if reference is not None:
        for entry in results.values():
            entry["weight_bytes_over_bf16"] = entry["weight_bytes"] / reference["weight_bytes"]
            entry["projection_bytes_over_bf16"] = entry["projection_bytes"] / reference["projection_bytes"]
    output = {
        "machine": machine(args.threads),
        "model_parameters": config.num_parameters(),
        # Whether int8 and int4 rounded activations to 8 bits (CPUs with VNNI or AMX; decision 0039).
        "int8_activations": int8_activations(),
        "threads": args.threads,
        "adapters": {"count": NUM_ADAPTERS, "distinct_in_trace": len(set(owners)), "targets": "all linear"},
        "workload": {"requests": len(workload.prompts), "useful_output_tokens": workload.useful_tokens},
        "modes": results,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(output, indent=2) + "\n")
    print(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
