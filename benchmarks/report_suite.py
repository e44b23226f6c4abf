"""The parts of docs/benchmarks.md drawn from benchmarks/results/suite.json, the serving sweeps of benchmarks/suite.py.

Each sweep point carries a serve summary (benchmarks/serve_stats.Summary as a dict: throughput, goodput under the
SLO, and the mean / p50 / p90 / p99 of TTFT, TPOT, ITL and E2E in milliseconds).
"""

from __future__ import annotations

from typing import Any

import report_plots
from report_data import Results, latency, ms, num, table, writes, x
from report_plots import Plots

SUMMARY_HEADER = ["output tok/s", "goodput req/s", "TTFT p50 / p99", "TPOT p50 / p99", "errors"]


def summary_cells(summary: dict[str, Any]) -> list[str]:
    goodput = summary.get("goodput_per_s")
    return [
        num(summary["output_tokens_per_s"]),
        "—" if goodput is None else num(goodput, 2),
        f"{ms(latency(summary, 'ttft', 'p50'))} / {ms(latency(summary, 'ttft', 'p99'))}",
        f"{ms(latency(summary, 'tpot', 'p50'))} / {ms(latency(summary, 'tpot', 'p99'))}",
        str(summary["num_errors"]),
    ]


def slo_words(summary: dict[str, Any]) -> str:
    slo = summary.get("slo") or {}
    bounds = [f"TTFT ≤ {slo['ttft_ms']:g} ms"] if slo.get("ttft_ms") is not None else []
    bounds += [f"TPOT ≤ {slo['tpot_ms']:g} ms"] if slo.get("tpot_ms") is not None else []
    return " and ".join(bounds) or "no SLO"


def model_words(doc: dict[str, Any], model: str) -> str:
    spec = doc["models"][model]
    if spec is None:
        return model
    return (
        f"{model} model ({spec['parameters'] / 1e6:.1f}M parameters, hidden {spec['hidden']}, {spec['layers']} layers)"
    )


def trace_words(trace: dict[str, Any]) -> str:
    """The trace's settings as the file records them, `key value` for each plain one."""
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in trace.items() if isinstance(v, str | int | float))


def _run_words(doc: dict[str, Any]) -> str:
    quick = " (a `--quick` run: fewer requests per point)" if doc.get("quick") else ""
    return f"one run of {doc['duration_s'] / 60:.0f} min{quick}"


