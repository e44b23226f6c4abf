"""Multi-LoRA throughput: the engine benchmark's workload (64 requests of mixed lengths on the ~56M-parameter
random Llama) spread over 32 adapters of ranks 8-64 on all linear layers, with power-law popularity.

Compares, in one run on this machine:
- loraplex with the adapters (each request runs its adapter; one `LLM.generate` call for all 64);
- loraplex base-only on the same trace;
- peft's mixed-adapter batched `generate` (`adapter_names=` per row), static batches, at its best batch size;
and reports how many of the adapters fit in a fixed pool with pages in proportion to rank, against a pool where
every adapter is padded to the largest rank.

    .venv/bin/python benchmarks/lora_throughput.py [--threads 2] [--batch-sizes 16,32,64] [--skip-peft]
        [--repeats 1]

With --repeats N loraplex runs N pairs (base-only, then with adapters): each keeps its best run, and LoRA / base is
also given per pair and as the median of the pairs, since a shared host can slow one run by far more than the
difference being measured. peft runs once.

writes benchmarks/results/lora_throughput.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine_throughput import NUM_REQUESTS, Workload, left_padded, make_workload
from serve_launch import machine

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.lora import parse_adapter, read_adapter_dir
from loraplex.engine.lora.layout import layout_adapter
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model
from loraplex.engine.tools.demo_adapter import write_random_adapter

RESULTS = Path(__file__).parent / "results" / "lora_throughput.json"
NUM_ADAPTERS = 32
RANKS = (8, 16, 32, 64)
FIXED_POOL_BYTES = 256 * 2**20
PAGE_ELEMS = 2 * 4 * 16 * 64  # the benchmark model's KV block (k and v, 4 KV heads, 16 tokens, head_dim 64)


def adapter_ranks(seed: int = 0, count: int = NUM_ADAPTERS) -> list[int]:
    """The rank of each of `count` adapters (this benchmark's NUM_ADAPTERS by default)."""
    rng = random.Random(seed)
    return [rng.choice(RANKS) for _ in range(count)]


def make_adapters(
    root: Path, config: ModelConfig, seed: int = 0, count: int = NUM_ADAPTERS
) -> list[tuple[str, Path, int]]:
    adapters = []
    for i, rank in enumerate(adapter_ranks(seed, count)):
        path = write_random_adapter(root / f"adapter-{i:02d}", config, rank=rank, seed=i, init_std=0.02)
        adapters.append((f"adapter-{i:02d}", path, rank))
    return adapters


def popularity(seed: int = 1) -> list[int]:
    """Adapter of each request: Zipf(1) over the adapters, the most popular first."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(NUM_ADAPTERS)]
    return rng.choices(range(NUM_ADAPTERS), weights=weights, k=NUM_REQUESTS)


def run_loraplex(
    model_dir: Path, workload: Workload, loras: list[LoRARequest | None], *, max_num_batched_tokens: int
) -> dict[str, Any]:
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        kv_budget=2 * 2**30,
        max_model_len=512,
        max_num_batched_tokens=max_num_batched_tokens,
        max_adapters_per_batch=NUM_ADAPTERS,
        max_loras=NUM_ADAPTERS,
    )
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Warm-up outside the clock; also loads every adapter into the pool (loads run ahead of a real trace).
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:4]], warm)
    distinct = [lora for lora in {id(lora): lora for lora in loras if lora is not None}.values()]
    llm.generate([{"prompt_token_ids": workload.prompts[0]}] * len(distinct), warm, lora_request=distinct)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, lora_request=loras)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.useful_tokens, (produced, workload.useful_tokens, [o.error for o in outputs])
    return {"seconds": elapsed, "tokens_per_s": workload.useful_tokens / elapsed}


def run_peft(
    model_dir: Path,
    adapters: list[tuple[str, Path, int]],
    workload: Workload,
    owners: list[int],
    sizes: list[int],
    *,
    warm_up: bool = False,
) -> dict[str, Any]:
    """The workload through peft's mixed-adapter `generate` in static batches of each size, request i with adapter
    owners[i]; with `warm_up`, one short batch runs first, outside the clock, so that no size pays the first calls."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(base, adapters[0][1], adapter_name=adapters[0][0])
    for name, path, _ in adapters[1:]:
        model.load_adapter(path, adapter_name=name)
    model.eval()

    def generate(first: int, count: int, new_tokens: int) -> None:
        prompts = workload.prompts[first : first + count]
        names = [adapters[owners[i]][0] for i in range(first, first + len(prompts))]
        ids, mask = left_padded(prompts)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                adapter_names=names,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    if warm_up:
        generate(0, 2, 2)
    results: dict[str, Any] = {}
    for batch_size in sizes:
        start = time.perf_counter()
        for first in range(0, len(workload.prompts), batch_size):
            generate(first, batch_size, max(workload.max_tokens[first : first + batch_size]))
        elapsed = time.perf_counter() - start
        results[str(batch_size)] = {"seconds": elapsed, "tokens_per_s": workload.useful_tokens / elapsed}
    best = max(results, key=lambda k: results[k]["tokens_per_s"])
    return {"by_batch_size": results, "best_batch_size": int(best), "best_tokens_per_s": results[best]["tokens_per_s"]}


def adapter_pages(config: ModelConfig, path: Path) -> int:
    """Pool pages the adapter at `path` takes in the engine's layout (pages in proportion to its rank)."""
    adapter = parse_adapter(*read_adapter_dir(path), config)
    return layout_adapter(adapter, config, PAGE_ELEMS).num_pages


def page_bytes(config: ModelConfig) -> int:
    """Bytes of one pool page over all layers (float32)."""
    return config.num_layers * PAGE_ELEMS * 4


def fit_in_pool(pages: list[int], max_pages: int, budget_pages: int) -> tuple[int, int]:
    """How many of the adapters of `pages` (pages each, most popular first) a pool of `budget_pages` holds: taken in
    order while the next fits, with pages in proportion to rank; and with each padded to `max_pages` (the largest
    rank's)."""
    used = fitted = 0
    for need in pages:
        if used + need > budget_pages:
            break
        used, fitted = used + need, fitted + 1
    return fitted, min(len(pages), budget_pages // max_pages)


def residency(config: ModelConfig, adapters: list[tuple[str, Path, int]], owners: list[int]) -> dict[str, Any]:
    """Adapters that fit in FIXED_POOL_BYTES, most popular first: pages per rank vs all padded to the max rank."""
    pages = {name: adapter_pages(config, path) for name, path, _ in adapters}
    by_popularity = sorted(range(NUM_ADAPTERS), key=lambda i: -owners.count(i))
    padded_pages = max(pages[name] for name, _, rank in adapters if rank == max(RANKS))
    fitted, padded = fit_in_pool(
        [pages[adapters[i][0]] for i in by_popularity], padded_pages, FIXED_POOL_BYTES // page_bytes(config)
    )
    return {
        "pool_bytes": FIXED_POOL_BYTES,
        "pages_by_rank": {str(r): next(pages[n] for n, _, rank in adapters if rank == r) for r in RANKS},
        "resident_rank_proportional": fitted,
        "resident_padded_to_max_rank": padded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--batch-sizes", default="16,32,64")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="(base-only, adapters) pairs of loraplex runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_random_model(root / "model", dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32"))
        config = ModelConfig.from_dir(model_dir)
        workload = make_workload(config.vocab_size)
        adapters = make_adapters(root, config)
        owners = popularity()
        loras: list[LoRARequest | None] = [LoRARequest(adapters[i][0], adapters[i][1]) for i in owners]

        pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for _ in range(args.repeats):
            pairs.append(
                (
                    run_loraplex(
                        model_dir, workload, [None] * NUM_REQUESTS, max_num_batched_tokens=args.max_num_batched_tokens
                    ),
                    run_loraplex(model_dir, workload, loras, max_num_batched_tokens=args.max_num_batched_tokens),
                )
            )
        base = max((b for b, _ in pairs), key=lambda run: run["tokens_per_s"])
        with_lora = max((w for _, w in pairs), key=lambda run: run["tokens_per_s"])
        pair_ratios = [w["tokens_per_s"] / b["tokens_per_s"] for b, w in pairs]
        peft = (
            None
            if args.skip_peft
            else run_peft(model_dir, adapters, workload, owners, [int(b) for b in args.batch_sizes.split(",")])
        )
        resident = residency(config, adapters, owners)

    result: dict[str, Any] = {
        "machine": machine(args.threads),
        "model_parameters": config.num_parameters(),
        "adapters": {
            "count": NUM_ADAPTERS,
            "ranks": {str(r): sum(1 for _, _, rank in adapters if rank == r) for r in RANKS},
            "targets": "all linear (q, k, v, o, gate, up, down)",
            "requests_per_adapter_top5": sorted((owners.count(i) for i in range(NUM_ADAPTERS)), reverse=True)[:5],
            "distinct_adapters_in_trace": len(set(owners)),
        },
        "workload": {"requests": NUM_REQUESTS, "useful_output_tokens": workload.useful_tokens},
        "loraplex_base_only": base,
        "loraplex_lora": with_lora,
        "lora_over_base": with_lora["tokens_per_s"] / base["tokens_per_s"],
        "pairs": [{"base_tokens_per_s": b["tokens_per_s"], "lora_tokens_per_s": w["tokens_per_s"]} for b, w in pairs],
        "lora_over_base_median_of_pairs": statistics.median(pair_ratios),
        "peft": peft,
        "residency": resident,
    }
    if peft is not None:
        result["lora_over_peft"] = with_lora["tokens_per_s"] / peft["best_tokens_per_s"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
