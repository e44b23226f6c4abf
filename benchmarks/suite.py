"""The serving suite: loraplex against its peers on the same models, traces and machine, in one run, and its
sweeps (issue 20, points 2 and 3).

- headline (small model, and a ~246M one unless --skip-large): one trace of single-turn chats over adapters of
  ranks 8-64 with Zipf popularity, a closed loop of clients, sent to loraplex's engine server and to the naive online
  server (benchmarks/naive_server.py: transformers + peft, one adapter merged at a time, the others' requests
  wait); the same requests run offline by peft's mixed-adapter static batches at its best batch size. Ratios of
  output tokens/s: loraplex / naive, loraplex / peft offline.
- adapters: the trace over 1, 8, 64, 512, 2048 distinct adapters (rank 8 on q and v, cheap to write and hold), the
  pool holding 16 at once: past that, adapters move between the pool and the host-memory tier.
- rank_mix: equally many adapters of rank 8, then of ranks 8-64 (every linear layer).
- rate: the closed-loop capacity (16 clients), then Poisson arrivals from a quarter of it to twice it, with goodput
  under the SLO.
- prefix_cache: a multi-turn chat trace (a system prompt per tenant) with the engine's prefix cache on and off.
- pool_budget: adapters of ranks 8-64 resident in pools of several sizes, pages in proportion to rank against padded
  to the largest rank (computed from the engine's layout; no server).

Models and adapters are seeded random ones written to a temporary folder (benchmarks/suite_assets.py). Every server
runs in a process of its own with `--threads` torch threads; the sweeps use the small model.

    .venv/bin/python benchmarks/suite.py [--quick] [--skip-large] [--only headline,rate] [--threads 2]
        [--slo-ttft-ms 2000] [--slo-tpot-ms 250] [--out benchmarks/results/suite.json]

--quick (the tests' smoke run) sends a few requests per point with short outputs, skips the large model and the
larger adapter counts. Every request is greedy and held to its max_tokens (ignore_eos). Writes
benchmarks/results/suite.json (`--out`) and prints a summary.

The result file (benchmarks/report_suite.py reads it): machine (serve_launch.machine: cpu, cpu_model, kind, ...), commit
(-dirty when tracked files differ), date, duration_s, quick, models {small, large (null when not run)}: {parameters,
hidden, layers}; headline [{model, trace, loraplex, naive_online, peft_offline {best_batch_size, output_tokens_per_s,
by_batch_size}, loraplex_over_naive, loraplex_over_peft_offline (null when the peer produced nothing)}]; sweeps
{adapters [{num_adapters, summary, adapter_states (adapters per tier after the run)}], rank_mix [{ranks, num_adapters,
summary}], rate [{rate, summary}], rate_capacity {concurrency, summary} (the closed-loop run the rates are fractions
of), prefix_cache [{enabled, summary}], pool_budget [{budget_mib, unified_resident, padded_resident}]}; stages_s
(seconds per part and asset). A summary is serve.py's (serve.summary_document); parts not run leave empty lists.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from rich.console import Console
from serve_launch import machine
from serve_stats import Slo
from suite_assets import (
    LARGE_SPEC,
    SMALL_SPEC,
    AdapterSet,
    many_adapters,
    mixed_adapters,
    model_info,
    rank8_adapters,
    write_model,
)
from suite_headline import headline
from suite_report import print_summary
from suite_runs import ChatConfig, Runner, TraceConfig
from suite_sweeps import adapters_sweep, pool_budget_sweep, prefix_cache_sweep, rank_mix_sweep, rate_sweep

from loraplex.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "suite.json"
T = TypeVar("T")
PARTS = ("headline", "adapters", "rank_mix", "rate", "prefix_cache", "pool_budget")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much each part sends: the full run fits in about 12 minutes on 2 cores, --quick in under one."""

    headline_small: TraceConfig
    headline_large: TraceConfig
    peft_batch_sizes: tuple[int, ...]
    peft_batch_sizes_large: tuple[int, ...]
    sweep: TraceConfig  # adapters, rank_mix and rate (num_adapters: the rank mix's and the rate sweep's)
    adapter_counts: tuple[int, ...]
    rate_requests: int
    rate_fractions: tuple[float, ...]
    chat: ChatConfig
    pool_budgets_mib: tuple[float, ...]
    pool_adapters: int


