"""The serving suite's sweeps on the loraplex engine server (the small model): distinct adapters, rank mix, request
rate up to and past saturation, and the prefix cache on and off on a chat trace; and, computed without a server,
adapters resident against the pool's budget."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from lora_throughput import RANKS, adapter_pages, adapter_ranks, fit_in_pool, page_bytes
from suite_assets import AdapterSet
from suite_runs import ChatConfig, Runner, TraceConfig

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo_adapter import write_random_adapter

logger = logging.getLogger(__name__)

# Adapters resident in the pool at once in the adapters sweep: a 64-request trace over 2048 adapters names about
# 40, which the engine's default 64 slots would all hold; with 16, the larger counts go through the host tier.
ADAPTER_SWEEP_SLOTS = 16


def adapters_sweep(
    runner: Runner, model_dir: Path, adapters: AdapterSet, counts: Sequence[int], config: TraceConfig
) -> list[dict[str, Any]]:
    """`config`'s trace spread over each count of distinct adapters, a fresh server for each holding that many. Only
    the base is warmed: an adapter loads (from disk) when the trace first asks for it. The pool has
    ADAPTER_SWEEP_SLOTS adapter slots, so that past them adapters move between the pool and the host-memory tier
    (2 GiB by default, which holds all of them) as the trace asks for them."""
    base = model_dir.name
    slots = ["--max-loras", str(ADAPTER_SWEEP_SLOTS), "--max-adapters-per-batch", str(ADAPTER_SWEEP_SLOTS)]
    points = []
    for count in counts:
        subset = adapters.first(count)
        with runner.loraplex(model_dir, subset.loras, engine_args=slots) as url:
            runner.warm_up(url, [base])
            trace = dataclasses.replace(config, num_adapters=count).trace(base, subset.names)
            summary = runner.drive(trace, url, label=f"{count} adapters", concurrency=config.concurrency)
            states = adapter_states(url)
        points.append({"num_adapters": count, "summary": summary, "adapter_states": states})
    return points


def adapter_states(url: str) -> dict[str, int]:
    """How many of the server's adapters are in each tier now (/v1/state): resident (pool), loaded (host memory),
    absent (never asked for, or dropped), loading, failed."""
    response = httpx.get(f"{url}/v1/state", timeout=30)
    response.raise_for_status()
    return dict(Counter(str(entry["state"]) for entry in response.json()["adapters"].values()))


def rank_mix_sweep(
    runner: Runner, model_dir: Path, sets: dict[str, AdapterSet], config: TraceConfig
) -> list[dict[str, Any]]:
    """The same trace over equally many adapters of each rank mix in `sets` ("8", "8-64"), one server holding them
    all; each set is warmed (every adapter resident) before its run."""
    base = model_dir.name
    loras = [lora for adapters in sets.values() for lora in adapters.loras]
    points = []
    with runner.loraplex(model_dir, loras) as url:
        for ranks, adapters in sets.items():
            runner.warm_up(url, [base, *adapters.names[: config.num_adapters]])
            trace = config.trace(base, adapters.names)
            summary = runner.drive(trace, url, label=f"ranks {ranks}", concurrency=config.concurrency)
            points.append({"ranks": ranks, "num_adapters": config.num_adapters, "summary": summary})
    return points


def rate_sweep(
    runner: Runner, model_dir: Path, adapters: AdapterSet, config: TraceConfig, fractions: Sequence[float]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The server's capacity first (`config`'s closed loop: its requests/s), then Poisson arrivals at each fraction of
    it; returns (the capacity run, the points). Rates follow the machine, so the sweep crosses saturation wherever
    it is."""
    base = model_dir.name
    with runner.loraplex(model_dir, adapters.loras) as url:
        runner.warm_up(url, [base, *adapters.names[: config.num_adapters]])
        probe = runner.drive(
            config.trace(base, adapters.names), url, label="capacity (closed loop)", concurrency=config.concurrency
        )
        capacity = probe["requests_per_s"]
        points = []
        for i, fraction in enumerate(fractions):
            rate = round(fraction * capacity, 2)
            if rate <= 0:
                logger.warning("no capacity measured: the rate sweep stops")
                break
            open_loop = dataclasses.replace(config, concurrency=None, rate=rate, seed=config.seed + 1 + i)
            summary = runner.drive(open_loop.trace(base, adapters.names), url, label=f"rate {rate:g} req/s")
            points.append({"rate": rate, "summary": summary})
    return {"concurrency": config.concurrency, "summary": probe}, points


def prefix_cache_sweep(runner: Runner, model_dir: Path, adapters: AdapterSet, chat: ChatConfig) -> list[dict[str, Any]]:
    """The chat trace (tenants on adapters of `adapters`) with the engine's prefix cache on, then off."""
    base = model_dir.name
    trace = chat.trace(base, adapters.names)
    models = sorted({c.model for c in trace})
    points = []
    for enabled in (True, False):
        flag = "--enable-prefix-caching" if enabled else "--no-enable-prefix-caching"
        with runner.loraplex(model_dir, adapters.loras, engine_args=[flag]) as url:
            runner.warm_up(url, [base, *models])
            summary = runner.drive(trace, url, label=f"chat, prefix cache {'on' if enabled else 'off'}")
        points.append({"enabled": enabled, "summary": summary})
    return points


def pool_budget_sweep(
    root: Path, config: ModelConfig, budgets_mib: Sequence[float], num_adapters: int
) -> list[dict[str, Any]]:
    """For each pool budget, how many of `num_adapters` adapters of ranks 8-64 (every linear layer; ranks drawn as
    lora_throughput draws them, the most popular first) are resident: the engine's pages in proportion to rank,
    against every adapter padded to the largest rank. Page counts come from the engine's layout of one adapter of
    each rank written to `root`."""
    pages_by_rank = {
        rank: adapter_pages(config, write_random_adapter(root / f"rank-{rank}", config, rank=rank)) for rank in RANKS
    }
    pages = [pages_by_rank[rank] for rank in adapter_ranks(seed=1, count=num_adapters)]
    points = []
    for mib in budgets_mib:
        budget_pages = int(mib * 2**20) // page_bytes(config)
        unified, padded = fit_in_pool(pages, pages_by_rank[max(RANKS)], budget_pages)
        points.append({"budget_mib": float(mib), "unified_resident": unified, "padded_resident": padded})
    return points
