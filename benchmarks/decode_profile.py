"""Where the throughput benchmarks' time goes: small-row matmul rates and a profile of the timed runs.

1. Memory bandwidth (a 256 MiB copy) and matmul rates (GFLOP/s) at the shapes of the benchmark model's decode
   steps, for the row counts a decode step has (64 requests shrinking to 1; 37 on average): `F.linear` on the
   checkpoint's row-major weight, `F.linear` on the input-major copy the engine keeps for float32 on a CPU
   (docs/decisions/0017), the row-major lm_head in vocabulary slices (what the engine does when it is row-major),
   MKL's pre-packed weights (`torch.ops.mkl._mkl_linear`, only at the row count they were packed for) and
   `W @ x.T`; beside the 2048-square rate the compute limit of benchmarks/engine_throughput.py assumes.
2. The matmul floor of the base trace: the trace run once to record every step's token and logits row counts,
   then the engine's own projections (its weights, in its layout) and lm_head timed alone at each step's counts,
   best of three. Their sum is what the trace would take if attention and everything else were free; beside the
   compute limit it gives the highest fraction of the limit this engine's matmuls allow (`ceiling_fraction`).
   The same again with the weights row-major, as the checkpoint holds them (`row_major_seconds`: what the matmuls
   cost before the engine kept float32 weights input-major, docs/decisions/0017).
3. cProfile of the timed `LLM.generate` of benchmarks/engine_throughput.py (base model) and of
   benchmarks/lora_throughput.py (the LoRA trace): seconds in the ops that matter and how many small LoRA matmuls
   there were.

    .venv/bin/python benchmarks/decode_profile.py [--threads 2] [--skip-profile]

writes benchmarks/results/decode_profile.json.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import json
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lora_throughput
import torch
import torch.nn.functional as F
from engine_throughput import (
    NUM_REQUESTS,
    Workload,
    make_workload,
    matmul_flops_per_second,
    run_loraplex,
    workload_flops,
)

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.decoder import DecoderModel
from loraplex.engine.model.quant_linear import addmm, linear
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

RESULTS = Path(__file__).parent / "results" / "decode_profile.json"
ROWS = (1, 16, 37, 64, 128)
LM_HEAD_SLICE = 2048  # engine/model/llama.py's _LM_HEAD_SLICE


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def copy_gb_per_second(num_bytes: int = 256 * 2**20) -> float:
    """Memory bandwidth as a large tensor copy sees it (bytes read plus bytes written, per second)."""
    source = torch.randn(num_bytes // 4)
    target = torch.empty_like(source)
    return 2 * num_bytes / _seconds(lambda: target.copy_(source), 5) / 1e9


def matmul_rates(config: ModelConfig) -> dict[str, Any]:
    c = config
    shapes = {
        "qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
        "o": (c.hidden_size, c.q_size),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }
    rates: dict[str, Any] = {}
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features)
        input_major = weight.t().contiguous().t()
        repeats = 10 if name == "lm_head" else 100
        rates[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            variants: dict[str, Callable[[], object]] = {
                "linear": lambda x=x, w=weight: F.linear(x, w),
                "input_major": lambda x=x, w=input_major: F.linear(x, w),
                "mkl_packed": lambda x=x, w=weight, p=packed, r=rows: torch.ops.mkl._mkl_linear(x, p, w, None, r),
                "w_xt": lambda x=x, w=weight: torch.mm(w, x.t()),
            }
            if name == "lm_head":
                variants["sliced"] = lambda x=x, w=weight: torch.cat(
                    [F.linear(x, part) for part in torch.split(w, LM_HEAD_SLICE)], -1
                )
            flop = 2 * rows * out_features * in_features
            rates[name][str(rows)] = {k: flop / _seconds(f, repeats) / 1e9 for k, f in variants.items()}
            print(name, rows, {k: round(v) for k, v in rates[name][str(rows)].items()}, flush=True)
    return rates


def _step_matmuls_seconds(model: DecoderModel, tokens: int, logits_rows: int) -> float:
    """Best of three: one step's projections over `tokens` rows in every layer, then the lm_head over
    `logits_rows`, with the model's own weights (what a step of the engine multiplies)."""
    c = model.config
    x = torch.randn(tokens, c.hidden_size)
    attn = torch.randn(tokens, c.q_size)
    act = torch.randn(tokens, c.intermediate_size)
    hidden = torch.randn(logits_rows, c.hidden_size)

    @torch.inference_mode()
    def step() -> None:
        for layer in model.layers:
            linear(x, layer.qkv, layer.qkv_bias)
            addmm(x, attn, layer.o)
            linear(x, layer.gate_up)
            addmm(x, act, layer.down)
        if logits_rows:
            model.compute_logits(hidden)

    step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_floor(model_dir: Path, workload: Workload) -> dict[str, Any]:
    """Run the base trace once, recording (tokens, logits rows) per step, then time each step's matmuls alone."""
    llm = LLM(
        model_dir, dtype="float32", device="cpu", kv_budget=2 * 2**30, max_model_len=512, max_num_batched_tokens=8192
    )
    model = llm.engine.model
    steps: list[list[int]] = []
    forward, logits = model.forward, model.compute_logits

    def record_forward(batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = forward(batch, *args, **kwargs)
        steps.append([hidden.shape[0], 0])
        return hidden

    def record_logits(hidden: torch.Tensor) -> torch.Tensor:
        steps[-1][1] = hidden.shape[0]
        return logits(hidden)

    model.forward, model.compute_logits = record_forward, record_logits  # type: ignore[method-assign]
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
        llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    finally:
        del model.forward, model.compute_logits  # back to the class's methods
    # The same weights row-major: the engine's matmuls as they ran before it kept them input-major.
    row_major = copy.copy(model)
    row_major.layers = [
        dataclasses.replace(
            layer,
            qkv=layer.qkv.contiguous(),
            o=layer.o.contiguous(),
            gate_up=layer.gate_up.contiguous(),
            down=layer.down.contiguous(),
        )
        for layer in model.layers
    ]
    row_major.lm_head = model.lm_head.contiguous()
    timed: dict[tuple[int, int], tuple[float, float]] = {}
    for tokens, rows in steps:
        if (tokens, rows) not in timed:
            timed[(tokens, rows)] = (
                _step_matmuls_seconds(model, tokens, rows),
                _step_matmuls_seconds(row_major, tokens, rows),
            )
    seconds = sum(timed[shape][0] for shape in map(tuple, steps))
    return {
        "steps": len(steps),
        "distinct_shapes": len(timed),
        "seconds": seconds,
        "tokens_per_s": workload.useful_tokens / seconds,
        "row_major_seconds": sum(timed[shape][1] for shape in map(tuple, steps)),
    }


# Functions whose time the profile reports: (label, how to read it: tottime of a builtin or cumtime of ours).
_PROFILED = {
    "layer and lm_head F.linear": ("<built-in method torch._C._nn.linear>", "tottime"),
    "o and down torch.addmm": ("<built-in method torch.addmm>", "tottime"),
    "lm_head (compute_logits)": ("model.py:compute_logits", "cumtime"),
    "paged attention": ("paged_attention.py:paged_attention_torch", "cumtime"),
    "decode attention": ("paged_attention.py:_decode", "cumtime"),
    "sgmv_shrink_torch": ("sgmv_shrink.py:sgmv_shrink_torch", "cumtime"),
    "sgmv_expand_torch": ("sgmv_expand.py:sgmv_expand_torch", "cumtime"),
    "torch.mm calls": ("<built-in method torch.mm>", "tottime"),
    "Tensor.addmm_ calls": ("<method 'addmm_' of 'torch._C.TensorBase' objects>", "tottime"),
}


def _summary(profile: cProfile.Profile) -> dict[str, Any]:
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    out: dict[str, Any] = {}
    for label, (pattern, column) in _PROFILED.items():
        calls, seconds = 0, 0.0
        for (file, _, func), (_, ncalls, tottime, cumtime, _) in stats.items():
            where = func if file == "~" else f"{Path(file).name}:{func}"
            if where == pattern:
                calls += ncalls
                seconds += tottime if column == "tottime" else cumtime
        out[label] = {"seconds": seconds, "calls": calls}
    return out


def _profiled(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a benchmark function, profiling only its timed call: the last `generate` of all NUM_REQUESTS prompts."""
    original = LLM.generate
    profiles: list[cProfile.Profile] = []

    def generate(self: LLM, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        if len(prompts) != NUM_REQUESTS:
            return original(self, prompts, *args, **kwargs)
        profile = cProfile.Profile()
        profiles.append(profile)
        return profile.runcall(original, self, prompts, *args, **kwargs)

    LLM.generate = generate  # type: ignore[method-assign]
    try:
        result = run()
    finally:
        LLM.generate = original  # type: ignore[method-assign]
    return {"result": result, "profile": _summary(profiles[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_random_model(root / "model", dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32"))
        config = ModelConfig.from_dir(model_dir)
        # Best of five: the floor is a best time too, and one reading of a busy host's rate can be 20% low.
        peak = max(matmul_flops_per_second() for _ in range(5))
        workload = make_workload(config.vocab_size)
        limit_tokens_per_s = workload.useful_tokens / (workload_flops(config, workload) / peak)
        result: dict[str, Any] = {
            "threads": args.threads,
            "matmul_2048_gflops": peak / 1e9,
            "limit_tokens_per_s": limit_tokens_per_s,
            "copy_gb_per_s": copy_gb_per_second(),
            "matmul_gflops": matmul_rates(config),
        }
        floor = matmul_floor(model_dir, workload)
        floor["ceiling_fraction"] = floor["tokens_per_s"] / limit_tokens_per_s
        result["matmul_floor"] = floor
        print("matmul floor", json.dumps(floor), flush=True)
        if not args.skip_profile:
            base = _profiled(lambda: run_loraplex(model_dir, workload, max_num_batched_tokens=8192))
            adapters = lora_throughput.make_adapters(root, config)
            loras: list[LoRARequest | None] = [
                LoRARequest(adapters[i][0], adapters[i][1]) for i in lora_throughput.popularity()
            ]
            lora = _profiled(
                lambda: lora_throughput.run_loraplex(model_dir, workload, loras, max_num_batched_tokens=8192)
            )
            result["profile"] = {"base": base, "lora": lora}
            for name, run in result["profile"].items():
                print(name, round(run["result"]["seconds"], 2), "s", json.dumps(run["profile"]), flush=True)

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