FULL = Sizes(
    headline_small=TraceConfig(64, input_len="32:96", output_len="32", num_adapters=32, concurrency=16),
    headline_large=TraceConfig(16, input_len="32:64", output_len="16", num_adapters=8, concurrency=8),
    peft_batch_sizes=(16, 64),
    peft_batch_sizes_large=(8, 16),
    sweep=TraceConfig(48, input_len="32:96", output_len="16", num_adapters=32, concurrency=16),
    adapter_counts=(1, 8, 64, 512, 2048),
    rate_requests=40,
    rate_fractions=(0.25, 0.5, 1.0, 1.5, 2.0),
    chat=ChatConfig(
        4, 2, turns="3", system_len="192", question_len="16:32", answer_len="16", think_s="0.2:0.6", rate=1.0
    ),
    pool_budgets_mib=(32, 64, 128, 256, 512, 1024),
    pool_adapters=2048,
)
QUICK = Sizes(
    headline_small=TraceConfig(12, input_len="16:32", output_len="8", num_adapters=4, concurrency=4),
    headline_large=TraceConfig(8, input_len="16:32", output_len="4", num_adapters=2, concurrency=4),
    peft_batch_sizes=(4, 12),
    peft_batch_sizes_large=(8,),
    sweep=TraceConfig(12, input_len="16:32", output_len="8", num_adapters=4, concurrency=4),
    adapter_counts=(8,),
    rate_requests=8,
    rate_fractions=(0.5, 1.5),
    chat=ChatConfig(2, 1, turns="2", system_len="64", question_len="8:16", answer_len="8", think_s="0.1:0.2", rate=4.0),
    pool_budgets_mib=(32, 128, 512),
    pool_adapters=256,
)


