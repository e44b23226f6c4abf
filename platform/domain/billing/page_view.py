"""The billing page's view model: what its templates lay out. Strings are as shown (raw: the templates escape them),
geometry is in the cost chart's viewBox units or, for the bar charts, in percent, floats already formatted (to .1f or
.2f). Built by `page.page_view`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Card:
    """One of the totals at the top."""

    name: str  # its `data-total`
    label: str
    value: str
    note: str


@dataclass(frozen=True, slots=True)
class Frame:
    """A chart's <svg>: `chart` is its `data-chart` and prefixes the ids of its title and description."""

    chart: str
    width: int
    height: int
    title: str
    desc: str


@dataclass(frozen=True, slots=True)
class NoData:
    """The message a chart with nothing to draw shows in its middle."""

    x: str
    y: str
    text: str


@dataclass(frozen=True, slots=True)
class AxisLabel:
    x: str
    y: int
    text: str


@dataclass(frozen=True, slots=True)
class Tick:
    """A gridline of the cost chart and its cost label."""

    y: str
    label_y: str
    label: str


@dataclass(frozen=True, slots=True)
class Segment:
    """One tenant's cost on one day: a piece of that day's bar."""

    tenant_id: str  # or "other": the tenants beyond the stacked ones
    day: str
    cost: str  # as the report writes it
    x: str
    y: str
    width: str
    height: str
    fill: str
    title: str


@dataclass(frozen=True, slots=True)
class DayBar:
    day: str
    title: str
    segments: tuple[Segment, ...]  # bottom up


@dataclass(frozen=True, slots=True)
class DaySlot:
    """A day of the period: its bar (None without usage) and its date under the axis (None between labelled days)."""

    bar: DayBar | None
    label: AxisLabel | None


@dataclass(frozen=True, slots=True)
class LegendItem:
    tenant_id: str
    name: str
    colour: str


@dataclass(frozen=True, slots=True)
class CostPlot:
    x1: int  # the plot's left and right edges, where gridlines and the axis run
    x2: int
    tick_x: int  # where the cost labels end
    base_y: int
    ticks: tuple[Tick, ...]
    days: tuple[DaySlot, ...]
    legend: tuple[LegendItem, ...]


@dataclass(frozen=True, slots=True)
class CostChart:
    """The cost per day: a plot, or (exactly one of the two) a message when nothing was priced."""

    frame: Frame
    plot: CostPlot | None
    no_data: NoData | None


@dataclass(frozen=True, slots=True)
class Bar:
    """A row of a horizontal bar chart: the whole label (it wraps, never cut), the bar, the value."""

    row_id: str  # its `data-id`: a tenant or endpoint id
    value: str  # as shown, and its `data-value`
    title: str  # the tooltip: label, value and detail
    label: str
    length: str  # percent of the track (0 to 100, .2f)


@dataclass(frozen=True, slots=True)
class BarTick:
    """A label of a bar chart's axis, at `x` percent of the track, anchored so that the end ones stay inside it."""

    x: str
    anchor: str  # SVG text-anchor: start, middle or end
    text: str


@dataclass(frozen=True, slots=True)
class BarPlot:
    colour: str
    bars: tuple[Bar, ...]
    axis: tuple[BarTick, ...]
    more: str | None  # how many rows were left out, when any were


@dataclass(frozen=True, slots=True)
class BarChart:
    """A horizontal bar chart, laid out as HTML rows (so labels wrap): a plot, or (exactly one of the two) a message
    when it has no rows. `chart` is its `data-chart` and prefixes the ids of its title and description."""

    chart: str
    title: str
    desc: str
    plot: BarPlot | None
    no_data: str | None


@dataclass(frozen=True, slots=True)
class TenantRow:
    """A row of the tenants' table; the last is the totals."""

    name: str
    requests: str
    input_tokens: str
    cached_input_tokens: str
    output_tokens: str  # reasoning tokens included
    reasoning_tokens: str
    cache_hit_rate: str
    cost: str
    cache_savings: str
    total: bool


@dataclass(frozen=True, slots=True)
class BillingPage:
    """The whole page, as templates/billing_page.html lays it out."""

    period: str
    cards: tuple[Card, ...]
    empty_message: str | None  # said when the period has no usage
    cost_per_day: CostChart
    hit_rates: BarChart
    endpoints: BarChart
    max_endpoints: int
    tenants: tuple[TenantRow, ...]  # empty (no table) when the period has no usage
    currency: str
    generated: str
