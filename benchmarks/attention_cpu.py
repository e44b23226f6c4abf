"""Time the CPU serving path of paged attention (`paged_attention_torch`) on the engine's step shapes.

    .venv/bin/python benchmarks/attention_cpu.py [--threads 2] [--repeats 20]

Shapes (float32, 8 query heads, 4 kv heads, head_dim 64, block_size 16, shuffled block tables):
  decode   64 sequences, 1 query each, contexts uniform in 16..384
  prefill  64 fresh prompts of 16..256 tokens (q_len == seq_len)
  mixed    60 decode sequences (contexts 16..384) + 2 chunked prefills of 512 queries on 256 cached tokens
Each shape runs on two cache layouts: contiguous K and V tensors, and K/V as strided views of one page-major
pool [num_blocks, 2, kv_heads, block_size, head_dim]. Best and median wall times go to stdout and to
benchmarks/results/attention_cpu.json. Machines differ a lot and shared ones are noisy: compare runs on one
machine, and prefer the best time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.kernels.paged_attention import paged_attention_torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
RESULTS = Path(__file__).resolve().parent / "results" / "attention_cpu.json"


@dataclass
class Step:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def run(self, out: torch.Tensor) -> torch.Tensor:
        return paged_attention_torch(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            scale=HEAD_DIM**-0.5,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            out=out,
        )


def make_step(q_lens: list[int], seq_lens: list[int], *, page_major: bool, seed: int) -> Step:
    """A step whose sequences own shuffled blocks of a pool twice as large as they need."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq)
    pool_ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = pool_ids[taken : taken + n]
        taken += n
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    if page_major:
        pool = torch.randn(num_blocks, 2, *shape[1:], generator=gen)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    return Step(
        q=torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def shapes(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """(q_lens, seq_lens) per shape."""
    gen = torch.Generator().manual_seed(seed)
    decode = torch.randint(16, 385, (64,), generator=gen).tolist()
    prompts = torch.randint(16, 257, (64,), generator=gen).tolist()
    mixed_decode = torch.randint(16, 385, (60,), generator=gen).tolist()
    return {
        "decode": ([1] * 64, decode),
        "prefill": (prompts, prompts),
        "mixed": ([1] * 60 + [512, 512], [*mixed_decode, 768, 768]),
    }


def time_step(step: Step, repeats: int) -> list[float]:
    out = torch.empty_like(step.q)
    for _ in range(3):
        step.run(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step.run(out)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per shape and layout (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results: list[dict[str, Any]] = []
    for name, (q_lens, seq_lens) in shapes(args.seed).items():
        for layout in ("contiguous", "page_major"):
            step = make_step(q_lens, seq_lens, page_major=layout == "page_major", seed=args.seed)
            times = time_step(step, args.repeats)
            row = {
                "shape": name,
                "layout": layout,
                "num_seqs": len(seq_lens),
                "num_query_tokens": sum(q_lens),
                "num_context_tokens": sum(seq_lens),
                "best_ms": round(min(times) * 1e3, 3),
                "median_ms": round(statistics.median(times) * 1e3, 3),
            }
            results.append(row)
            print(f"{name:8s} {layout:11s} best {row['best_ms']:8.2f} ms   median {row['median_ms']:8.2f} ms")

    report = {
        "benchmark": "paged_attention_torch",
        "dtype": "float32",
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": machine(args.threads),
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
