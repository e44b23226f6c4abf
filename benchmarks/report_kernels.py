"""The kernel parts of docs/benchmarks.md: the CPU paths of paged attention, the LoRA shrink/expand and the quantized
matmuls, each timed alone on the benchmark model's step shapes (best of many calls)."""

from __future__ import annotations

from typing import Any

from report_data import Results, num, table, writes, x
from report_plots import Plots


def attention_cpu(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = [
        [
            r["shape"],
            r["layout"],
            str(r["num_seqs"]),
            num(r["num_query_tokens"]),
            num(r["num_context_tokens"]),
            f"{r['best_ms']:.2f}",
        ]
        for r in doc["results"]
    ]
    lines = [f"**Paged attention**, one layer ({doc['num_heads']} heads, {doc['num_kv_heads']} KV heads), best ms:", ""]
    lines += table(["shape", "cache layout", "sequences", "query tokens", "cached tokens", "best ms"], rows)
    return [*lines, "", writes("attention_cpu") + "."]


def sgmv_cpu(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = [
        [
            r["shape"],
            r["layout"],
            r["module"],
            f"{r['num_tokens']} / {r['num_segments']}",
            f"{r['pool_best_ms']:.2f}",
            f"{r['baseline_best_ms']:.2f}",
            x(r["pool_over_baseline_best"]),
        ]
        for r in doc["results"]
    ]
    lines = [
        "**LoRA shrink and expand through the adapter pool**, against plain per-segment matmuls on ready-made"
        " tensors (best ms; an adapter's pages in one run, or scattered over the pool):",
        "",
    ]
    lines += table(["shape", "pages", "module", "tokens / segments", "pool", "plain matmuls", "pool / plain"], rows)
    return [*lines, "", writes("sgmv_cpu") + "."]


def quant_cpu(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    by_tokens: dict[int, dict[str, list[float]]] = {}
    for r in doc["results"]:
        base = r["f32_linear"]["best_ms"]
        ratios = by_tokens.setdefault(r["tokens"], {"bf16_linear": [], "int8_tiled": [], "int4_tiled": []})
        for variant, values in ratios.items():
            values.append(r[variant]["best_ms"] / base)

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}"

    rows = [[str(t), *(spread(v) for v in ratios.values())] for t, ratios in sorted(by_tokens.items())]
    lines = [
        "**Quantized matmuls**, the benchmark model's four projections: time per call over float32 `F.linear`'s"
        " (the range over the projections; above 1 is slower):",
        "",
    ]
    lines += table(["tokens", "bf16", "int8", "int4"], rows)
    return [
        *lines,
        "",
        writes("quant_cpu") + "; the per-call table: docs/decisions/0028-cpu-quantized-matmul-findings.md.",
    ]
