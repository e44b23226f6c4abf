"""What the platform in front of an engine costs per request, and where it goes (issue 20, point 7).

A `loraplex engine serve` of the demo model (with the reasoning settings the platform registers it with) is measured
straight, and through the platform in front of an engine, in three setups:

- `embedded`, as `loraplex dev` runs: SQLite, the in-process key-value store, and the platform's own in-process
  engine on the same model (so the platform and its engine share one process and its interpreter lock);
- `services`, as a deployment runs (deploy/k8s, compose.yaml): Postgres and Redis at --database-url / --redis-url
  (the schema in a database of its own), the platform in fleet mode, and the engine it routes to is the very
  `loraplex engine serve` process measured straight, registered in the platform's Redis. The two paths then
  differ by the control plane alone, down to the engine's state;
- `services_split`, the same with the engine's process on half the cores and the platform's process and the clients
  on the others, as when the platform runs on machines of its own (which a deployment does).

Two measurements:

- latency: a client alternates one-token chat completions (greedy, non-streamed) between them: through the platform
  with a tenant key, and straight to the engine. Reported: p50 / p90 of each and the difference; and, from timers
  wrapped around the platform's steps of the same requests (authenticating the key, resolving the model, reading
  the tenant's terms, routing, the rate limit, the concurrency lease, the engine call, the usage write, and the whole
  request inside the platform's app), where the added time goes;
- throughput at saturation: --clients keep-alive clients send the same request back to back (http_load.py), for
  --seconds at a time, alternating platform and engine --rounds times, for two workloads: `one_token` (the
  latency phase's request: requests/s, where the platform's work per request weighs most) and `chat` (a streamed
  chat completion of up to CHAT_TOKENS tokens, its usage in the last event: completion tokens/s, the unit a
  serving stack is sized in). Reported: each path's rate and their ratio (platform / engine).

All of it runs on this machine. Except in `services_split`, the clients, the platform and the engine take CPU from one
another; so each saturation window also records the CPU time each process took per request (or per 1,000 tokens):
what the platform costs wherever it runs.

    .venv/bin/python benchmarks/platform_overhead.py [--requests 150]
        [--setup embedded|services|services_split|both|all]
        [--clients 16] [--seconds 6] [--rounds 2] [--workloads one_token,chat]

writes benchmarks/results/platform_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import uvicorn
from http_load import saturate  # siblings: benchmarks/ is on sys.path when a script in it runs
from serve_launch import free_port, launched_engine, machine

from loraplex.platform.domain.fleet.embedded import DEMO_REASONING_CONFIG

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "platform_overhead.json"
DEMO = REPO / "demo" / "model"
MESSAGES = [{"role": "user", "content": 'Tell me about the "for" statement.'}]
# The platform registers the demo model as a reasoning model and sends every chat request to it with a thinking
# budget: the engine measured directly reasons by the same settings.
REASONING = DEMO_REASONING_CONFIG
ENGINE_ARGS = [
    *("--dtype", "float32", "--reasoning-parser", REASONING.parser),
    *("--reasoning-budgets", ",".join(f"{tier}={budget}" for tier, budget in REASONING.budgets.items())),
    *("--default-reasoning-effort", REASONING.default_effort),
]
BODY = {"model": "loraplex-demo", "messages": MESSAGES, "max_completion_tokens": 1, "temperature": 0}
CHAT_TOKENS = 64
# What the saturation phase sends: the rate it is measured by.
WORKLOADS: dict[str, tuple[dict[str, Any], str]] = {
    "one_token": (BODY, "requests_per_s"),
    "chat": (
        BODY | {"max_completion_tokens": CHAT_TOKENS, "stream": True, "stream_options": {"include_usage": True}},
        "tokens_per_s",
    ),
}
DEMO_NAME = "loraplex-demo"
SPLIT = "services_split"
SETUPS = ("embedded", "services", SPLIT)
# The platform's steps, as named in its completions controller module, each timed per request; and three spans
# around them (nested: complete > admit_completion > _prepare, complete > _answer > collect), which say what the
# steps leave out: `complete` is the whole handler, so in_app less complete is the web framework's part (routing,
# the key's dependency, the body's validation, the response).
STEPS = ("resolve", "tenant_terms", "route", "engine_body", "collect", "record_usage_soon")
SPANS = ("complete", "admit_completion", "_prepare", "_answer")
# The whole of a completion inside the platform's app (from the ASGI call to the end of the response).
IN_APP = "in_app"


def timed_steps(spans: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap the platform's per-request steps with timers; returns the undo."""
    from loraplex.platform.domain.completions import controllers

    originals: dict[str, Any] = {}

    def wrap(name: str, target: Any) -> Any:
        if asyncio.iscoroutinefunction(target):

            @functools.wraps(target)
            async def async_timed(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await target(*args, **kwargs)
                finally:
                    spans[name].append(time.perf_counter() - started)

            return async_timed

        @functools.wraps(target)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                spans[name].append(time.perf_counter() - started)

        return timed

    for name in (*STEPS, *SPANS):
        originals[name] = getattr(controllers, name)
        setattr(controllers, name, wrap(name, originals[name]))
    # The rate limiter and the lease table are objects of the app's resources: wrapped once the app exists.

    def undo() -> None:
        for name, original in originals.items():
            setattr(controllers, name, original)

    return undo


def wrap_resources(resources: Any, spans: dict[str, list[float]]) -> None:
    for owner, attribute, name in (
        (resources.authenticator, "tenant", "authenticate"),
        (resources.admitter, "admit", "admission"),
        (resources.rate_limiter, "acquire", "rate_limit"),
        (resources.leases, "acquire", "lease"),
        (resources.leases, "release", "lease_release"),
    ):
        original = getattr(owner, attribute)

        async def timed(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await _original(*args, **kwargs)
            finally:
                spans[_name].append(time.perf_counter() - started)

        setattr(owner, attribute, timed)


def timed_app(app: Any, spans: dict[str, list[float]]) -> Any:
    """`app` with each completion's time inside it recorded (IN_APP)."""

    async def timed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        try:
            await app(scope, receive, send)
        finally:
            spans[IN_APP].append(time.perf_counter() - started)

    return timed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Load:
    """The saturation phase: `clients` closed-loop clients, `rounds` x (platform, engine) windows of `seconds`, for
    each of `workloads` (WORKLOADS' names)."""

    clients: int
    seconds: float
    rounds: int
    workloads: tuple[str, ...] = tuple(WORKLOADS)


def run_setup(setup: str, requests: int, load: Load, database_url: str | None, redis_url: str | None) -> dict[str, Any]:
    """Serve the platform in a child process (uvicorn in its main thread, as `loraplex dev` runs it; a server in a
    thread of the measuring process added tens of ms of wake-up latency), with its steps timed; measure; collect."""
    data_dir = Path(tempfile.mkdtemp(prefix="overhead-"))
    admin = secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_ADMIN_TOKEN": admin, "LORAPLEX_ENGINE_DTYPE": "float32"}
    database: str | None = None
    engine_args = list(ENGINE_ARGS)
    engine_auth: dict[str, str] = {}
    all_cores = os.sched_getaffinity(0)
    engine_cores, platform_cores = all_cores, all_cores
    if setup == SPLIT:  # the engine's threads on cores of their own, as on a machine of its own
        ordered = sorted(all_cores)
        if len(ordered) < 2:
            raise SystemExit(f"the {SPLIT} setup needs two cores or more")
        platform_cores, engine_cores = set(ordered[: len(ordered) // 2]), set(ordered[len(ordered) // 2 :])
        engine_args += ["--num-threads", str(len(engine_cores))]
    if setup != "embedded":
        assert database_url is not None
        assert redis_url is not None
        database = f"overhead_{secrets.token_hex(4)}"
        asyncio.run(_database(database_url, f'CREATE DATABASE "{database}"'))
        engine_key, prefix = secrets.token_urlsafe(24), f"overhead-{database}:"
        env |= {
            "LORAPLEX_DATABASE_URL": database_url.rsplit("/", 1)[0] + f"/{database}",
            "LORAPLEX_REDIS_URL": redis_url,
            "LORAPLEX_REDIS_PREFIX": prefix,
            "LORAPLEX_SECRET_KEY": secrets.token_urlsafe(32),
            "LORAPLEX_ENGINE_MODE": "fleet",
            "LORAPLEX_ENGINE_API_KEY": engine_key,
        }
        # The engine registers itself in the platform's Redis, where the platform's router finds it.
        engine_args += ["--redis-url", redis_url, "--redis-prefix", prefix, "--base-model-name", DEMO_NAME]
        engine_args += ["--api-key", engine_key]
        engine_auth = {"Authorization": f"Bearer {engine_key}"}
    port = free_port()
    spans_file = data_dir / "spans.json"
    command = [sys.executable, __file__, "--child", str(port), str(spans_file)]
    os.sched_setaffinity(0, platform_cores)  # the platform's process and this one's clients: inherited, kept
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        platform_url = f"http://127.0.0.1:{port}"
        _wait_healthy(platform_url, child)
        key = _tenant_key(platform_url, admin, load.clients)
        if setup != "embedded":  # the base model the engine announces: registered as embedded mode registers it
            _base_model(platform_url, admin)
        # The same model as the platform's engine serves, in float32 as it does, reasoning as the platform
        # registers it (the platform sends every chat request to it with a thinking budget).
        with contextlib.ExitStack() as stack:
            os.sched_setaffinity(0, engine_cores)  # inherited by the engine's process and every thread of it
            try:
                engine_url = stack.enter_context(
                    launched_engine(DEMO, served_model_name=DEMO_NAME, engine_args=engine_args)
                )
            finally:
                os.sched_setaffinity(0, platform_cores)
            if setup != "embedded":
                _wait_routed(platform_url, key)
            paths = _paths(platform_url, engine_url, key, engine_auth)
            figures = measure(paths, requests)
            child.send_signal(signal.SIGUSR1)  # the child writes the latency phase's spans
            _wait_for_file(spans_file)
            processes = {"platform": psutil.Process(child.pid), "engine": _server_process(engine_url)}
            figures["saturation"] = {
                workload: asyncio.run(throughput(paths, processes, workload, load)) for workload in load.workloads
            }
    finally:
        os.sched_setaffinity(0, all_cores)
        child.send_signal(signal.SIGINT)
        child.wait(60)
        if database is not None:
            assert database_url is not None
            asyncio.run(_database(database_url, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
    spans: dict[str, list[float]] = json.loads(spans_file.read_text())
    # The measured requests are the last `requests` platform ones: skip the warm-up's.
    figures["steps_p50_ms"] = {
        name: percentile([v * 1000 for v in values[-requests:]], 0.5) for name, values in spans.items()
    }
    in_app = spans.get(IN_APP, [])
    # One of each per request, in order: the platform's own share of each request, and the web framework's.
    for key, inner in (("platform_work_p50_ms", "collect"), ("framework_p50_ms", "complete")):
        if len(inner_spans := spans.get(inner, [])) == len(in_app):
            pairs = zip(in_app[-requests:], inner_spans[-requests:], strict=True)
            figures[key] = percentile([(a - c) * 1000 for a, c in pairs], 0.5)
    return figures


def child(port: int, spans_file: Path) -> None:
    """The platform as `loraplex dev` serves it (migrated first), its steps timed; the timings so far are written
    on SIGUSR1."""
    from loraplex.platform.app import create_app
    from loraplex.platform.db.engine import create_engine
    from loraplex.platform.db.migrate import upgrade
    from loraplex.platform.settings import load_settings

    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    async def migrate() -> None:
        engine = create_engine(settings.effective_database_url)
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()

    asyncio.run(migrate())
    spans: dict[str, list[float]] = defaultdict(list)
    timed_steps(spans)
    from loraplex.platform.domain.completions import controllers

    timed_resolve = controllers.resolve
    wrapped: list[Any] = []

    async def resolve(resources: Any, *args: Any) -> Any:
        if not wrapped:  # the app's resources exist once it serves: their limiter and leases are timed from here
            wrap_resources(resources, spans)
            wrapped.append(resources)
        return await timed_resolve(resources, *args)

    controllers.resolve = resolve  # type: ignore[assignment]
    signal.signal(signal.SIGUSR1, lambda *_: spans_file.write_text(json.dumps(spans)))
    uvicorn.run(timed_app(create_app(settings), spans), host="127.0.0.1", port=port, log_level="warning")


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not start")
        time.sleep(0.2)


def _wait_for_file(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} was not written")
        time.sleep(0.05)


async def _database(url: str, statement: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


def _tenant_key(platform_url: str, admin: str, clients: int) -> str:
    """A tenant's API key, the tenant's limits high enough that saturation measures the servers, not the limits."""
    headers = {"Authorization": f"Bearer {admin}"}
    limits = {
        "requests_per_minute": 10**9,
        "tokens_per_minute": 10**9,  # the columns are 32-bit integers
        "max_concurrent_requests": max(64, 2 * clients),
    }
    with httpx.Client(timeout=60) as client:
        made = client.post(
            f"{platform_url}/admin/tenants", headers=headers, json={"name": "overhead", "limits": limits}
        )
        made.raise_for_status()
        key = client.post(f"{platform_url}/admin/tenants/{made.json()['id']}/api-keys", headers=headers, json={})
        key.raise_for_status()
        value: str = key.json()["key"]
        return value


def _base_model(platform_url: str, admin: str) -> None:
    body = {"name": DEMO_NAME, "source": str(DEMO), "reasoning_config": REASONING.to_dict()}
    response = httpx.post(f"{platform_url}/admin/base-models", headers={"Authorization": f"Bearer {admin}"}, json=body)
    response.raise_for_status()


def _wait_routed(platform_url: str, key: str, timeout_s: float = 60.0) -> None:
    """Until the platform routes a completion to the engine (its registry entry read from Redis)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.post(
            f"{platform_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=BODY, timeout=60
        )
        if response.status_code == 200:
            return
        if response.status_code != 503 or time.monotonic() > deadline:
            raise RuntimeError(f"the platform did not route to the engine: {response.status_code} {response.text}")
        time.sleep(0.5)


Paths = dict[str, tuple[str, dict[str, str]]]


def _paths(platform_url: str, engine_url: str, key: str, engine_auth: dict[str, str]) -> Paths:
    return {
        "platform": (f"{platform_url}/v1/chat/completions", {"Authorization": f"Bearer {key}"}),
        "engine": (f"{engine_url}/v1/chat/completions", engine_auth),
    }


def measure(paths: Paths, requests: int) -> dict[str, Any]:
    client = httpx.Client(timeout=60)
    for url, auth in paths.values():  # warm-up: the first requests compile, connect and fill caches
        for _ in range(5):
            client.post(url, headers=auth, json=BODY).raise_for_status()
    latencies: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(2 * requests):
        name = ("platform", "engine")[i % 2]
        url, auth = paths[name]
        started = time.perf_counter()
        response = client.post(url, headers=auth, json=BODY)
        latencies[name].append(time.perf_counter() - started)
        response.raise_for_status()
    time.sleep(0.5)  # the last usage write is in flight
    ms = {name: [v * 1000 for v in values] for name, values in latencies.items()}
    result: dict[str, Any] = {
        name: {"p50_ms": percentile(values, 0.5), "p90_ms": percentile(values, 0.9), "mean_ms": statistics.mean(values)}
        for name, values in ms.items()
    }
    result["added_p50_ms"] = result["platform"]["p50_ms"] - result["engine"]["p50_ms"]
    result["requests"] = requests
    return result


def _server_process(url: str) -> psutil.Process:
    """The process listening on `url`'s port (a launched `loraplex engine serve`)."""
    port = urlsplit(url).port
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "serve" in cmdline and "--port" in cmdline and str(port) in cmdline:
            return process
    raise RuntimeError(f"no process serves {url}")


def _cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    """Each process's CPU time so far (user + system, all its threads), and this one's: the load's clients."""
    times = {name: sum(process.cpu_times()[:2]) for name, process in processes.items()}
    return times | {"clients": time.process_time()}


def _mark(marks: list[dict[str, float]], processes: dict[str, psutil.Process]) -> None:
    marks.append(_cpu_seconds(processes))


async def throughput(paths: Paths, processes: dict[str, psutil.Process], workload: str, load: Load) -> dict[str, Any]:
    """`workload`'s rate at saturation through each path, the paths taking turns (so that whatever else the machine
    does weighs on both alike), and the ratio of the totals; with the CPU time the platform's process, the engine's
    and the clients took per unit of each path (ms per request, or per thousand tokens): what the platform costs
    wherever it runs, where the ratio is what it costs on these cores, which the three share."""
    body, unit = WORKLOADS[workload]
    rounds: list[dict[str, Any]] = []
    for _ in range(load.rounds):
        measured = {}
        for name, (url, auth) in paths.items():
            marks: list[dict[str, float]] = []
            result = await saturate(
                url,
                body,
                auth,
                clients=load.clients,
                seconds=load.seconds,
                at_window=functools.partial(_mark, marks, processes),
            )
            before, after = marks
            measured[name] = result.as_dict() | {"cpu_s": {k: after[k] - before[k] for k in after}}
        rounds.append(measured)
    counted = "completion_tokens" if unit == "tokens_per_s" else "num_ok"
    totals = {name: sum(r[name][counted] for r in rounds) / sum(r[name]["seconds"] for r in rounds) for name in paths}
    # CPU per unit: each process's CPU time in the measured windows over what they completed.
    scale = 1e3 if unit == "requests_per_s" else 1e6  # ms per request; ms per thousand tokens
    cpu_ms = {
        name: {
            process: scale
            * sum(r[name]["cpu_s"][process] for r in rounds)
            / max(1, sum(r[name][counted] for r in rounds))
            for process in (*processes, "clients")
        }
        for name in paths
    }
    return {
        "clients": load.clients,
        "seconds_per_window": load.seconds,
        "unit": unit,
        "platform": totals["platform"],
        "engine": totals["engine"],
        "ratio": totals["platform"] / totals["engine"] if totals["engine"] else 0.0,
        "cpu_ms_per_unit": cpu_ms,
        "num_failed": sum(r[name]["num_failed"] for r in rounds for name in paths),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150, help="requests each way (alternating)")
    parser.add_argument(
        "--setup",
        choices=[*SETUPS, "both", "all"],
        default="embedded",
        help=f"both: embedded and services; all: those and {SPLIT}",
    )
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients at saturation")
    parser.add_argument("--seconds", type=float, default=6.0, help="each saturation window")
    parser.add_argument("--rounds", type=int, default=2, help="saturation windows each way (alternating)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"saturation workloads of {list(WORKLOADS)}")
    parser.add_argument("--database-url", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--child", nargs=2, metavar=("PORT", "SPANS_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), Path(args.child[1]))
        return
    setups = {"both": ["embedded", "services"], "all": list(SETUPS)}.get(args.setup, [args.setup])
    workloads = tuple(w for w in args.workloads.split(",") if w)
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")
    load = Load(clients=args.clients, seconds=args.seconds, rounds=args.rounds, workloads=workloads)
    out: dict[str, Any] = {
        # The servers run torch's default threads: one per core.
        "machine": machine(os.cpu_count() or 1),
        "setups": {},
    }
    for setup in setups:
        figures = run_setup(setup, args.requests, load, args.database_url, args.redis_url)
        out["setups"][setup] = figures
        through, direct = figures["platform"]["p50_ms"], figures["engine"]["p50_ms"]
        added = figures["added_p50_ms"]
        print(f"{setup}: platform p50 {through:.2f} ms, engine p50 {direct:.2f} ms, added {added:.2f} ms")
        for step, value in sorted(figures["steps_p50_ms"].items(), key=lambda item: -item[1]):
            print(f"  {step:>18}: {value:.3f} ms (p50)")
        if "platform_work_p50_ms" in figures:
            own = figures["platform_work_p50_ms"]
            print(f"  the platform's own work in its app (in_app - collect): {own:.3f} ms (p50)")
        if "framework_p50_ms" in figures:
            print(f"  of which the web framework's (in_app - complete): {figures['framework_p50_ms']:.3f} ms (p50)")
        for workload, rate in figures["saturation"].items():
            unit = "tok/s" if rate["unit"] == "tokens_per_s" else "req/s"
            print(
                f"  saturation, {workload} ({rate['clients']} clients): platform {rate['platform']:.1f} {unit}, "
                f"engine {rate['engine']:.1f} {unit}, ratio {rate['ratio']:.3f}"
            )
            per = "request" if rate["unit"] == "requests_per_s" else "1000 tokens"
            for path, cpu in rate["cpu_ms_per_unit"].items():
                shares = ", ".join(f"{process} {value:.2f}" for process, value in cpu.items())
                print(f"    CPU ms per {per}, {path} path: {shares}")
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
