"""Time the CPU paths of the quantized matmuls (`int8_linear_torch`, `int4_linear_torch`) against the other ways
torch offers, and against float32 and bfloat16 `F.linear`, on the benchmark model's matrices.

    .venv/bin/python benchmarks/quant_cpu.py [--threads 2] [--repeats 30]

Matrices ([out, in], hidden 512, 8 heads and 4 kv heads of 64, intermediate 1408): qkv [1024, 512], o [512, 512],
gate_up [2816, 512], down [512, 1408]. Tokens: 1, 16, 64 (decode) and 512 (a prefill chunk). Activations are
float32, as the engine computes on CPU. Variants:
  f32_linear          F.linear on the float32 matrix (what is served unquantized)
  bf16_linear         F.linear on a bfloat16 matrix with x already bfloat16 (a bfloat16 engine's cost)
  int8 / int4 tiled   the torch paths (what CPU serving runs): dequantize up to 2^19 elements at a time into the
                      caller's workspace, matmul. int4 takes split tiles up to 64 tokens, interleaved tiles past:
  ..._new_buffer      the same without a workspace: a new 2 MiB buffer per call
  int4 split_only     tiles left apart: even and odd columns (low and high nibbles) times their scales as two
                      [rows, in / 2] tiles, two matmuls, the zero points folded into one small product per call
  int4 interleaved_only  [rows, in] tiles, (q - zero) * scale, one matmul
  ..._tile128k        the torch paths with tiles of up to 2^17 elements
  ..._full_dequant    dequantize the whole matrix per call, then F.linear (a transient full copy)
  int8 torch_fused    torch.ops.aten._weight_int8pack_mm(x, qweight, scales) on float32 x (same codes, no copy)
  int8 torch_fused_bf16x   the same with x cast to bfloat16 (and back): fast, but x loses 16 bits (see max_err)
  int4 torch_fused    torch.ops.aten._weight_int4pack_mm_for_cpu on its own blocked layout (converted at quantize
                      time; keeping it besides the API's packed layout doubles the codes: see its bytes)
Not measured: `_dyn_quant_matmul_4bit` needs KleidiAI (Arm); on this x86 build `_dyn_quant_pack_4bit_weight`
stores the dequantized float32 matrix, so it saves no memory.
Before each timed call a 64 MiB buffer (more than this CPU's 32 MiB L3) is rewritten, so every variant starts with
its weights out of cache, as a layer's weights are in a forward pass over the whole model; without it, whichever
variant ran after another on the same codes found them cached (a 1-token int4 gate_up: 0.48 against 0.67 ms, the
same code). The order of the variants is shuffled every round: the one after another variant on the same codes or
the same size of buffers ran faster even so. Each row records best and median wall times (ms) and the max abs
error against x @ dequantize(w)^T computed in float64. Variants slower than 20 ms get fewer repeats (at least 3).
Results go to benchmarks/results/quant_cpu.json.
Machines differ a lot and shared ones are noisy: compare runs on one machine, and prefer the best time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from serve_launch import machine

from loraplex.kernels import quant_int4, quant_int8
from loraplex.kernels.quant import (
    Int4Weight,
    Int8Weight,
    dequantize_int4,
    dequantize_int8,
    int4_linear_torch,
    int8_linear_torch,
    quantize_int4,
    quantize_int8,
)
from loraplex.kernels.quant_formats import unpack_int4, workspace_elems

RESULTS = Path(__file__).resolve().parent / "results" / "quant_cpu.json"
MATRICES = {"qkv": (1024, 512), "o": (512, 512), "gate_up": (2816, 512), "down": (512, 1408)}
TOKENS = [1, 16, 64, 512]
SLOW_S = 0.02  # a variant slower than this per call gets fewer repeats
SLOW_BUDGET_S = 0.5  # ... as many as fit in this much time, at least 3
SKIP_S = 1.0  # a variant slower than this per call is not timed further (its warm-up time is recorded)


def with_setting(module: Any, name: str, value: int, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn with module.name set to value for the call (TILE_ELEMS, SPLIT_MAX_TOKENS)."""

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(module, name, saved)

    return run


