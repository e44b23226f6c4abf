"""What a different adapter layout could buy the CPU LoRA path: per-segment matmuls against one batched matmul
per rank class. A probe of the LoRA compute alone, not of the engine.

The LoRA trace of benchmarks/lora_throughput.py (64 requests over the adapters that Zipf popularity picks from 32
of ranks 8-64, all seven projections, the benchmark model's shapes), replayed as its decode steps: step k runs the
requests that asked for more than k tokens, one token each, grouped by adapter. For every step, every layer and
projection group, the LoRA delta is computed two ways, on one thread as the engine runs decode-sized LoRA:

- per segment (what the engine does now, kernels/sgmv_*.py's torch path without its checks): one shrink matmul
  per adapter and group, one expand per adapter and module, each adapter's matrices a view of its own memory in
  the engine's layout (A [group rank, in] multiplied as x @ A^T, B^T [rank, out]);
- per rank class (a layout the engine does not have): the adapters of one rank stored as equal slabs one after
  another, so the step's adapters of that rank are one strided batch: their tokens padded to the class's longest
  segment, one batched shrink and one batched expand per module for the whole class, then the rows scattered
  back. The class's weights are read for every adapter of the class present in the trace, present in the step
  or not (as a slab would be, short of compacting it every step).

Prints and writes the mean milliseconds per decode step of each (best of --repeats passes over all steps, the two
ways interleaved), and the matmul calls per step.

    .venv/bin/python benchmarks/lora_slab_probe.py [--repeats 5]

writes benchmarks/results/lora_slab_probe.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lora_throughput
import torch
from engine_throughput import NUM_REQUESTS, make_workload

RESULTS = Path(__file__).parent / "results" / "lora_slab_probe.json"
HIDDEN, Q, KV, INTER, LAYERS = 512, 512, 256, 1408, 8
# group -> (input width, ((module, output width), ...)), as engine/lora/layout.py groups them
GROUPS = {
    "qkv": (HIDDEN, (("q", Q), ("k", KV), ("v", KV))),
    "o": (Q, (("o", HIDDEN),)),
    "gate_up": (HIDDEN, (("gate", INTER), ("up", INTER))),
    "down": (INTER, (("down", HIDDEN),)),
}


def decode_steps(owners: list[int], max_tokens: list[int]) -> list[list[tuple[int, int]]]:
    """Per decode step, (adapter, tokens) segments: the requests still running, grouped by adapter."""
    steps = []
    for k in range(1, max(max_tokens)):
        counts: dict[int, int] = {}
        for owner, wanted in zip(owners, max_tokens, strict=True):
            if wanted > k:
                counts[owner] = counts.get(owner, 0) + 1
        steps.append(sorted(counts.items()))
    return steps


class Weights:
    """Per layer and group, for each adapter: A [group rank, in] and B^T [rank, out] per module (the engine's
    layout), stored as per-rank-class slabs [adapters of the class, ...]."""

    def __init__(self, ranks: dict[int, int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ranks = ranks
        self.classes: dict[int, list[int]] = {}
        for adapter, rank in sorted(ranks.items()):
            self.classes.setdefault(rank, []).append(adapter)
        self.position = {a: i for members in self.classes.values() for i, a in enumerate(members)}
        # slabs[layer][group] = {rank: (A slab [n, rank * modules, in], [B^T slab [n, rank, out] per module])}
        self.slabs: list[dict[str, dict[int, tuple[torch.Tensor, list[torch.Tensor]]]]] = []
        for _ in range(LAYERS):
            per_group: dict[str, dict[int, tuple[torch.Tensor, list[torch.Tensor]]]] = {}
            for group, (width, modules) in GROUPS.items():
                per_group[group] = {
                    rank: (
                        torch.randn(len(members), rank * len(modules), width, generator=gen) * 0.02,
                        [torch.randn(len(members), rank, out, generator=gen) * 0.02 for _, out in modules],
                    )
                    for rank, members in self.classes.items()
                }
            self.slabs.append(per_group)

    def a(self, layer: int, group: str, adapter: int) -> torch.Tensor:
        return self.slabs[layer][group][self.ranks[adapter]][0][self.position[adapter]]

    def b_t(self, layer: int, group: str, module: int, adapter: int) -> torch.Tensor:
        return self.slabs[layer][group][self.ranks[adapter]][1][module][self.position[adapter]]


def per_segment(weights: Weights, step: list[tuple[int, int]], xs: dict[str, torch.Tensor]) -> int:
    """One step the engine's way; returns the matmul calls made."""
    calls = 0
    bounds = [0]
    for _, n in step:
        bounds.append(bounds[-1] + n)
    for layer in range(LAYERS):
        for group, (_, modules) in GROUPS.items():
            x = xs[group]
            h = torch.empty(x.shape[0], max(weights.classes) * len(modules))
            outs = [torch.zeros(x.shape[0], out) for _, out in modules]
            for (adapter, _), start, end in zip(step, bounds, bounds[1:], strict=False):
                rank = weights.ranks[adapter]
                torch.mm(x[start:end], weights.a(layer, group, adapter).t(), out=h[start:end, : rank * len(modules)])
                for m, y in enumerate(outs):
                    y[start:end].addmm_(h[start:end, m * rank : (m + 1) * rank], weights.b_t(layer, group, m, adapter))
                calls += 1 + len(modules)
    return calls


