"""What benchmarks/serve.py measures per request, and the summary of a run: throughput, goodput under an SLO, and
the mean, p50, p90 and p99 of each latency."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

from rich.console import Group
from rich.table import Table

PERCENTILES = (50, 90, 99)
MAX_ERRORS_SHOWN = 5  # distinct error messages in the printed summary, the most frequent first


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds; `*_s` offsets are from the run's start. A request is ok
    when the server answered 200 and its stream ended without an error event."""

    conversation: int
    turn: int
    model: str  # the model asked for
    scheduled_s: float  # when it was due (open loop: the trace's arrival; closed loop and later turns: when ready)
    sent_s: float
    ok: bool = False
    status: int | None = None  # HTTP status; None when no response came (connection refused, timeout)
    error: str | None = None
    served_model: str | None = None  # the `model` the response's chunks name
    ttft_s: float | None = None  # until the first chunk that carries text
    e2e_s: float | None = None  # until the stream ended
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between successive text-bearing chunks
    prompt_tokens: int | None = None  # from the closing usage chunk
    output_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1); None with fewer than 2."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


@dataclasses.dataclass(frozen=True, slots=True)
class LatencyStats:
    """Milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats | None:
        if not seconds:
            return None
        ms = [s * 1000 for s in seconds]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(len(ms), sum(ms) / len(ms), p50, p90, p99)


@dataclasses.dataclass(frozen=True, slots=True)
class Slo:
    """A request meets the SLO when its TTFT and its TPOT are within the bounds given (None: unbounded); a request of
    one output token has no TPOT and meets that bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    num_ok: int
    num_errors: int
    num_unsent: int  # later turns of conversations cut short by an error
    duration_s: float
    requests_per_s: float  # ok requests
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt and output
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cached_share: float | None  # cached / prompt tokens
    slo: Slo
    num_good: int | None  # ok requests within the SLO; None without one
    goodput_per_s: float | None
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None  # over every gap of every ok request
    e2e: LatencyStats | None
    errors: dict[str, int]  # "status: message" -> count


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo, num_unsent: int = 0) -> Summary:
    """The run's figures over `duration_s` (from its start to its last answer); latencies count ok requests only."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    num_good = sum(slo.met_by(r) for r in ok) if slo.given else None
    errors = Counter(f"{r.status if r.status is not None else 'no response'}: {r.error}" for r in records if not r.ok)
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        num_unsent=num_unsent,
        duration_s=duration_s,
        requests_per_s=len(ok) * per_s,
        output_tokens_per_s=output * per_s,
        total_tokens_per_s=(prompt + output) * per_s,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=cached,
        cached_share=cached / prompt if prompt else None,
        slo=slo,
        num_good=num_good,
        goodput_per_s=None if num_good is None else num_good * per_s,
        ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        errors=dict(errors.most_common()),
    )


def summary_table(summary: Summary) -> Group:
    """The summary as two tables for a terminal: the run's totals, then the latencies."""
    totals = Table(show_header=False, box=None, padding=(0, 2))
    totals.add_column(style="bold")
    totals.add_column()
    s = summary
    unsent = f", {s.num_unsent} not sent" if s.num_unsent else ""
    totals.add_row("requests", f"{s.num_ok} ok, {s.num_errors} errors{unsent}")
    totals.add_row("duration", f"{s.duration_s:.2f} s")
    tokens_per_s = f"{s.output_tokens_per_s:.1f} output tok/s, {s.total_tokens_per_s:.1f} total tok/s"
    totals.add_row("throughput", f"{s.requests_per_s:.2f} req/s, {tokens_per_s}")
    if s.num_good is not None and s.goodput_per_s is not None:
        bounds = [f"TTFT {s.slo.ttft_ms:g} ms"] if s.slo.ttft_ms is not None else []
        bounds += [f"TPOT {s.slo.tpot_ms:g} ms"] if s.slo.tpot_ms is not None else []
        share = s.num_good / s.num_requests if s.num_requests else 0.0
        totals.add_row("goodput", f"{s.goodput_per_s:.2f} req/s ({share:.0%}) within {', '.join(bounds)}")
    else:
        totals.add_row("goodput", "no SLO given (--slo-ttft-ms, --slo-tpot-ms)")
    totals.add_row("tokens", f"{s.prompt_tokens} prompt, {s.output_tokens} output")
    cached = f"{s.cached_share:.1%}" if s.cached_share is not None else "-"
    totals.add_row("cached", f"{s.cached_tokens} prompt tokens ({cached})")
    for message, count in list(s.errors.items())[:MAX_ERRORS_SHOWN]:
        totals.add_row("error", f"{count} x {message[:100]}")
    if len(s.errors) > MAX_ERRORS_SHOWN:
        totals.add_row("", f"and {len(s.errors) - MAX_ERRORS_SHOWN} other messages (all in the result file)")

    latencies = Table(title="latency (ms)", title_justify="left")
    for column in ("", "n", "mean", "p50", "p90", "p99"):
        latencies.add_column(column, justify="right" if column else "left")
    for name, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        if stats is None:
            latencies.add_row(name, "0", "-", "-", "-", "-")
        else:
            values = (stats.mean, stats.p50, stats.p90, stats.p99)
            latencies.add_row(name, str(stats.count), *(f"{v:.1f}" for v in values))
    return Group(totals, latencies)
