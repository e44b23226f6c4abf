"""The plots of docs/benchmarks.md: small PNGs drawn with matplotlib's Agg canvas (no display, no pyplot state).

Each function takes the figures it draws, already read from a results file, and returns a Figure; `Plots.save`
writes it and gives the Markdown that shows it on the page.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

DPI = 100
NAMES = ("rate", "adapters", "pool_budget", "prefix_cache", "speculative")  # every plot the page can show


class Plots:
    """Writes the page's plots into `directory`, linked from the page as `link_dir/NAME.png`. Plots the run did not
    draw (their results file is gone) are deleted by `remove_stale`, so the folder holds only what the page shows."""

    def __init__(self, directory: Path, link_dir: str) -> None:
        self.directory = directory
        self.link_dir = link_dir
        self.saved: list[str] = []

    def save(self, name: str, figure: Figure, alt: str) -> str:
        if name not in NAMES:
            raise ValueError(f"unknown plot {name!r}: add it to NAMES")
        self.directory.mkdir(parents=True, exist_ok=True)
        FigureCanvasAgg(figure)
        # No "Software" text: the file then changes only when its figures do.
        figure.savefig(
            self.directory / f"{name}.png", dpi=DPI, metadata={"Software": None}, pil_kwargs={"optimize": True}
        )
        self.saved.append(name)
        return f"![{alt}]({self.link_dir}/{name}.png)"

    def remove_stale(self) -> None:
        for name in NAMES:
            if name not in self.saved:
                (self.directory / f"{name}.png").unlink(missing_ok=True)


def _log2_axis(axes: Axes, values: Sequence[int]) -> None:
    """A log-2 x axis labelled with the values measured (1, 4, 16, 64), not powers of two."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(values), [str(v) for v in values])
    axes.xaxis.set_minor_locator(NullLocator())


def _gaps(values: Sequence[float | None]) -> list[float]:
    """None (no request had the figure) as a gap in the line."""
    return [float("nan") if v is None else v for v in values]


def _figure(panels: int) -> Figure:
    figure = Figure(figsize=(4.6 * panels, 3.3), layout="constrained")
    figure.subplots(1, panels, squeeze=False)
    return figure


def rate(
    rates: Sequence[float],
    tokens_per_s: Sequence[float],
    goodput: Sequence[float | None],
    ttft_p99: Sequence[float | None],
    tpot_p99: Sequence[float | None],
) -> Figure:
    """Throughput and p99 latency against the request rate offered (Poisson arrivals)."""
    figure = _figure(2)
    left, right = figure.axes
    handles = left.plot(rates, tokens_per_s, marker="o", label="output tokens/s")
    left.set_xlabel("requests/s offered")
    left.set_ylabel("output tokens/s")
    left.set_ylim(bottom=0)
    if any(g is not None for g in goodput):
        twin = left.twinx()
        handles += twin.plot(rates, _gaps(goodput), marker="s", linestyle="--", color="tab:green", label="goodput")
        twin.set_ylabel("goodput (requests/s within the SLO)")
        twin.set_ylim(bottom=0)
    left.legend(handles=handles, loc="upper left")
    left.set_title("throughput")
    for values, label in ((ttft_p99, "TTFT p99"), (tpot_p99, "TPOT p99")):
        right.plot(rates, _gaps(values), marker="o", label=label)
    right.set_yscale("log")
    right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    right.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    right.yaxis.set_minor_formatter(NullFormatter())
    right.set_xlabel("requests/s offered")
    right.set_ylabel("ms (log scale)")
    right.set_title("p99 latency")
    right.legend()
    return figure


def adapters(series: Mapping[str, tuple[Sequence[int], Sequence[float], Sequence[float | None]]]) -> Figure:
    """Output tokens/s and p99 TPOT against the number of adapters in the trace, one line per series
    (name -> (numbers of adapters, tokens/s, p99 TPOT in ms))."""
    figure = _figure(2)
    left, right = figure.axes
    for label, (counts, tokens_per_s, tpot_p99) in series.items():
        left.plot(counts, tokens_per_s, marker="o", label=label)
        right.plot(counts, _gaps(tpot_p99), marker="o", label=label)
    counts = sorted({c for series_counts, _, _ in series.values() for c in series_counts})
    for axes, ylabel, title in ((left, "output tokens/s", "throughput"), (right, "ms", "TPOT p99")):
        _log2_axis(axes, counts)
        axes.set_xlabel("adapters in the trace")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.legend()
    left.set_ylim(bottom=0)
    return figure


def pool_budget(budgets_mib: Sequence[float], unified: Sequence[int], padded: Sequence[int]) -> Figure:
    """Adapters resident against the pool's size: pages in proportion to rank against every adapter padded."""
    figure = _figure(1)
    (axes,) = figure.axes
    axes.plot(budgets_mib, unified, marker="o", label="pages in proportion to rank")
    axes.plot(budgets_mib, padded, marker="s", label="padded to the largest rank")
    axes.set_xlabel("adapter pool (MiB)")
    axes.set_ylabel("adapters resident")
    axes.set_ylim(bottom=0)
    axes.set_title("adapters that fit")
    axes.legend()
    return figure


def prefix_cache(labels: Sequence[str], ttft_p50: Sequence[float | None], ttft_p99: Sequence[float | None]) -> Figure:
    """TTFT p50 and p99 with the prefix cache on and off (one bar pair per run)."""
    figure = _figure(1)
    (axes,) = figure.axes
    positions = range(len(labels))
    width = 0.38
    for offset, values, label in ((-width / 2, ttft_p50, "p50"), (width / 2, ttft_p99, "p99")):
        axes.bar([p + offset for p in positions], [v or 0.0 for v in values], width, label=f"TTFT {label}")
    axes.set_xticks(list(positions), list(labels))
    axes.set_ylabel("ms")
    axes.set_title("time to first token")
    axes.legend()
    return figure


def speculative(concurrency: Sequence[int], ratios: Mapping[str, Sequence[float]], noise: Sequence[float]) -> Figure:
    """Speed-up over no speculation against the number of requests decoding at once; `noise` is the ratio of a
    second engine without speculation to the first (what the machine's drift alone gives)."""
    figure = _figure(1)
    (axes,) = figure.axes
    for label, values in ratios.items():
        axes.plot(concurrency, values, marker="o", label=label)
    axes.fill_between(
        concurrency,
        [min(noise)] * len(concurrency),
        [max(noise)] * len(concurrency),
        alpha=0.15,
        color="gray",
        label="no speculation, second engine (noise)",
    )
    axes.axhline(1.0, color="gray", linewidth=0.8)
    _log2_axis(axes, concurrency)
    axes.set_xlabel("requests decoding at once")
    axes.set_ylabel("tokens/s over no speculation")
    axes.set_title("speculative decoding")
    axes.legend(fontsize="small")
    return figure