def per_class(weights: Weights, step: list[tuple[int, int]], xs: dict[str, torch.Tensor]) -> int:
    """One step with one batched matmul per rank class; returns the matmul calls made."""
    calls = 0
    bounds = [0]
    for _, n in step:
        bounds.append(bounds[-1] + n)
    # Per class: each member slot's token rows, padded to the class's longest segment (-1: padding).
    plans: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
    rows_of = {
        adapter: list(range(start, end)) for (adapter, _), start, end in zip(step, bounds, bounds[1:], strict=False)
    }
    for rank, members in weights.classes.items():
        if not any(a in rows_of for a in members):
            continue
        longest = max(len(rows_of.get(a, [])) for a in members)
        index = torch.full((len(members), longest), -1, dtype=torch.int64)
        for i, adapter in enumerate(members):
            rows = rows_of.get(adapter, [])
            index[i, : len(rows)] = torch.tensor(rows, dtype=torch.int64)
        real = index.view(-1) >= 0
        plans[rank] = (index.clamp(min=0).view(-1), real, longest)
    for layer in range(LAYERS):
        for group, (_, modules) in GROUPS.items():
            x = xs[group]
            outs = [torch.zeros(x.shape[0], out) for _, out in modules]
            for rank, (index, real, longest) in plans.items():
                a_slab, b_slabs = weights.slabs[layer][group][rank]
                n = a_slab.shape[0]
                xb = x.index_select(0, index).view(n, longest, -1)
                h = torch.bmm(xb, a_slab.transpose(1, 2))  # [n, longest, rank * modules]
                for m, (y, b_slab) in enumerate(zip(outs, b_slabs, strict=True)):
                    delta = torch.bmm(h[:, :, m * rank : (m + 1) * rank], b_slab).view(n * longest, -1)
                    y.index_add_(0, index[real], delta[real])
                calls += 1 + len(modules)
    return calls


def timed(
    fn: Callable[[Weights, list[tuple[int, int]], dict[str, torch.Tensor]], int],
    weights: Weights,
    steps: list[list[tuple[int, int]]],
    inputs: list[dict[str, torch.Tensor]],
) -> tuple[float, int]:
    calls = 0
    start = time.perf_counter()
    for step, xs in zip(steps, inputs, strict=True):
        calls += fn(weights, step, xs)
    return (time.perf_counter() - start) / len(steps), calls // len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # what the engine uses for decode-sized LoRA (engine/lora/batch.py)

    owners = lora_throughput.popularity()
    rank_of_adapter = dict(enumerate(lora_throughput.adapter_ranks()))
    present = sorted(set(owners))
    weights = Weights({a: rank_of_adapter[a] for a in present})
    workload = make_workload(32000)
    steps = decode_steps(owners[:NUM_REQUESTS], workload.max_tokens)
    gen = torch.Generator().manual_seed(1)
    inputs = []
    for step in steps:
        tokens = sum(n for _, n in step)
        inputs.append({g: torch.randn(tokens, width, generator=gen) for g, (width, _) in GROUPS.items()})

    best: dict[str, float] = {"per_segment": float("inf"), "per_class": float("inf")}
    calls: dict[str, int] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, fn in (("per_segment", per_segment), ("per_class", per_class)):
                seconds, per_step = timed(fn, weights, steps, inputs)
                best[name] = min(best[name], seconds)
                calls[name] = per_step
    result: dict[str, Any] = {
        "decode_steps": len(steps),
        "adapters": {str(a): rank_of_adapter[a] for a in present},
        "mean_tokens_per_step": sum(sum(n for _, n in s) for s in steps) / len(steps),
        "mean_adapters_per_step": sum(len(s) for s in steps) / len(steps),
        "ms_per_step": {name: seconds * 1e3 for name, seconds in best.items()},
        "matmul_calls_per_step": calls,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