def torch_int4_layout(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our codes in the layout of `_weight_int4pack_mm_for_cpu`: its packed [out, in / 2] uint8 (blocks of 64
    rows, row n and n + 32 in one byte) and scales_and_zeros [in / group, out, 2], where it computes
    w = (q - 8) * scale + zero, so its zero is (8 - our zero point) * scale."""
    codes = unpack_int4(w.packed).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack([w.scales, (8 - w.zeros) * w.scales], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


def variants(
    weight: torch.Tensor, w8: Int8Weight, w4: Int4Weight
) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, int], dict[str, torch.Tensor]]:
    """(name -> call on float32 x, name -> weight bytes it keeps, format -> float32 dequantized reference)."""
    wb = weight.bfloat16()
    ws = torch.empty(workspace_elems(weight.shape[1]))  # what a serving process keeps: one per process
    t4_packed, t4_sz = torch_int4_layout(w4)
    group = w4.group_size
    calls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "f32_linear": lambda x: F.linear(x, weight),
        "bf16_linear": lambda x: F.linear(x, wb),  # x is cast once, outside the timing (see run_row)
        "int8_tiled": lambda x: int8_linear_torch(x, w8, workspace=ws),
        "int8_tiled_new_buffer": lambda x: int8_linear_torch(x, w8),
        "int8_tiled_tile128k": lambda x: with_setting(quant_int8, "TILE_ELEMS", 1 << 17, int8_linear_torch)(
            x, w8, workspace=ws
        ),
        "int8_full_dequant": lambda x: F.linear(x, dequantize_int8(w8, torch.float32)),
        "int8_torch_fused": lambda x: torch.ops.aten._weight_int8pack_mm(x, w8.qweight, w8.scales),
        "int8_torch_fused_bf16x": lambda x: torch.ops.aten._weight_int8pack_mm(
            x.bfloat16(), w8.qweight, w8.scales.bfloat16()
        ).float(),
        "int4_tiled": lambda x: int4_linear_torch(x, w4, workspace=ws),
        "int4_tiled_new_buffer": lambda x: int4_linear_torch(x, w4),
        "int4_tiled_tile128k": lambda x: with_setting(quant_int4, "TILE_ELEMS", 1 << 17, int4_linear_torch)(
            x, w4, workspace=ws
        ),
        "int4_split_only": lambda x: with_setting(quant_int4, "SPLIT_MAX_TOKENS", 1 << 30, int4_linear_torch)(
            x, w4, workspace=ws
        ),
        "int4_interleaved_only": lambda x: with_setting(quant_int4, "SPLIT_MAX_TOKENS", -1, int4_linear_torch)(
            x, w4, workspace=ws
        ),
        "int4_full_dequant": lambda x: F.linear(x, dequantize_int4(w4, torch.float32)),
        "int4_torch_fused": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t4_packed, group, t4_sz),
    }
    api4 = w4.nbytes()
    nbytes = {
        "f32_linear": weight.numel() * 4,
        "bf16_linear": weight.numel() * 2,
        **{name: w8.nbytes() for name in calls if name.startswith("int8")},
        **{name: api4 for name in calls if name.startswith("int4")},
        # Alone, its layout costs what ours does; kept beside the API's packed codes it adds them again.
        "int4_torch_fused": api4 + t4_packed.numel() + t4_sz.numel() * 4,
    }
    refs = {
        "f32": weight,
        "bf16": wb.float(),
        "int8": dequantize_int8(w8, torch.float32),
        "int4": dequantize_int4(w4, torch.float32),
    }
    return calls, nbytes, refs


def run_row(
    calls: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, repeats: int, flush: torch.Tensor
) -> dict[str, list[float]]:
    """Wall times per variant, taken round-robin (in a new order each round) so that a noisy neighbour slows
    every variant alike, each call after `flush` is rewritten (untimed)."""
    xb = x.bfloat16()
    inputs = {name: xb if name == "bf16_linear" else x for name in calls}
    first: dict[str, float] = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call(inputs[name])
        first[name] = time.perf_counter() - start
        call(inputs[name])
    counts = {
        name: 0 if t > SKIP_S else repeats if t < SLOW_S else max(3, min(repeats, int(SLOW_BUDGET_S / t)))
        for name, t in first.items()
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffler = random.Random(0)
    for i in range(repeats):
        shuffler.shuffle(order)
        for name in order:
            call = calls[name]
            if i < counts[name]:
                flush.add_(1.0)
                start = time.perf_counter()
                call(inputs[name])
                times[name].append(time.perf_counter() - start)
    return {name: ts or [first[name]] for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per variant (default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flush-mib", type=int, default=64, help="cache-evicting buffer per timed call (0: none)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    load_before = os.getloadavg()[0]
    flush = torch.zeros(args.flush_mib * (1 << 20) // 4)

    results: list[dict[str, Any]] = []
    for matrix, (out_features, in_features) in MATRICES.items():
        weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
        w8, w4 = quantize_int8(weight), quantize_int4(weight)
        calls, nbytes, refs = variants(weight, w8, w4)
        for num_tokens in TOKENS:
            x = torch.randn(num_tokens, in_features, generator=gen)
            times = run_row(calls, x, args.repeats, flush)
            row: dict[str, Any] = {"matrix": matrix, "out": out_features, "in": in_features, "tokens": num_tokens}
            for name, ts in times.items():
                ref = refs[name.split("_")[0]]
                arg = x.bfloat16() if name == "bf16_linear" else x
                err = (calls[name](arg).double() - x.double() @ ref.double().t()).abs().max()
                row[name] = {
                    "best_ms": round(min(ts) * 1e3, 3),
                    "median_ms": round(statistics.median(ts) * 1e3, 3),
                    "runs": len(ts),
                    "max_err": float(f"{float(err):.2e}"),
                    "weight_bytes": nbytes[name],
                }
            results.append(row)
            print(
                f"{matrix:8s} T={num_tokens:<4d} " + " ".join(f"{name}={row[name]['best_ms']:.3f}" for name in calls),
                flush=True,
            )

    report = {
        "benchmark": "int8_linear_torch / int4_linear_torch against the alternatives (float32 x)",
        "group_size": w4.group_size,
        "tile_elems": {"int8": quant_int8.TILE_ELEMS, "int4": quant_int4.TILE_ELEMS},
        "threads": args.threads,
        "flush_mib": args.flush_mib,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": machine(args.threads),
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
