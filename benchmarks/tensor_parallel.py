"""What splitting the engine over ranks costs: bytes the collectives move and step time, TP=1 against TP=N.

The benchmark model (~56M random Llama: hidden 512, 8 layers, 8 heads, 4 KV heads, vocabulary 32,000; float32),
through `EngineCore` steps:
1. Decode: `batch` requests with 16-token prompts, prefilled, then `--steps` decode steps timed, `--rounds` times
   (the best round's mean ms per step); the collectives' counters (rank 0's: every rank moves the same) give bytes
   all-reduced and gathered per step.
2. Prefill: one prompt of `--prompt-tokens` tokens in one step, best of `--rounds`; bytes all-reduced per token.
Each size runs with the threads it would have on this machine: TP=1 with all of them (`--threads`) and with one
(each rank's share), TP=N with `--threads` / N per rank. Bytes are set beside the model's hidden size: a decode
step all-reduces 2 * layers + 1 vectors of `hidden` floats per token (o, down, the embedding) and gathers
vocabulary / N logits per sampling row.

    .venv/bin/python benchmarks/tensor_parallel.py [--sizes 1,2] [--batch-sizes 1,8,32] [--device cpu]

writes benchmarks/results/tensor_parallel.json (--out elsewhere; the GPU script writes its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine
from suite import commit
from suite_assets import GPU_SPEC, SMALL_SPEC

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.parallel.comm import CollectiveStats
from loraplex.engine.tools.demo import write_random_model

RESULTS = Path(__file__).parent / "results" / "tensor_parallel.json"
PROMPT_LEN = 16


def _stats(core: EngineCore) -> CollectiveStats:
    return core.workers.comm.stats if core.workers is not None else CollectiveStats()


def _snapshot(stats: CollectiveStats) -> CollectiveStats:
    return dataclasses.replace(stats)


def decode(core: EngineCore, batch: int, steps: int, blocks: int) -> dict[str, Any]:
    """Decode step time with `batch` rows decoding (the mean of `steps` steps, best of `blocks` such runs: this
    machine's neighbours come and go) and the collectives' bytes per step."""
    params = SamplingParams(temperature=0, max_tokens=blocks * steps + 4, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"d{batch}-{i}", [(7 * i + j) % 1000 + 2 for j in range(PROMPT_LEN)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in core.requests.values()):
        core.step()
    core.step()  # one warm decode step
    before = _snapshot(_stats(core))
    means = []
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(steps):
            core.step()
        means.append((time.perf_counter() - started) / steps)
    after = _stats(core)
    for request_id in list(core.requests):
        core.abort_request(request_id)
    counted = blocks * steps
    return {
        "batch": batch,
        "step_ms": 1000 * min(means),
        "step_ms_blocks": [1000 * mean for mean in means],
        "all_reduces_per_step": (after.num_all_reduces - before.num_all_reduces) / counted,
        "all_reduce_bytes_per_step": (after.all_reduce_bytes - before.all_reduce_bytes) / counted,
        "gather_bytes_per_step": (after.gather_bytes - before.gather_bytes) / counted,
    }


def prefill(core: EngineCore, tokens: int, rounds: int) -> dict[str, Any]:
    """Time of one prefill of `tokens` tokens (best of `rounds`) and its collectives' bytes per token."""
    best = float("inf")
    before = _snapshot(_stats(core))
    for round_ in range(rounds):
        core.add_request(
            f"p{round_}", [(11 * j + round_) % 1000 + 2 for j in range(tokens)], SamplingParams(max_tokens=1)
        )
        started = time.perf_counter()
        core.step()
        best = min(best, time.perf_counter() - started)
        core.abort_request(f"p{round_}")
    after = _stats(core)
    return {
        "tokens": tokens,
        "step_ms": 1000 * best,
        "all_reduce_bytes_per_token": (after.all_reduce_bytes - before.all_reduce_bytes) / (rounds * tokens),
    }


def run(model: Path, size: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cpu":
        torch.set_num_threads(threads)
    started = time.perf_counter()
    core = EngineCore(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            device=args.device,
            kv_budget=args.kv_budget,
            max_model_len=2048,
            max_num_batched_tokens=max(args.prompt_tokens, 2048),
            enable_prefix_caching=False,
            tensor_parallel_size=size,
            num_threads=threads if args.device == "cpu" else None,
        )
    )
    load_s = time.perf_counter() - started
    try:
        decodes = [decode(core, batch, args.steps, args.rounds) for batch in args.batch_sizes]
        prefills = prefill(core, args.prompt_tokens, args.rounds)
    finally:
        core.close()
    return {
        "tensor_parallel_size": size,
        "threads_per_rank": threads,
        "start_s": load_s,
        "decode": decodes,
        "prefill": prefills,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-budget", type=int, default=512 * 2**20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--large", action="store_true", help="a ~1B model (hidden 2048, 16 layers): for a GPU")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        spec = GPU_SPEC if args.large else SMALL_SPEC
        model = write_random_model(Path(tmp) / "model", spec)
        config = ModelConfig.from_dir(model)
        runs = []
        for size in sizes:
            # TP=1 with every thread, then with one rank's share (what each rank of TP=N computes with).
            shares = [args.threads, max(1, args.threads // max(sizes))] if size == 1 else [max(1, args.threads // size)]
            for threads in dict.fromkeys(shares):
                runs.append(run(model, size, threads, args))
                print(json.dumps(runs[-1]["decode"]), flush=True)
    document = {
        "benchmark": "tensor_parallel",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "machine": machine(args.threads),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "model": {
            "hidden_size": config.hidden_size,
            "num_layers": config.num_layers,
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "vocab_size": config.vocab_size,
            "dtype": args.dtype,
            "parameters": config.num_parameters(),
        },
        "expected_all_reduce_bytes_per_token": (2 * config.num_layers + 1)
        * config.hidden_size
        * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size(),
        "runs": runs,
        "command": "benchmarks/tensor_parallel.py "
        + f"--sizes {args.sizes} --batch-sizes {','.join(map(str, args.batch_sizes))} --device {args.device}"
        + (" --large" if args.large else ""),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
