"""Mixture-of-experts throughput: random Qwen3-MoE checkpoints of two shapes, with and without LoRA on the experts.

Each MoE checkpoint has BENCHMARK_SPEC's attention, embeddings and vocabulary (hidden 512, 8 layers, 8 heads of 64,
4 KV heads, vocabulary 32000) and experts whose active size equals the dense model's MLP (1408): 8 experts of 704,
top-2 (Mixtral's shape), and 64 experts of 176, top-8 (Qwen3-30B-A3B's). In one run on this machine:
- loraplex on the MoE base (`LLM.generate` on the first --requests requests of benchmarks/engine_throughput.py's
  workload), against transformers' `generate` in static batches (the best of --batch-sizes);
- loraplex with 8 peft adapters on the same requests (Zipf popularity), each on q/k/v/o and both expert parameters
  (peft's target_parameters), ranks 8 and 16: LoRA/base;
- loraplex on a dense Qwen3 of the same shape and the same active parameters per token: MoE/dense.

    .venv/bin/python benchmarks/moe_throughput.py [--threads 2] [--requests 32] [--batch-sizes 16,32]
        [--shapes 8x2,64x8] [--repeats 1]

With --repeats N each loraplex run is repeated N times (the best counts; every run is listed). writes
benchmarks/results/moe_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import engine_throughput
import lora_throughput
import torch
from engine_throughput import Workload, make_workload, run_transformers, write_family_model
from serve_launch import machine

from loraplex.engine import LoRARequest
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_tokenizer

RESULTS = Path(__file__).parent / "results" / "moe_throughput.json"
# name -> (experts, top-k): each expert 1408 / top-k wide, so a token's active MLP is the dense model's.
SHAPES = {"8x2": (8, 2), "64x8": (64, 8)}
NUM_ADAPTERS = 8
RANKS = (8, 16)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BATCH = 2048  # max_num_batched_tokens of every loraplex run


def write_moe_model(path: Path, experts: int, top_k: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = BENCHMARK_SPEC
    config = Qwen3MoeConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size // top_k,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    write_tokenizer(path, vocab_size=spec.vocab_size)
    return path


def write_adapters(root: Path, base: Path) -> list[LoRARequest]:
    """NUM_ADAPTERS peft adapters on attention and the experts, random A and B (peft's init leaves B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    adapters = []
    for i in range(NUM_ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
        rank = rng.choice(RANKS)
        config = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=EXPERT_PARAMETERS,
            init_lora_weights=False,
        )
        peft_model = get_peft_model(model, config)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        path = root / f"adapter-{i}"
        peft_model.save_pretrained(path)
        adapters.append(LoRARequest(f"adapter-{i}", path))
    return adapters


def run_base(model_dir: Path, workload: Workload) -> dict[str, Any]:
    return engine_throughput.run_loraplex(model_dir, workload, max_num_batched_tokens=BATCH)


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(runs, key=lambda r: r["tokens_per_s"])
    return {**best, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32, help="The first N requests of the 64-request trace.")
    parser.add_argument("--batch-sizes", default="16,32", help="transformers' static batch sizes (its best counts)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    output: dict[str, Any] = {"machine": machine(args.threads), "threads": args.threads, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dense_dir = write_family_model(root / "dense", "qwen3", "float32")
        full = make_workload(ModelConfig.from_dir(dense_dir).vocab_size)
        workload = Workload(prompts=full.prompts[: args.requests], max_tokens=full.max_tokens[: args.requests])
        weights = [1 / (k + 1) for k in range(NUM_ADAPTERS)]
        owners = random.Random(1).choices(range(NUM_ADAPTERS), weights=weights, k=len(workload.prompts))
        dense = best_of([run_base(dense_dir, workload) for _ in range(args.repeats)])
        print(f"dense qwen3      {dense['tokens_per_s']:7.1f} tok/s")
        output["dense"] = dense
        for name in args.shapes.split(","):
            experts, top_k = SHAPES[name]
            model_dir = write_moe_model(root / f"moe-{name}", experts, top_k)
            config = ModelConfig.from_dir(model_dir)
            adapters = write_adapters(root / f"adapters-{name}", model_dir)
            loras: list[LoRARequest | None] = [adapters[i] for i in owners]
            base_runs, lora_runs = [], []
            for _ in range(args.repeats):
                base_runs.append(run_base(model_dir, workload))
                lora_runs.append(lora_throughput.run_loraplex(model_dir, workload, loras, max_num_batched_tokens=BATCH))
            base, lora = best_of(base_runs), best_of(lora_runs)
            reference = run_transformers(model_dir, workload, batch_sizes)
            entry = {
                "experts": experts,
                "top_k": top_k,
                "expert_intermediate": config.moe.intermediate_size if config.moe else 0,
                "parameters": config.num_parameters(),
                "active_mlp_parameters_per_layer": config.mlp_parameters(0, active=True),
                "loraplex": base,
                "loraplex_lora": lora,
                "transformers": reference,
                "over_transformers": base["tokens_per_s"] / reference["best_tokens_per_s"],
                "lora_over_base": lora["tokens_per_s"] / base["tokens_per_s"],
                "over_dense": base["tokens_per_s"] / dense["tokens_per_s"],
            }
            output["shapes"][name] = entry
            print(
                f"{name:6s} loraplex {base['tokens_per_s']:7.1f} tok/s, with expert LoRA {lora['tokens_per_s']:7.1f}, "
                f"transformers {reference['best_tokens_per_s']:7.1f}: {entry['over_transformers']:.2f}x, "
                f"LoRA/base {entry['lora_over_base']:.2f}, MoE/dense {entry['over_dense']:.2f}"
            )
    output["workload"] = {"requests": len(workload.prompts), "useful_output_tokens": workload.useful_tokens}
    output["adapters"] = {"count": NUM_ADAPTERS, "ranks": list(RANKS), "targets": "q/k/v/o and both expert tensors"}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
