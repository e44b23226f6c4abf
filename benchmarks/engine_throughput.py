"""Engine throughput: 64 requests of mixed lengths, all at once, on a random ~50M-parameter Llama.

Compares, in one run on this machine:
- loraplex's continuous-batching engine (`LLM.generate` on all 64 requests);
- transformers' `generate` with static batches (left-padded, greedy), at each batch size, keeping its best;
- the machine's compute limit for the workload: the workload's FLOPs over the matmul FLOP/s torch reaches here.

Throughput counts useful output tokens: the tokens each request asked for (ignore_eos, so exactly max_tokens).

    .venv/bin/python benchmarks/engine_throughput.py [--threads 2] [--batch-sizes 16,32,64] [--skip-transformers]
        [--dtype float32|bfloat16|float16] [--repeats 1] [--family llama|qwen3|gemma3|phi3]

--family writes a random checkpoint of that family in the same shape (hidden 512, 8 layers, 8 heads of 64, 4 KV
heads, MLP 1408, vocabulary 32000) with transformers itself: Qwen3 with its q/k norms, Gemma 3 with five sliding
layers (window 512) to each global one and its embedding scale, Phi-3 with fused projections. A family's ratio to
transformers is compared with Llama's from a run on the same machine.

With --repeats N both sides run N times, alternating (loraplex, then transformers at every batch size); each side
keeps its best run, and every run is listed: a shared host can slow one run by far more than the difference
being measured.

writes benchmarks/results/engine_throughput.json (float32, the issue's workload) or
engine_throughput_<dtype>.json: the checkpoint, both engines and the limit's 2048-square matmul all in that dtype;
with a --family other than llama, engine_throughput_<family>.json (float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

RESULTS = Path(__file__).parent / "results" / "engine_throughput.json"
NUM_REQUESTS = 64
PROMPT_LENS = (16, 256)
OUTPUT_LENS = (16, 128)


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(vocab_size: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab_size) for _ in range(rng.randint(*PROMPT_LENS))] for _ in range(NUM_REQUESTS)]
    return Workload(prompts=prompts, max_tokens=[rng.randint(*OUTPUT_LENS) for _ in range(NUM_REQUESTS)])


FAMILIES = ("llama", "qwen3", "gemma3", "phi3")


def write_family_model(path: Path, family: str, dtype: str) -> Path:
    """A random checkpoint of `family` in BENCHMARK_SPEC's shape, written by transformers, with the demo tokenizer."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from loraplex.engine.tools.demo import write_tokenizer

    spec = BENCHMARK_SPEC
    shape: dict[str, Any] = {
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
    }
    head_dim = spec.hidden_size // spec.num_attention_heads
    if family == "qwen3":
        config: Any = Qwen3Config(**shape, head_dim=head_dim, tie_word_embeddings=False)
        model: Any = Qwen3ForCausalLM(config)
    elif family == "gemma3":
        layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(spec.num_hidden_layers)]
        config = Gemma3TextConfig(
            **shape, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=512, layer_types=layers
        )
        model = Gemma3ForCausalLM(config)
    elif family == "phi3":
        config = Phi3Config(**shape, original_max_position_embeddings=spec.max_position_embeddings)
        model = Phi3ForCausalLM(config)
    else:
        raise ValueError(f"unknown family {family!r}")
    model.to(getattr(torch, dtype)).save_pretrained(path)
    write_tokenizer(path, vocab_size=spec.vocab_size)
    return path


def workload_flops(config: ModelConfig, workload: Workload) -> float:
    """The arithmetic the workload needs, whoever runs it: every matmul of every token fed to the model once, the
    lm_head once per generated token, and attention over each token's context (QK and PV)."""
    c = config
    matmul_params = c.num_layers * (
        c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    )
    flops = 0.0
    for prompt, out in zip(workload.prompts, workload.max_tokens, strict=True):
        fed = len(prompt) + out - 1  # the last generated token is never fed back
        flops += 2 * matmul_params * fed
        flops += 2 * c.vocab_size * c.hidden_size * out
        context_sum = fed * (fed + 1) / 2  # token at position p attends p + 1 keys
        flops += 4 * c.num_layers * c.num_heads * c.head_dim * context_sum
    return flops


