"""Time the CPU serving path of the LoRA shrink/expand (`sgmv_shrink_torch`, `sgmv_expand_torch`) on step shapes,
against a plain loop over segments on ready-made contiguous tensors.

    .venv/bin/python benchmarks/sgmv_cpu.py [--threads 2] [--repeats 30]

Adapters live in a page pool (float32, page_elems 8192 = one KV block of 4 kv heads x 16 tokens x 64 dims, K and
V). Each slot stores, back to back: the q/k/v A rows [3r, 512], q/k/v B^T [r, 512] [r, 128] [r, 128], the up A
[r, 512] and up B^T [r, 1408]; rows straddle pages. Ranks are drawn from {8, 16, 32, 64}.
Shapes:
  decode   64 tokens in 24 segments: one of 10, eight of 3..7, fifteen of 1 (each its own adapter)
  prefill  4096 tokens in 8 segments of 1500 .. 76 tokens
Modules:
  up       shrink 512 -> r, expand r -> 1408
  qkv      one shrink 512 -> 3r, three expands (r -> 512, 128, 128) into column slices of the fused [T, 768] output
Layouts: every slot's pages in one ascending run (`contiguous`: zero-copy views), or shuffled over the pool
(`scattered`: the pages a matrix spans are gathered per call). Variants:
  pool        the torch paths with host hints (segments and slot_bases as Python lists): what CPU serving runs
  pool_plain  the same without hints (seg_starts, seg_slots and page_table read from the tensors)
  baseline    for each segment: y[s:e] += x[s:e] @ A.T @ B, A and B separate contiguous tensors (no pool)
Best and median wall times per step (shrink plus expands) go to stdout and to benchmarks/results/sgmv_cpu.json.
Machines differ a lot and shared ones are noisy: compare runs on one machine, and prefer the best time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.kernels.sgmv import sgmv_expand_torch, sgmv_shrink_torch

HIDDEN, INTERMEDIATE, KV_OUT = 512, 1408, 128
PAGE_ELEMS = 2 * 4 * 16 * 64
RESULTS = Path(__file__).resolve().parent / "results" / "sgmv_cpu.json"
DECODE_LENGTHS = [10, 7, 6, 6, 5, 5, 4, 3, 3] + [1] * 15
PREFILL_LENGTHS = [1500, 900, 600, 400, 300, 200, 120, 76]
QKV_OUT = [HIDDEN, KV_OUT, KV_OUT]


@dataclass
class Adapter:
    a_qkv: torch.Tensor  # [3r, HIDDEN]
    bt_qkv: list[torch.Tensor]  # [r, 512], [r, 128], [r, 128]
    a_up: torch.Tensor  # [r, HIDDEN]
    bt_up: torch.Tensor  # [r, INTERMEDIATE]

    def matrices(self) -> list[torch.Tensor]:
        return [self.a_qkv, *self.bt_qkv, self.a_up, self.bt_up]


@dataclass
class Step:
    x: torch.Tensor  # [T, HIDDEN]
    adapters: list[Adapter]
    lengths: list[int]  # segment s uses adapter s
    weights: torch.Tensor
    page_table: torch.Tensor
    offsets: list[list[int]]  # per slot, the offset of each of Adapter.matrices()
    slot_bases: list[int | None]

    @property
    def ranks(self) -> list[int]:
        return [a.a_up.shape[0] for a in self.adapters]

    def segments(self) -> list[tuple[int, int, int]]:
        out, start = [], 0
        for slot, n in enumerate(self.lengths):
            out.append((start, start + n, slot))
            start += n
        return out


def make_step(lengths: list[int], *, contiguous: bool, seed: int) -> Step:
    gen = torch.Generator().manual_seed(seed)
    rank_choices = torch.tensor([8, 16, 32, 64])
    ranks = rank_choices[torch.randint(0, 4, (len(lengths),), generator=gen)].tolist()
    adapters = [
        Adapter(
            a_qkv=torch.randn(3 * r, HIDDEN, generator=gen) / HIDDEN**0.5,
            bt_qkv=[torch.randn(r, n, generator=gen) / r**0.5 for n in QKV_OUT],
            a_up=torch.randn(r, HIDDEN, generator=gen) / HIDDEN**0.5,
            bt_up=torch.randn(r, INTERMEDIATE, generator=gen) / r**0.5,
        )
        for r in ranks
    ]
    regions, offsets = [], []
    for adapter in adapters:
        mats = adapter.matrices()
        starts = [0]
        for m in mats:
            starts.append(starts[-1] + m.numel())
        region = torch.zeros(math.ceil(starts[-1] / PAGE_ELEMS) * PAGE_ELEMS)
        region[: starts[-1]] = torch.cat([m.reshape(-1) for m in mats])
        regions.append(region)
        offsets.append(starts[:-1])
    pages_per_slot = [r.numel() // PAGE_ELEMS for r in regions]
    num_pages = 2 * sum(pages_per_slot)  # the rest of the pool holds KV blocks
    order = torch.arange(num_pages) if contiguous else torch.randperm(num_pages, generator=gen)
    owned = order[num_pages // 2 :].tolist() if contiguous else order[: sum(pages_per_slot)].tolist()
    weights = torch.randn(num_pages, PAGE_ELEMS, generator=gen)
    page_table = torch.zeros(len(adapters), max(pages_per_slot), dtype=torch.int32)
    slot_bases: list[int | None] = []
    taken = 0
    for slot, region in enumerate(regions):
        ids = owned[taken : taken + pages_per_slot[slot]]
        taken += len(ids)
        page_table[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        weights[ids] = region.view(-1, PAGE_ELEMS)
        slot_bases.append(ids[0] * PAGE_ELEMS if ids == list(range(ids[0], ids[0] + len(ids))) else None)
    return Step(
        x=torch.randn(sum(lengths), HIDDEN, generator=gen),
        adapters=adapters,
        lengths=lengths,
        weights=weights.view(-1),
        page_table=page_table,
        offsets=offsets,
        slot_bases=slot_bases,
    )


def pool_runner(step: Step, module: str, *, hints: bool) -> Callable[[torch.Tensor], None]:
    """One step of `module` through the torch paths; y is [T, 1408] (up) or the fused [T, 768] (qkv)."""
    starts = [0]
    for n in step.lengths:
        starts.append(starts[-1] + n)
    seg_starts = torch.tensor(starts, dtype=torch.int32)
    seg_slots = torch.arange(len(step.lengths), dtype=torch.int32)
    ranks = step.ranks
    kwargs: dict[str, Any] = {"segments": step.segments(), "slot_bases": step.slot_bases} if hints else {}
    pool = (step.weights, step.page_table)

    def offsets(i: int) -> torch.Tensor:
        return torch.tensor([o[i] for o in step.offsets], dtype=torch.int64)

    if module == "up":
        rank_t = torch.tensor(ranks, dtype=torch.int32)
        a_off, b_off = offsets(4), offsets(5)
        h = torch.empty(step.x.shape[0], max(ranks))

        def run_up(y: torch.Tensor) -> None:
            meta = (rank_t, seg_starts, seg_slots)
            sgmv_shrink_torch(step.x, *pool, a_off, *meta, page_elems=PAGE_ELEMS, max_rank=h.shape[1], out=h, **kwargs)
            sgmv_expand_torch(h, *pool, b_off, *meta, y, page_elems=PAGE_ELEMS, **kwargs)

        return run_up

    group_ranks = torch.tensor([3 * r for r in ranks], dtype=torch.int32)
    module_ranks = torch.tensor(ranks, dtype=torch.int32)
    a_off = offsets(0)
    b_offs = [offsets(1 + m) for m in range(3)]
    col_offs = [torch.tensor([m * r for r in ranks], dtype=torch.int32) for m in range(3)]
    h = torch.empty(step.x.shape[0], 3 * max(ranks))
    bounds = [0, HIDDEN, HIDDEN + KV_OUT, HIDDEN + 2 * KV_OUT]

    def run_qkv(y: torch.Tensor) -> None:
        segs = (seg_starts, seg_slots)
        sgmv_shrink_torch(
            step.x, *pool, a_off, group_ranks, *segs, page_elems=PAGE_ELEMS, max_rank=h.shape[1], out=h, **kwargs
        )
        for m in range(3):
            y_m = y[:, bounds[m] : bounds[m + 1]]
            sgmv_expand_torch(
                h,
                *pool,
                b_offs[m],
                module_ranks,
                *segs,
                y_m,
                page_elems=PAGE_ELEMS,
                h_col_offsets=col_offs[m],
                **kwargs,
            )

    return run_qkv


def baseline_runner(step: Step, module: str) -> Callable[[torch.Tensor], None]:
    """The plain loop on separate contiguous tensors: no pool, no page table."""
    segments = step.segments()
    if module == "up":
        mats = [(a.a_up.contiguous(), a.bt_up.contiguous()) for a in step.adapters]

        def run_up(y: torch.Tensor) -> None:
            for start, end, slot in segments:
                a, b = mats[slot]
                y[start:end] += step.x[start:end] @ a.T @ b

        return run_up

    bounds = [0, HIDDEN, HIDDEN + KV_OUT, HIDDEN + 2 * KV_OUT]

    def run_qkv(y: torch.Tensor) -> None:
        for start, end, slot in segments:
            adapter = step.adapters[slot]
            r = adapter.a_up.shape[0]
            h = step.x[start:end] @ adapter.a_qkv.T
            for m in range(3):
                y[start:end, bounds[m] : bounds[m + 1]] += h[:, m * r : (m + 1) * r] @ adapter.bt_qkv[m]

    return run_qkv


def time_runners(
    runners: dict[str, Callable[[torch.Tensor], None]], width: int, num_tokens: int, repeats: int
) -> dict[str, list[float]]:
    """Wall times per runner, taken round-robin so that a noisy neighbour slows every variant alike."""
    outputs = {name: torch.zeros(num_tokens, width) for name in runners}
    for _ in range(3):
        for name, run in runners.items():
            run(outputs[name])
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(outputs[name])
            times[name].append(time.perf_counter() - start)
    return times


def check_agreement(step: Step, module: str, width: int) -> float:
    """Max abs difference between the pool path and the baseline on one step (a sanity check of the setup)."""
    y_pool = torch.zeros(step.x.shape[0], width)
    y_base = torch.zeros_like(y_pool)
    pool_runner(step, module, hints=True)(y_pool)
    baseline_runner(step, module)(y_base)
    return float((y_pool - y_base).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per row (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    widths = {"up": INTERMEDIATE, "qkv": sum(QKV_OUT)}
    results: list[dict[str, Any]] = []
    for shape, lengths in (("decode", DECODE_LENGTHS), ("prefill", PREFILL_LENGTHS)):
        for layout in ("contiguous", "scattered"):
            step = make_step(lengths, contiguous=layout == "contiguous", seed=args.seed)
            for module, width in widths.items():
                diff = check_agreement(step, module, width)
                if diff > 1e-3:
                    raise RuntimeError(f"{shape}/{layout}/{module}: pool path and baseline differ by {diff}")
                runners = {
                    "pool": pool_runner(step, module, hints=True),
                    "pool_plain": pool_runner(step, module, hints=False),
                    "baseline": baseline_runner(step, module),
                }
                row: dict[str, Any] = {
                    "shape": shape,
                    "layout": layout,
                    "module": module,
                    "num_tokens": sum(lengths),
                    "num_segments": len(lengths),
                    "ranks": step.ranks,
                }
                for name, times in time_runners(runners, width, sum(lengths), args.repeats).items():
                    row[f"{name}_best_ms"] = round(min(times) * 1e3, 3)
                    row[f"{name}_median_ms"] = round(statistics.median(times) * 1e3, 3)
                row["pool_over_baseline_best"] = round(row["pool_best_ms"] / row["baseline_best_ms"], 3)
                results.append(row)
                print(
                    f"{shape:8s} {layout:11s} {module:4s} pool {row['pool_best_ms']:8.3f} ms "
                    f"(plain {row['pool_plain_best_ms']:8.3f})  baseline {row['baseline_best_ms']:8.3f} ms  "
                    f"ratio {row['pool_over_baseline_best']:.2f}"
                )

    report = {
        "benchmark": "sgmv_shrink_torch + sgmv_expand_torch",
        "dtype": "float32",
        "hidden": HIDDEN,
        "intermediate": INTERMEDIATE,
        "page_elems": PAGE_ELEMS,
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