def commit() -> str:
    """The checkout's short commit, with -dirty when tracked files differ from it; "unknown" outside git."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


class Suite:
    """One run's parts. Models and adapters are written when a part first needs them, and kept for the others."""

    def __init__(self, root: Path, sizes: Sizes, runner: Runner, num_parts: int) -> None:
        self.root = root
        self.sizes = sizes
        self.runner = runner
        self.num_parts = num_parts  # for the progress display
        self.num_started = 0
        self.stages_s: dict[str, float] = {}  # what each part and each asset took
        self._made: dict[str, Any] = {}

    def _timed(self, name: str, make: Callable[[], T]) -> T:
        started = time.perf_counter()
        result = make()
        self.stages_s[name] = time.perf_counter() - started
        return result

    def _asset(self, name: str, make: Callable[[], T]) -> T:
        if name not in self._made:
            self._made[name] = self._timed(f"make {name}", make)
        made: T = self._made[name]
        return made

    def model(self, key: str) -> tuple[Path, ModelConfig]:
        spec = SMALL_SPEC if key == "small" else LARGE_SPEC
        folder = self._asset(f"{key} model", lambda: write_model(self.root / key, spec))
        return folder, ModelConfig.from_dir(folder)

    def mixed(self, key: str) -> AdapterSet:
        """Adapters of ranks 8-64 for the `key` model: as many as its headline and the sweeps ask for."""
        _, config = self.model(key)
        sizes = self.sizes
        count = max(sizes.headline_small.num_adapters, sizes.sweep.num_adapters)
        count = count if key == "small" else sizes.headline_large.num_adapters
        return self._asset(f"{key} adapters 8-64", lambda: mixed_adapters(self.root / f"{key}-mixed", config, count))

    def part(self, name: str, run: Callable[[], T]) -> T:
        self.num_started += 1
        self.runner.console.rule(f"[{self.num_started}/{self.num_parts}] {name}")
        return self._timed(name, run)

    # --- the parts ---------------------------------------------------------------------------------------------------

    def headline(self, key: str) -> dict[str, Any]:
        model_dir, _ = self.model(key)
        adapters = self.mixed(key)
        small = key == "small"
        config = self.sizes.headline_small if small else self.sizes.headline_large
        batch_sizes = self.sizes.peft_batch_sizes if small else self.sizes.peft_batch_sizes_large
        return self.part(
            f"headline: {key} model", lambda: headline(self.runner, key, model_dir, adapters, config, batch_sizes)
        )

    def adapters(self) -> list[dict[str, Any]]:
        model_dir, config = self.model("small")
        counts = self.sizes.adapter_counts
        many = self._asset("many adapters", lambda: many_adapters(self.root / "many", config, max(counts)))
        return self.part(
            "sweep: distinct adapters", lambda: adapters_sweep(self.runner, model_dir, many, counts, self.sizes.sweep)
        )

    def rank_mix(self) -> list[dict[str, Any]]:
        model_dir, config = self.model("small")
        count = self.sizes.sweep.num_adapters
        rank8 = self._asset("adapters 8", lambda: rank8_adapters(self.root / "rank8", config, count))
        sets = {"8": rank8, "8-64": self.mixed("small")}
        return self.part("sweep: rank mix", lambda: rank_mix_sweep(self.runner, model_dir, sets, self.sizes.sweep))

    def rate(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        model_dir, _ = self.model("small")
        adapters = self.mixed("small")
        config = dataclasses.replace(self.sizes.sweep, num_requests=self.sizes.rate_requests)
        fractions = self.sizes.rate_fractions
        return self.part("sweep: request rate", lambda: rate_sweep(self.runner, model_dir, adapters, config, fractions))

    def prefix_cache(self) -> list[dict[str, Any]]:
        model_dir, _ = self.model("small")
        adapters = self.mixed("small")
        return self.part(
            "sweep: prefix cache", lambda: prefix_cache_sweep(self.runner, model_dir, adapters, self.sizes.chat)
        )

    def pool_budget(self) -> list[dict[str, Any]]:
        _, config = self.model("small")
        budgets, count = self.sizes.pool_budgets_mib, self.sizes.pool_adapters
        return self.part("sweep: pool budget", lambda: pool_budget_sweep(self.root / "ranks", config, budgets, count))


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Every part of `args.only`, in PARTS' order; the result document (parts not run have empty lists)."""
    runner = Runner(console, Slo(args.slo_ttft_ms, args.slo_tpot_ms), args.threads, progress=not args.no_progress)
    started = time.perf_counter()
    entries: list[dict[str, Any]] = []
    sweeps: dict[str, Any] = {"adapters": [], "rank_mix": [], "rate": [], "prefix_cache": [], "pool_budget": []}
    large: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="loraplex-suite-") as tmp:
        with_large = "headline" in args.only and not (args.skip_large or args.quick)
        suite = Suite(Path(tmp), QUICK if args.quick else FULL, runner, len(args.only) + with_large)
        _, small_config = suite.model("small")
        if "headline" in args.only:
            entries.append(suite.headline("small"))
            if with_large:
                entries.append(suite.headline("large"))
                large = model_info(suite.model("large")[1])
        if "adapters" in args.only:
            sweeps["adapters"] = suite.adapters()
        if "rank_mix" in args.only:
            sweeps["rank_mix"] = suite.rank_mix()
        if "rate" in args.only:
            sweeps["rate_capacity"], sweeps["rate"] = suite.rate()
        if "prefix_cache" in args.only:
            sweeps["prefix_cache"] = suite.prefix_cache()
        if "pool_budget" in args.only:
            sweeps["pool_budget"] = suite.pool_budget()
    return {
        "machine": machine(args.threads),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "duration_s": time.perf_counter() - started,
        "quick": args.quick,
        "models": {"small": model_info(small_config), "large": large},
        "headline": entries,
        "sweeps": sweeps,
        "stages_s": suite.stages_s,
    }


def _parts(text: str) -> frozenset[str]:
    parts = frozenset(p.strip() for p in text.split(",") if p.strip())
    unknown = parts - set(PARTS)
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; not {', '.join(sorted(unknown)) or 'none'}")
    return parts


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="A smoke run: a few requests per point (under a minute).")
    parser.add_argument("--skip-large", action="store_true", help="No ~246M-parameter headline.")
    parser.add_argument("--only", type=_parts, default=frozenset(PARTS), help=f"Parts to run, of {','.join(PARTS)}.")
    parser.add_argument("--out", type=Path, default=RESULTS, help="The result file.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server and of peft offline.")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="Goodput: TTFT bound.")
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0, help="Goodput: TPOT bound.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    torch.set_num_threads(args.threads)
    console = Console()
    document = run(args, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print_summary(document, console)
    console.print(f"wrote {args.out} ({document['duration_s']:.0f} s)")


if __name__ == "__main__":
    main()
