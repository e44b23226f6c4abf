"""KV memory one sequence holds with sliding windows, against full attention, for Gemma 3's shapes (5 sliding layers
to each global one) at 8k and 32k tokens.

Two measurements:
- the engine's own books (KVGroups and KVCacheManager, 16-token blocks, 512-token prefill chunks) for the real
  shapes: 1B (26 layers, window 512), 4B (34, 1024), 12B (48, 1024), 27B (62, 1024); the figure is layer-blocks held
  once the prompt is prefilled over what full attention holds, and beside it the bound no allocator can beat
  (global layers hold every block, sliding ones exactly their window);
- a real engine on a random 6-layer Gemma 3 checkpoint (window 512): the pool pages its one 8192-token request holds
  after its prefill, from the pool's own usage, over the same model with the windows turned off.

    .venv/bin/python benchmarks/sliding_window_memory.py

writes benchmarks/results/sliding_window_memory.json.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from serve_launch import machine

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.kv_groups import KVGroups
from loraplex.engine.memory.page_pool import PagePool
from loraplex.engine.memory.sequence import SequenceBlocks

RESULTS = Path(__file__).parent / "results" / "sliding_window_memory.json"
BLOCK = 16
CHUNK = 512
SHAPES = {"gemma3-1b": (26, 512), "gemma3-4b": (34, 1024), "gemma3-12b": (48, 1024), "gemma3-27b": (62, 1024)}


@dataclass
class _Sequence:
    token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    adapter_digest: str | None = None
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


def _windows(num_layers: int, window: int) -> list[int | None]:
    return [None if (layer + 1) % 6 == 0 else window for layer in range(num_layers)]


def books(num_layers: int, window: int, num_tokens: int) -> dict[str, Any]:
    windows = _windows(num_layers, window)
    groups = KVGroups.of(windows)
    blocks = -(-num_tokens // BLOCK)
    pool = PagePool(
        num_pages=blocks * groups.num_groups + 8,
        num_layers=groups.num_slots,
        page_elems=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kv = KVCacheManager(pool, BLOCK, groups=groups)
    seq = _Sequence([0] * num_tokens)
    peak = 0
    while seq.num_computed_tokens < num_tokens:
        step = min(CHUNK, num_tokens - seq.num_computed_tokens)
        kv.grow(seq, step)
        peak = max(peak, pool.num_pages - pool.num_free)
        seq.num_computed_tokens += step
        kv.cache_computed(seq)
    held = (pool.num_pages - pool.num_free) * groups.num_slots
    full = blocks * num_layers
    num_global = windows.count(None)
    ideal = (num_global * num_tokens + (num_layers - num_global) * min(window, num_tokens)) / (num_layers * num_tokens)
    return {
        "tokens": num_tokens,
        "groups": groups.num_groups,
        "layers_per_page": groups.num_slots,
        "held_over_full": held / full,
        "peak_while_prefilling_over_full": peak * groups.num_slots / full,
        "bound_over_full": ideal,
    }


def engine_probe(num_tokens: int = 8192) -> dict[str, Any]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from loraplex.engine.tools.demo import write_tokenizer

    held: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layer_types in (("windows", _windows(6, 512)), ("full", [None] * 6)):
            config = Gemma3TextConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=16,
                vocab_size=512,
                max_position_embeddings=num_tokens + 64,
                sliding_window=512,
                layer_types=["full_attention" if w is None else "sliding_attention" for w in layer_types],
                pad_token_id=None,
            )
            path = Path(tmp) / name
            Gemma3ForCausalLM(config).save_pretrained(path)
            write_tokenizer(path, vocab_size=512)
            llm = LLM(
                path,
                dtype="float32",
                device="cpu",
                kv_budget=64 * 2**20,
                max_num_batched_tokens=CHUNK,
                enable_prefix_caching=False,
            )
            core = llm.engine
            core.add_request("probe", [3 + i % 500 for i in range(num_tokens)], SamplingParams(max_tokens=2))
            while core.requests["probe"].num_computed_tokens < num_tokens:
                core.step()
            pool = core.pool
            held[name] = (pool.num_pages - pool.num_free) * pool.page_bytes
            core.abort_request("probe")
    return {"tokens": num_tokens, "bytes_held": held, "held_over_full": held["windows"] / held["full"]}


def main() -> None:
    shapes = {
        name: {"layers": layers, "window": window, "at": [books(layers, window, n) for n in (8192, 32768)]}
        for name, (layers, window) in SHAPES.items()
    }
    result = {"machine": machine(2), "block_size": BLOCK, "chunk": CHUNK, "shapes": shapes, "engine": engine_probe()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
