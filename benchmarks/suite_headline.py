"""The serving suite's headline: one trace, on one model, sent to loraplex's engine server and to the naive online
server (benchmarks/naive_server.py: one adapter merged at a time), and the same requests run offline by peft's
mixed-adapter batched `generate` at its best static batch size (benchmarks/lora_throughput.py's runner)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_throughput import Workload
from lora_throughput import run_peft
from naive_server import chat_prompt_ids
from serve_trace import Conversation
from suite_assets import AdapterSet
from suite_runs import Runner, TraceConfig

logger = logging.getLogger(__name__)


def peft_offline(
    model_dir: Path, adapters: AdapterSet, trace: Sequence[Conversation], batch_sizes: Sequence[int]
) -> dict[str, Any]:
    """The trace's requests, all known up front, as peft's mixed-adapter static batches of each size (in trace
    order, each request with its own adapter); output tokens/s counts the tokens the requests asked for."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    # The prompts the servers make of the same chat requests (a single user turn each).
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": c.turns[0].question}]) for c in trace]
    workload = Workload(prompts=prompts, max_tokens=[c.turns[0].max_tokens for c in trace])
    index = {name: i for i, name in enumerate(adapters.names)}
    owners = [index[c.model] for c in trace]
    sizes = sorted({min(size, len(trace)) for size in batch_sizes})
    result = run_peft(model_dir, adapters.triples, workload, owners, sizes, warm_up=True)
    return {
        "best_batch_size": result["best_batch_size"],
        "output_tokens_per_s": result["best_tokens_per_s"],
        "by_batch_size": {size: run["tokens_per_s"] for size, run in result["by_batch_size"].items()},
    }


def headline(
    runner: Runner,
    model: str,
    model_dir: Path,
    adapters: AdapterSet,
    config: TraceConfig,
    peft_batch_sizes: Sequence[int],
) -> dict[str, Any]:
    """One headline entry: `config`'s trace over `adapters` on the model at `model_dir` (`model`: small or large).
    Both servers are warmed with a request to the base and to each adapter first."""
    base = model_dir.name
    trace = config.trace(base, adapters.names)
    warm = [base, *adapters.names[: config.num_adapters]]
    with runner.loraplex(model_dir, adapters.loras) as url:
        runner.warm_up(url, warm)
        ours = runner.drive(trace, url, label=f"{model}: loraplex", concurrency=config.concurrency)
    with runner.naive(model_dir, adapters.loras) as url:
        runner.warm_up(url, warm)
        naive = runner.drive(trace, url, label=f"{model}: naive online", concurrency=config.concurrency)
    runner.console.print(f"{model}: peft offline, static batches of {', '.join(map(str, peft_batch_sizes))}")
    offline = peft_offline(model_dir, adapters, trace, peft_batch_sizes)
    return {
        "model": model,
        "trace": {**config.describe(), "adapter_ranks": _ranks_words(adapters, config.num_adapters)},
        "loraplex": ours,
        "naive_online": naive,
        "peft_offline": offline,
        "loraplex_over_naive": _ratio(ours["output_tokens_per_s"], naive["output_tokens_per_s"]),
        "loraplex_over_peft_offline": _ratio(ours["output_tokens_per_s"], offline["output_tokens_per_s"]),
    }


def _ranks_words(adapters: AdapterSet, count: int) -> str:
    ranks = adapters.ranks[:count]
    return f"{min(ranks)}-{max(ranks)}, every linear layer"


def _ratio(ours: float, theirs: float) -> float | None:
    """None when the peer produced nothing (its errors are in its summary)."""
    return ours / theirs if theirs > 0 else None