def matmul_flops_per_second(size: int = 2048, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def run_loraplex(
    model_dir: Path, workload: Workload, *, max_num_batched_tokens: int, dtype: str = "float32"
) -> dict[str, Any]:
    llm = LLM(
        model_dir,
        dtype=dtype,
        device="cpu",
        kv_budget=2 * 2**30,
        max_model_len=512,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # Warm-up outside the clock: first calls allocate and page in what every later step reuses.
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:4]], warm)
    llm.generate([{"prompt_token_ids": workload.prompts[4]}], warm)
    steps_before = llm.engine.num_steps
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in workload.max_tokens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.useful_tokens, (produced, workload.useful_tokens)
    return {
        "seconds": elapsed,
        "tokens_per_s": workload.useful_tokens / elapsed,
        "steps": llm.engine.num_steps - steps_before,
        "max_num_batched_tokens": max_num_batched_tokens,
        "preemptions": llm.engine.num_preemptions,
    }


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of the prompts as one batch, padded on the left as decoder-only generation
    needs."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_transformers(
    model_dir: Path, workload: Workload, batch_sizes: list[int], dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
    results: dict[str, Any] = {}
    for batch_size in batch_sizes:
        start = time.perf_counter()
        for first in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[first : first + batch_size]
            outs = workload.max_tokens[first : first + batch_size]
            ids, mask = left_padded(prompts)
            with torch.inference_mode():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(outs),
                    min_new_tokens=max(outs),
                    do_sample=False,
                    pad_token_id=0,
                )
        elapsed = time.perf_counter() - start
        results[str(batch_size)] = {"seconds": elapsed, "tokens_per_s": workload.useful_tokens / elapsed}
    best = max(results, key=lambda k: results[k]["tokens_per_s"])
    return {"by_batch_size": results, "best_batch_size": int(best), "best_tokens_per_s": results[best]["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--batch-sizes", default="16,32,64")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating; best kept")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        if args.family == "llama":
            spec = dataclasses.replace(BENCHMARK_SPEC, torch_dtype=args.dtype)
            model_dir = write_random_model(Path(tmp) / "model", spec)
        else:
            model_dir = write_family_model(Path(tmp) / "model", args.family, args.dtype)
        config = ModelConfig.from_dir(model_dir)
        workload = make_workload(config.vocab_size)
        flops = workload_flops(config, workload)
        peak = matmul_flops_per_second(dtype=dtype)
        limit_tokens_per_s = workload.useful_tokens / (flops / peak)

        our_runs: list[dict[str, Any]] = []
        their_runs: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            our_runs.append(
                run_loraplex(model_dir, workload, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
            )
            if not args.skip_transformers:
                their_runs.append(
                    run_transformers(model_dir, workload, [int(b) for b in args.batch_sizes.split(",")], dtype)
                )
        ours = max(our_runs, key=lambda run: run["tokens_per_s"])
        theirs = max(their_runs, key=lambda run: run["best_tokens_per_s"]) if their_runs else None
        peak_after = matmul_flops_per_second(dtype=dtype)

    result: dict[str, Any] = {
        "machine": machine(args.threads),
        "model": {
            "family": args.family,
            "parameters": config.num_parameters(),
            "hidden": config.hidden_size,
            "layers": config.num_layers,
            "heads": config.num_heads,
            "kv_heads": config.num_kv_heads,
            "vocab": config.vocab_size,
            "dtype": args.dtype,
        },
        "workload": {
            "requests": NUM_REQUESTS,
            "prompt_tokens": sum(map(len, workload.prompts)),
            "useful_output_tokens": workload.useful_tokens,
            "gflop": flops / 1e9,
        },
        "matmul_gflops": {"before": peak / 1e9, "after": peak_after / 1e9},
        "limit_tokens_per_s": limit_tokens_per_s,
        "loraplex": ours,
        "loraplex_fraction_of_limit": ours["tokens_per_s"] / limit_tokens_per_s,
        "transformers": theirs,
        "runs": {
            "loraplex_tokens_per_s": [run["tokens_per_s"] for run in our_runs],
            "transformers_best_tokens_per_s": [run["best_tokens_per_s"] for run in their_runs],
        },
    }
    if theirs is not None:
        result["loraplex_over_transformers"] = ours["tokens_per_s"] / theirs["best_tokens_per_s"]
    path = RESULTS if args.dtype == "float32" else RESULTS.with_name(f"engine_throughput_{args.dtype}.json")
    if args.family != "llama":
        path = RESULTS.with_name(f"engine_throughput_{args.family}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
