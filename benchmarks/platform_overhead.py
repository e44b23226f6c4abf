"""What the platform in front of an engine costs per request, and where it goes (issue 20, point 7).

One process serves the platform (embedded mode: its in-process engine on the demo model), a second one `loraplex
engine serve` of the same model with the same reasoning settings as the platform registers it with, so both paths
reach the same kind of engine doing the same work and differ only by the control plane. Two measurements:

- latency: a client alternates one-token chat completions (greedy, non-streamed) between them: through the platform
  with a tenant key, and straight to the engine. Reported: p50 / p90 of each and the difference; and, from timers
  wrapped around the platform's steps of the same requests (authenticating the key, resolving the model, reading
  the tenant's terms, routing, the rate limit, the concurrency lease, the engine call, the usage write, and the whole
  request inside the platform's app), where the added time goes;
- throughput at saturation: --clients keep-alive clients send the same request back to back (http_load.py), for
  --seconds at a time, alternating platform and engine --rounds times; reported: completed requests per second of
  each and their ratio (platform / engine).

Two setups: `embedded` (SQLite and the in-process key-value store, as `loraplex dev` runs) and `services` (Postgres
and Redis at --database-url / --redis-url, as a deployment runs; the schema is created in a database of its own).

    .venv/bin/python benchmarks/platform_overhead.py [--requests 150] [--setup embedded|services|both]
        [--clients 16] [--seconds 6] [--rounds 2]

writes benchmarks/results/platform_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform as host
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

import httpx
import uvicorn
from http_load import saturate  # siblings: benchmarks/ is on sys.path when a script in it runs
from serve_launch import free_port, launched_engine

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
# The platform's steps, as named in its completions controller module, each timed per request.
STEPS = ("resolve", "tenant_terms", "route", "engine_body", "_collect", "record_usage_soon")
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

    for name in STEPS:
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
    """The saturation phase: `clients` closed-loop clients, `rounds` x (platform, engine) windows of `seconds`."""

    clients: int
    seconds: float
    rounds: int


def run_setup(setup: str, requests: int, load: Load, database_url: str | None, redis_url: str | None) -> dict[str, Any]:
    """Serve the platform in a child process (uvicorn in its main thread, as `loraplex dev` runs it; a server in a
    thread of the measuring process added tens of ms of wake-up latency), with its steps timed; measure; collect."""
    data_dir = Path(tempfile.mkdtemp(prefix="overhead-"))
    admin = secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_ADMIN_TOKEN": admin, "LORAPLEX_ENGINE_DTYPE": "float32"}
    database: str | None = None
    if setup == "services":
        assert database_url is not None
        assert redis_url is not None
        database = f"overhead_{secrets.token_hex(4)}"
        asyncio.run(_database(database_url, f'CREATE DATABASE "{database}"'))
        env |= {
            "LORAPLEX_DATABASE_URL": database_url.rsplit("/", 1)[0] + f"/{database}",
            "LORAPLEX_REDIS_URL": redis_url,
            "LORAPLEX_REDIS_PREFIX": f"overhead-{database}:",
            "LORAPLEX_SECRET_KEY": secrets.token_urlsafe(32),
        }
    port = free_port()
    spans_file = data_dir / "spans.json"
    command = [sys.executable, __file__, "--child", str(port), str(spans_file)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        platform_url = f"http://127.0.0.1:{port}"
        _wait_healthy(platform_url, child)
        key = _tenant_key(platform_url, admin, load.clients)
        # The same model as the platform's embedded engine serves, in float32 as it does, reasoning as the platform
        # registers it (the platform sends every chat request to it with a thinking budget).
        with launched_engine(DEMO, served_model_name="loraplex-demo", engine_args=ENGINE_ARGS) as engine_url:
            figures = measure(platform_url, engine_url, key, requests)
            child.send_signal(signal.SIGUSR1)  # the child writes the latency phase's spans
            _wait_for_file(spans_file)
            figures["throughput"] = asyncio.run(throughput(platform_url, engine_url, key, load))
    finally:
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
    in_app, engine_call = spans.get(IN_APP, []), spans.get("_collect", [])
    if len(in_app) == len(engine_call):  # one of each per request, in order: the platform's own share of each
        own = [(a - c) * 1000 for a, c in zip(in_app[-requests:], engine_call[-requests:], strict=True)]
        figures["platform_work_p50_ms"] = percentile(own, 0.5)
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


def _paths(platform_url: str, engine_url: str, key: str) -> dict[str, tuple[str, dict[str, str]]]:
    return {
        "platform": (f"{platform_url}/v1/chat/completions", {"Authorization": f"Bearer {key}"}),
        "engine": (f"{engine_url}/v1/chat/completions", {}),
    }


def measure(platform_url: str, engine_url: str, key: str, requests: int) -> dict[str, Any]:
    client = httpx.Client(timeout=60)
    paths = _paths(platform_url, engine_url, key)
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


async def throughput(platform_url: str, engine_url: str, key: str, load: Load) -> dict[str, Any]:
    """Requests per second at saturation through each path, the paths taking turns (so that whatever else the
    machine does weighs on both alike), and the ratio of the totals."""
    paths = _paths(platform_url, engine_url, key)
    rounds: list[dict[str, Any]] = []
    for _ in range(load.rounds):
        measured = {}
        for name, (url, auth) in paths.items():
            result = await saturate(url, BODY, auth, clients=load.clients, seconds=load.seconds)
            measured[name] = result.as_dict()
        rounds.append(measured)
    totals = {name: sum(r[name]["num_ok"] for r in rounds) / sum(r[name]["seconds"] for r in rounds) for name in paths}
    return {
        "clients": load.clients,
        "seconds_per_window": load.seconds,
        "platform_requests_per_s": totals["platform"],
        "engine_requests_per_s": totals["engine"],
        "ratio": totals["platform"] / totals["engine"] if totals["engine"] else 0.0,
        "num_failed": sum(r[name]["num_failed"] for r in rounds for name in paths),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150, help="requests each way (alternating)")
    parser.add_argument("--setup", choices=["embedded", "services", "both"], default="embedded")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients at saturation")
    parser.add_argument("--seconds", type=float, default=6.0, help="each saturation window")
    parser.add_argument("--rounds", type=int, default=2, help="saturation windows each way (alternating)")
    parser.add_argument("--database-url", default="postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--child", nargs=2, metavar=("PORT", "SPANS_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), Path(args.child[1]))
        return
    setups = ["embedded", "services"] if args.setup == "both" else [args.setup]
    load = Load(clients=args.clients, seconds=args.seconds, rounds=args.rounds)
    out: dict[str, Any] = {
        "machine": {"cpu": host.processor() or host.machine(), "cores": os.cpu_count()},
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
            print(f"  the platform's own work in its app (in_app - _collect): {own:.3f} ms (p50)")
        rate = figures["throughput"]
        print(
            f"  saturation ({rate['clients']} clients): platform {rate['platform_requests_per_s']:.1f} req/s, "
            f"engine {rate['engine_requests_per_s']:.1f} req/s, ratio {rate['ratio']:.3f}"
        )
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
