"""What the serving suite (benchmarks/suite.py) serves: seeded random models and seeded random PEFT adapters, made
in a temporary folder at each run.

Models are the engine's random Llamas (loraplex.engine.tools.demo): the ~56M-parameter BENCHMARK_SPEC and a ~246M one
(hidden 1024, 16 layers), in float32. Their vocabulary is 32,000 ids but the tokenizer's ends at 2,228 (the rest are
padding rows no text maps to), and its special tokens write no text either. The lm_head rows of every id that writes
no text are zeroed, so that greedy decoding never picks one (the largest of two thousand random logits is positive):
every output token carries text, and a client's time to first token and gaps between tokens are measured per token
(a random model's greedy answer often repeats one token, which would otherwise be an end-of-turn marker for the
whole answer). The matmuls keep their full size.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from lora_throughput import make_adapters
from safetensors.torch import load_file, save_file

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, RandomModelSpec, write_random_model
from loraplex.engine.tools.demo_adapter import write_random_adapter

SMALL_SPEC = dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32")  # ~56M parameters
LARGE_SPEC = dataclasses.replace(  # ~246M parameters
    SMALL_SPEC,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
)
GPU_SPEC = dataclasses.replace(  # ~1B parameters, bf16: the GPU scripts' model (scripts/bench_gpu.sh, bench_tp_gpu.sh)
    SMALL_SPEC,
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=5632,
    torch_dtype="bfloat16",
)
# Many adapters on disk must be cheap to write and to hold: rank 8 on q_proj and v_proj only, stored in bfloat16
# (about 230 KB each on the small model).
MANY_TARGETS = ("q_proj", "v_proj")


def write_model(path: Path, spec: RandomModelSpec) -> Path:
    """A random model at `path` whose greedy outputs are ids its tokenizer can write (see the module's docstring)."""
    from transformers import AutoTokenizer

    if spec.tie_word_embeddings:
        raise ValueError("zeroing lm_head rows of a tied model would zero its embeddings too")
    folder = write_random_model(path, spec)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    silent = [i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True)]
    weights_file = folder / "model.safetensors"
    weights = load_file(weights_file)
    weights["lm_head.weight"][len(tokenizer) :] = 0
    weights["lm_head.weight"][silent] = 0
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return Path(folder)


def model_info(config: ModelConfig) -> dict[str, Any]:
    return {"parameters": config.num_parameters(), "hidden": config.hidden_size, "layers": config.num_layers}


@dataclasses.dataclass(frozen=True)
class AdapterSet:
    """Adapters on disk, the most popular first (a trace's Zipf draw gives index 0 the most requests)."""

    names: tuple[str, ...]
    paths: tuple[Path, ...]
    ranks: tuple[int, ...]

    @property
    def loras(self) -> list[tuple[str, Path]]:
        return list(zip(self.names, self.paths, strict=True))

    @property
    def triples(self) -> list[tuple[str, Path, int]]:
        """(name, path, rank) each, as benchmarks/lora_throughput.py's peft runner takes them."""
        return list(zip(self.names, self.paths, self.ranks, strict=True))

    def first(self, count: int) -> AdapterSet:
        if count > len(self.names):
            raise ValueError(f"{count} adapters asked of a set of {len(self.names)}")
        return AdapterSet(self.names[:count], self.paths[:count], self.ranks[:count])


def mixed_adapters(root: Path, config: ModelConfig, count: int) -> AdapterSet:
    """`count` adapters of ranks 8 to 64 on every linear layer (lora_throughput's, seeded)."""
    triples = make_adapters(root, config, count=count)
    return AdapterSet(tuple(n for n, _, _ in triples), tuple(p for _, p, _ in triples), tuple(r for _, _, r in triples))


def rank8_adapters(root: Path, config: ModelConfig, count: int) -> AdapterSet:
    """`count` adapters of rank 8 on every linear layer, as `mixed_adapters` but for the rank."""
    names = tuple(f"rank8-{i:02d}" for i in range(count))
    paths = tuple(
        write_random_adapter(root / name, config, rank=8, seed=i, init_std=0.02) for i, name in enumerate(names)
    )
    return AdapterSet(names, paths, (8,) * count)


def many_adapters(root: Path, config: ModelConfig, count: int) -> AdapterSet:
    """`count` small adapters (rank 8 on q and v, bfloat16), each with its own seed: the engine knows adapters by
    content, so no two may be equal."""
    names = tuple(f"many-{i:04d}" for i in range(count))
    paths = tuple(
        write_random_adapter(
            root / name, config, rank=8, target_modules=MANY_TARGETS, seed=i, init_std=0.02, dtype=torch.bfloat16
        )
        for i, name in enumerate(names)
    )
    return AdapterSet(names, paths, (8,) * count)
