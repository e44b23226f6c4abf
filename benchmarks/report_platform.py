"""docs/benchmarks.md's section on what the platform adds in front of an engine (benchmarks/platform_overhead.py):
latency per request and where it goes, throughput at saturation for each workload, and the CPU each process took
per unit of work."""

from __future__ import annotations

from typing import Any

from report_data import Results, ms, num, table, writes
from report_plots import Plots

# The platform's timed steps, as a user would name them, in a request's order; a step not named here shows under its
# own name, after them.
PLATFORM_STEPS = {
    "authenticate": "key check",
    "resolve": "model lookup",
    "tenant_terms": "tenant's terms",
    "engine_body": "request body",
    "route": "routing",
    "admission": "admission (rate limits and lease, one round trip)",
    "rate_limit": "rate limit",
    "lease": "concurrency lease",
    "_collect": "engine call",
    "record_usage_soon": "usage record",
    "lease_release": "lease release (after the answer is sent)",
}
PLATFORM_WHOLE = "in_app"  # the whole request inside the platform's app: not a step
# Spans around the steps (the handler; lookups, routing and admission; the answer): not steps either.
PLATFORM_SPANS = ("complete", "_start", "_prepare", "_answer")
# Steps that run after the answer has gone out: not on the request's path.
AFTER_ANSWER = ("lease_release",)
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
    own_work = all("platform_work_p50_ms" in setup for setup in setups.values())
    framework = all("framework_p50_ms" in setup for setup in setups.values())
    rows = []
    for name, setup in setups.items():
        row = [setup_words(name), ms(setup["platform"]["p50_ms"]), ms(setup["engine"]["p50_ms"])]
        row.append(f"**{ms(setup['added_p50_ms'])}**")
        if own_work:
            row.append(ms(setup["platform_work_p50_ms"]))
        if framework:
            row.append(ms(setup["framework_p50_ms"]))
        rows.append(row)
    requests = next(iter(setups.values()))["requests"]
    lines = [
        f"One-token chat completions of the demo model, {requests} each way, alternating between the platform (a"
        " tenant's key) and a `loraplex engine serve` of the same model. Embedded, the platform runs its own engine"
        " in its process, as `loraplex dev` does; with services it routes to that very engine process, registered in"
        " its Redis, as a deployment does. The platform's steps are timed inside it.",
        "",
    ]
    header = ["setup", "platform p50", "engine p50", "added"]
    header += ["platform's own work p50 (in its app, less the engine call)"] if own_work else []
    header += ["of which the web framework's (routing, the key, the body, the response)"] if framework else []
    lines += table(header, rows)
    # Where the time goes, in one line: each setup's largest step of its own (the engine call aside); every step's
    # time is in the results file.
    largest = []
    for name, setup in setups.items():
        left_out = (PLATFORM_WHOLE, "_collect", *PLATFORM_SPANS, *AFTER_ANSWER)
        own = {k: v for k, v in setup["steps_p50_ms"].items() if k not in left_out}
        if own:
            step = max(own, key=lambda k: own[k])
            largest.append(f"{PLATFORM_STEPS.get(step, step)}, {own[step]:.2f} ms p50 ({setup_words(name)})")
    if largest:
        lines += ["", "Its largest step of its own on the request's path: " + "; ".join(largest) + "."]
    saturated = [(name, setup["saturation"]) for name, setup in setups.items() if setup.get("saturation")]
    if saturated:
        clients = next(iter(saturated[0][1].values()))["clients"]
        lines += [
            "",
            f"**Throughput at saturation**: {clients} clients send the same request back to back, through the platform"
            " and straight to the engine in turns: one-token requests (requests/s), and streamed chats of up to 64"
            " tokens (completion tokens/s). The clients, the platform and the engine share this machine's cores (but"
            " in the last setup, where the engine has a core of its own), so the CPU the platform takes comes out of"
            " the engine's; the CPU columns say what each took per request or per 1,000 tokens, which is what the"
            " platform costs wherever it runs.",
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