def sweep(doc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """A sweep's points; KeyError when the run left it out (`suite.py --only` writes an empty list)."""
    points = doc["sweeps"].get(name)
    if not points:
        raise KeyError(f"sweeps.{name}")
    return list(points)


def headline(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    if not doc["headline"]:
        raise KeyError("headline")
    lines = [
        "The same online trace (streamed requests over many adapters) sent to loraplex's engine server and to a naive"
        " online server: transformers and peft keeping one adapter merged into the base at a time, each batch the"
        " waiting requests of one adapter, as a first multi-LoRA deployment without a multi-adapter kernel does"
        " (benchmarks/naive_server.py). peft's best offline batch on the same requests gives the scale. All in"
        f" {_run_words(doc)}.",
    ]
    for entry in doc["headline"]:
        loraplex = entry["loraplex"]
        peft = entry["peft_offline"]
        lines += [
            "",
            f"**{model_words(doc, entry['model'])}**, trace: {trace_words(entry['trace'])}; goodput within"
            f" {slo_words(loraplex)}.",
            "",
        ]
        rows = [
            ["loraplex", *summary_cells(loraplex)],
            ["naive online", *summary_cells(entry["naive_online"])],
            [f"peft offline (batch {peft['best_batch_size']})", num(peft["output_tokens_per_s"]), "—", "—", "—", "—"],
        ]
        lines += table(["server", *SUMMARY_HEADER], rows)
        lines += [
            "",
            f"loraplex / naive online: **{x(entry['loraplex_over_naive'])}**; loraplex online / peft offline:"
            f" **{x(entry['loraplex_over_peft_offline'])}** (output tokens/s).",
        ]
    return [*lines, "", writes("suite") + "."]


def rate(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    points = sorted(sweep(doc, "rate"), key=lambda p: p["rate"])
    summaries = [p["summary"] for p in points]
    figure = report_plots.rate(
        [p["rate"] for p in points],
        [s["output_tokens_per_s"] for s in summaries],
        [s.get("goodput_per_s") for s in summaries],
        [latency(s, "ttft", "p99") for s in summaries],
        [latency(s, "tpot", "p99") for s in summaries],
    )
    lines = [
        "",
        f"**Latency under load**: the loraplex engine at rising request rates (goodput within"
        f" {slo_words(summaries[0])}).",
        "",
        plots.save("rate", figure, "throughput and p99 latency against request rate"),
        "",
    ]
    rows = [[f"{p['rate']:.3g}", num(p["summary"]["requests_per_s"], 2), *summary_cells(p["summary"])] for p in points]
    capacity = doc["sweeps"].get("rate_capacity")
    if capacity:
        served = capacity["summary"]
        rows.insert(
            0,
            [
                f"closed loop, {capacity['concurrency']} clients",
                num(served["requests_per_s"], 2),
                *summary_cells(served),
            ],
        )
        lines += [
            "The closed loop (each client sending its next request when the last is answered) gives the capacity;"
            " the Poisson rates run from a quarter of it to past it.",
            "",
        ]
    return [*lines, *table(["offered req/s", "served req/s", *SUMMARY_HEADER], rows)]


def adapters(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    sweeps = doc["sweeps"]
    points = sorted(sweep(doc, "adapters"), key=lambda p: p["num_adapters"])
    series = {
        "adapters sweep": (
            [p["num_adapters"] for p in points],
            [p["summary"]["output_tokens_per_s"] for p in points],
            [latency(p["summary"], "tpot", "p99") for p in points],
        )
    }
    for ranks in sorted({p["ranks"] for p in sweeps.get("rank_mix", [])}):
        mix = sorted((p for p in sweeps["rank_mix"] if p["ranks"] == ranks), key=lambda p: p["num_adapters"])
        series[f"ranks {ranks}"] = (
            [p["num_adapters"] for p in mix],
            [p["summary"]["output_tokens_per_s"] for p in mix],
            [latency(p["summary"], "tpot", "p99") for p in mix],
        )
    lines = [
        "**Online, more adapters**: the serving trace spread over more distinct adapters (rank 8 on q and v; those"
        " that do not fit the adapter pool move between it and host memory), and equally many adapters of rank 8"
        " against ranks 8 to 64 on every linear layer.",
        "",
        plots.save("adapters", report_plots.adapters(series), "output tokens/s against the number of adapters"),
        "",
    ]
    rows = [[str(p["num_adapters"]), *summary_cells(p["summary"])] for p in points]
    lines += table(["adapters", *SUMMARY_HEADER], rows)
    return [*lines, "", writes("suite") + "."]


def pool_budget(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    points = sorted(sweep(doc, "pool_budget"), key=lambda p: p["budget_mib"])
    figure = report_plots.pool_budget(
        [p["budget_mib"] for p in points],
        [p["unified_resident"] for p in points],
        [p["padded_resident"] for p in points],
    )
    rows = [
        [
            f"{p['budget_mib']:g}",
            str(p["unified_resident"]),
            str(p["padded_resident"]),
            x(p["unified_resident"] / p["padded_resident"]) if p["padded_resident"] else "—",
        ]
        for p in points
    ]
    lines = [
        "Adapters of mixed ranks resident in an adapter pool of each size: pages in proportion to each adapter's"
        " rank (what loraplex does) against every adapter padded to the largest rank.",
        "",
        plots.save("pool_budget", figure, "adapters resident against the pool budget"),
        "",
    ]
    lines += table(["pool MiB", "rank-proportional", "padded", "ratio"], rows)
    return [*lines, "", writes("suite") + "."]


def prefix_cache(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    points = sorted(sweep(doc, "prefix_cache"), key=lambda p: not p["enabled"])
    labels = ["cache on" if p["enabled"] else "cache off" for p in points]
    summaries = [p["summary"] for p in points]
    figure = report_plots.prefix_cache(
        labels, [latency(s, "ttft", "p50") for s in summaries], [latency(s, "ttft", "p99") for s in summaries]
    )
    rows = []
    for label, s in zip(labels, summaries, strict=True):
        share = s.get("cached_share")
        rows.append([label, "—" if share is None else f"{share:.2f}", *summary_cells(s)])
    lines = [
        "**Online, multi-turn chat**: the serving suite's chat trace with the engine's prefix cache on and off.",
        "",
        plots.save("prefix_cache", figure, "time to first token with the prefix cache on and off"),
        "",
    ]
    lines += table(["", "prompt from cache", *SUMMARY_HEADER], rows)
    return [*lines, "", writes("suite") + "."]
