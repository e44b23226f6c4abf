"""docs/benchmarks.md's section on what the platform adds in front of an engine (benchmarks/platform_overhead.py):
latency per request and where it goes, throughput at saturation for each workload, and the CPU each process took
per unit of work."""

from __future__ import annotations

from typing import Any

from report_data import Results, ms, num, table, writes
from report_plots import Plots

SETUP_WORDS = {
    "embedded": "embedded (SQLite, in-process store and engine)",
    "services": "services (Postgres, Redis, the engine in its own process)",
    "services_split": "services, the engine on a core of its own",
}
WORKLOAD_WORDS = {"one_token": "one-token requests", "chat": "streamed chats"}


def setup_words(name: str) -> str:
    return SETUP_WORDS.get(name, name)


def unit_words(saturation: dict[str, Any]) -> tuple[str, str]:
    """(the rate's unit, the unit CPU is counted per)."""
    if saturation["unit"] == "tokens_per_s":
        return "tok/s", "1,000 tokens"
    return "req/s", "request"


def platform_cpu(setup: str, saturation: dict[str, Any]) -> str:
    """The platform's own CPU per unit: its process's, where the engine has a process of its own; embedded, its
    process's (which runs the engine too) less what the engine's process took per unit straight, which can come out
    below zero when the two are within the noise of each other."""
    cpu = saturation["cpu_ms_per_unit"]
    own: float = cpu["platform"]["platform"]
    if setup == "embedded":
        own -= cpu["engine"]["engine"]
    per = unit_words(saturation)[1]
    return f"{ms(own)} per {per}" if own > 0 else "within the noise"


def platform_overhead(doc: dict[str, Any], results: Results, plots: Plots) -> list[str]:
    setups = doc["setups"]
    rows = []
    for name, setup in setups.items():
        row = [setup_words(name), ms(setup["platform"]["p50_ms"]), ms(setup["engine"]["p50_ms"])]
        row += [f"**{ms(setup['added_p50_ms'])}**", ms(setup.get("platform_work_p50_ms"))]
        row += [ms(setup.get("framework_p50_ms")), ms(setup["steps_p50_ms"].get("admission"))]
        rows.append(row)
    requests = next(iter(setups.values()))["requests"]
    lines = [
        f"One-token chat completions of the demo model, {requests} each way, alternating between the platform (a"
        " tenant's key) and a `loraplex engine serve` of the same model. Embedded, the platform runs its own engine"
        " in its process, as `loraplex dev` does; with services it routes to that very engine process, registered in"
        " its Redis, as a deployment does. Timed inside the platform (every step's time is in the results file):",
        "",
    ]
    header = ["setup", "platform p50", "engine p50", "added", "platform's own work (in its app, less the engine call)"]
    header += ["of which the web framework (routing, the key, the body, the response)", "and the admission"]
    lines += table(header, rows)
    saturated = [(name, setup["saturation"]) for name, setup in setups.items() if setup.get("saturation")]
    if saturated:
        clients = next(iter(saturated[0][1].values()))["clients"]
        lines += [
            "",
            f"**Throughput at saturation**: {clients} clients send one-token requests, or streamed chats of up to 64"
            " tokens, back to back through the platform and straight to the engine in turns. Except in the last setup,"
            " the engine shares this machine's cores with the platform; the CPU columns say what each process took"
            " per unit: the platform's cost wherever it runs.",
            "",
        ]
        sat_rows = []
        for name, by_workload in saturated:
            for workload, t in by_workload.items():
                rate, _ = unit_words(t)
                cpu = t["cpu_ms_per_unit"]
                # Embedded, the engine runs in the platform's process: its share there is not told apart.
                via = cpu["platform"]["engine"] if name != "embedded" else None
                sat_rows.append(
                    [
                        setup_words(name),
                        WORKLOAD_WORDS.get(workload, workload),
                        f"{num(t['platform'])} / {num(t['engine'])} {rate}",
                        f"**{t['ratio']:.2f}**",
                        platform_cpu(name, t),
                        f"{ms(cpu['engine']['engine'])} / {ms(via)}",
                        str(t.get("num_failed", 0)),
                    ]
                )
        header = ["setup", "workload", "platform / engine", "ratio", "platform's CPU", "engine's CPU, straight / via"]
        lines += table([*header, "failed"], sat_rows)
    return [*lines, "", writes("platform_overhead") + "."]
