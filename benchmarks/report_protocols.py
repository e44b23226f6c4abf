"""docs/benchmarks.md's section on what the agent protocols add on the engine server over chat completions of the
same request (benchmarks/protocol_overhead.py)."""

from __future__ import annotations

from typing import Any

from report_data import Results, ms, table, writes
from report_plots import Plots

MODE_WORDS = {"whole": "non-streamed, 1 token", "streamed": "streamed, {tokens} tokens"}
PROTOCOL_WORDS = {"responses": "OpenAI's Responses (/v1/responses)", "messages": "Anthropic's Messages (/v1/messages)"}


def mode_words(mode: str, figures: dict[str, Any]) -> str:
    return MODE_WORDS.get(mode, mode).format(tokens=figures["tokens"])


def added(value: float) -> str:
    return f"{value:+.3f} ms"


def protocol_overhead(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    rows = []
    for mode, figures in doc["modes"].items():
        for protocol in PROTOCOL_WORDS:
            if protocol in figures:
                rows.append(
                    [
                        PROTOCOL_WORDS[protocol],
                        mode_words(mode, figures),
                        f"{ms(figures['chat']['p50_ms'])} / {ms(figures['chat']['p90_ms'])}",
                        f"{ms(figures[protocol]['p50_ms'])} / {ms(figures[protocol]['p90_ms'])}",
                        f"**{added(figures['added_p50_ms'][protocol])}**",
                    ]
                )
    lines = [
        "The same conversation sent to `loraplex engine serve` (the demo model, greedy) as a chat completion and in"
        f" each protocol, alternating, {doc['requests']} requests of each per mode on one keep-alive connection: the"
        " engine runs the same tokens, so the difference is the protocol's conversion and writing. Added: the median"
        " over rounds of the protocol's latency less chat's in the same round (goal: at most 0.3 ms).",
        "",
    ]
    lines += table(["protocol", "request", "chat p50 / p90", "protocol p50 / p90", "added (median)"], rows)
    return [*lines, "", writes("protocol_overhead") + "."]
