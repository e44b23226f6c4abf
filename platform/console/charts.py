"""Chart view models for console pages: horizontal bar charts laid out as HTML rows (console.css's `.bars`), one row
per label, so that a label wraps instead of being cut off; each bar is an inline SVG whose rects are sized in percent
of the chart's largest value, so it scales with the page and needs no script.

Pure functions from (label, value, value text) rows to the figures a template writes: no markup here, and no
figure is computed in a template. Values are amounts (counts, money): never negative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A bar with a value above 0 is drawn at least this wide (percent), so a small day still shows a mark beside its
# figure; a value of 0 draws nothing.
MIN_VISIBLE_PERCENT = 0.5


@dataclass(frozen=True, slots=True)
class Series:
    """One series of a stacked chart: `key` is its CSS class (the colour lives in the stylesheet), `name` its legend
    text."""

    key: str
    name: str


@dataclass(frozen=True, slots=True)
class Segment:
    series: str  # the Series key; "" in a chart of one series
    x: str  # where it starts, percent of the bar's box ("12.5%")
    width: str  # percent of the bar's box ("40.0%")


@dataclass(frozen=True, slots=True)
class BarRow:
    label: str  # shown whole: the row wraps it
    value_text: str  # the figure beside the bar, formatted by the caller ("1 request", "$0.25")
    segments: tuple[Segment, ...]  # left to right; empty when the row's value is 0


@dataclass(frozen=True, slots=True)
class BarChart:
    chart_id: str
    title: str
    rows: tuple[BarRow, ...]
    legend: tuple[Series, ...]  # empty for a chart of one series


def percent(value: float, maximum: float) -> float:
    """`value` as a percentage of `maximum`, to one decimal, within [0, 100]; 0 when `maximum` is 0."""
    if value < 0 or maximum < 0:
        raise ValueError(f"chart values must not be negative (got {value} of {maximum})")
    if maximum == 0:
        return 0.0
    return round(min(value / maximum, 1.0) * 100, 1)


def bar_chart(chart_id: str, title: str, rows: Sequence[tuple[str, float, str]]) -> BarChart:
    """One bar per (label, value, value text) row, in the given order, each as wide as its value's share of the
    largest value."""
    top = max((value for _, value, _ in rows), default=0.0)
    chart_rows = []
    for label, value, value_text in rows:
        width = percent(value, top)
        if value > 0:
            width = max(width, MIN_VISIBLE_PERCENT)
        segments = (Segment("", "0%", _css(width)),) if width > 0 else ()
        chart_rows.append(BarRow(label, value_text, segments))
    return BarChart(chart_id, title, tuple(chart_rows), legend=())


def stacked_chart(
    chart_id: str, title: str, series: Sequence[Series], rows: Sequence[tuple[str, Sequence[float], str]]
) -> BarChart:
    """One bar per (label, parts, value text) row, made of one segment per series (`parts` in `series` order), the
    longest bar's parts summing to the full width. Segment edges are rounded, not widths, so the segments of a bar
    meet without gaps and end where the bar's total does."""
    for label, parts, _ in rows:
        if len(parts) != len(series):
            raise ValueError(f"row {label!r} has {len(parts)} parts for {len(series)} series")
    top = max((sum(parts) for _, parts, _ in rows), default=0.0)
    chart_rows = []
    for label, parts, value_text in rows:
        segments = []
        running = 0.0
        start = 0.0
        for one, part in zip(series, parts, strict=True):
            running += part
            end = percent(running, top)
            if part > 0 and end > start:
                segments.append(Segment(one.key, _css(start), _css(round(end - start, 1))))
            start = end
        chart_rows.append(BarRow(label, value_text, tuple(segments)))
    return BarChart(chart_id, title, tuple(chart_rows), legend=tuple(series))


def _css(value: float) -> str:
    return "0%" if value == 0 else f"{value:.1f}%"
