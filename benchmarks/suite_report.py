"""The serving suite's printed summary: its result document (benchmarks/results/suite.json) as terminal tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

# Output tokens/s, requests/s, goodput (requests/s within the SLO), latency percentiles (ms), failed requests.
COLUMNS = ("tok/s", "req/s", "good/s", "TTFT 50/99", "TPOT 50/99", "E2E 99", "err")


def _ms(summary: dict[str, Any], metric: str, stat: str) -> str:
    stats = summary.get(metric)
    return "-" if stats is None else f"{stats[stat]:.0f}"


def summary_cells(summary: dict[str, Any]) -> list[str]:
    """A serve summary's main figures (latencies in ms), in COLUMNS' order."""
    goodput = summary.get("goodput_per_s")
    return [
        f"{summary['output_tokens_per_s']:.1f}",
        f"{summary['requests_per_s']:.2f}",
        "-" if goodput is None else f"{goodput:.2f}",
        f"{_ms(summary, 'ttft', 'p50')}/{_ms(summary, 'ttft', 'p99')}",
        f"{_ms(summary, 'tpot', 'p50')}/{_ms(summary, 'tpot', 'p99')}",
        _ms(summary, "e2e", "p99"),
        str(summary["num_errors"]),
    ]


def _table(title: str, first: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(title=f"{title} (latencies in ms)", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for column in (*first, *COLUMNS):
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def print_summary(document: dict[str, Any], console: Console) -> None:
    for entry in document["headline"]:
        peft = entry["peft_offline"]
        rows = [
            ["loraplex", *summary_cells(entry["loraplex"])],
            ["naive", *summary_cells(entry["naive_online"])],
            [f"peft b{peft['best_batch_size']}", f"{peft['output_tokens_per_s']:.1f}"] + ["-"] * (len(COLUMNS) - 1),
        ]
        title = f"headline, {entry['model']} model: loraplex, naive online, peft offline at its best batch size"
        console.print(_table(title, ["server"], rows))

        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}x"

        console.print(
            f"loraplex / naive online: {ratio(entry['loraplex_over_naive'])}, "
            f"loraplex / peft offline: {ratio(entry['loraplex_over_peft_offline'])} (output tokens/s)"
        )
    sweeps = document["sweeps"]
    if sweeps["adapters"]:
        rows = [[str(p["num_adapters"]), *summary_cells(p["summary"])] for p in sweeps["adapters"]]
        console.print(_table("distinct adapters", ["adapters"], rows))
        tiers = [
            f"{p['num_adapters']}: {p['adapter_states'].get('resident', 0)}/{p['adapter_states'].get('loaded', 0)}"
            for p in sweeps["adapters"]
            if "adapter_states" in p
        ]
        console.print(f"adapters in the pool / in host memory after each run: {', '.join(tiers)}")
    if sweeps["rank_mix"]:
        rows = [[p["ranks"], *summary_cells(p["summary"])] for p in sweeps["rank_mix"]]
        console.print(_table(f"rank mix, {sweeps['rank_mix'][0]['num_adapters']} adapters", ["ranks"], rows))
    if sweeps["rate"]:
        capacity = sweeps.get("rate_capacity")
        rows = [["capacity", *summary_cells(capacity["summary"])]] if capacity else []
        rows += [[f"{p['rate']:g}", *summary_cells(p["summary"])] for p in sweeps["rate"]]
        console.print(_table("request rate (Poisson, req/s offered)", ["rate"], rows))
    if sweeps["prefix_cache"]:
        rows = []
        for p in sweeps["prefix_cache"]:
            share = p["summary"].get("cached_share")
            cached = "-" if share is None else f"{share:.0%}"
            rows.append([f"{'on' if p['enabled'] else 'off'}, {cached}", *summary_cells(p["summary"])])
        console.print(_table("prefix cache, chat trace", ["cache, hit"], rows))
    if sweeps["pool_budget"]:
        table = Table(title="adapters resident against the pool budget", title_justify="left", box=box.SIMPLE_HEAD)
        for column in ("pool MiB", "rank-proportional", "padded to max rank"):
            table.add_column(column, justify="right")
        for p in sweeps["pool_budget"]:
            table.add_row(f"{p['budget_mib']:g}", str(p["unified_resident"]), str(p["padded_resident"]))
        console.print(table)
