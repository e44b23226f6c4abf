"""What the fleet-mode completion tests share: `loraplex engine serve` processes registered in the platform's Redis,
the platform app on uvicorn, and a tenant with a key, an uploaded PEFT adapter and an endpoint over it."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from _support import services
from _support.adapters import make_peft_adapter
from _support.services import PostgresServer, RedisServer, S3Server
from _support.waiting import poll
from litestar import Litestar
from pydantic import SecretStr

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from loraplex.platform.app import create_app
from loraplex.platform.domain.fleet.registry import Router
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, bearer, module_settings_sync, serving

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# The engines' --api-key (from LORAPLEX_ENGINE_API_KEY, as compose.yaml gives it), which the platform sends.
ENGINE_KEY = "engine-key-for-fleet-tests-0123"
ENGINE_AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}


@contextlib.contextmanager
def fleet_settings(
    data_dir: Path, postgres: PostgresServer, redis: RedisServer, s3: S3Server, session_tag: str
) -> Iterator[Settings]:
    """Fleet-mode settings on a database, Redis prefix and bucket of their own (removed after), with the engines'
    API key, and rate limits and concurrency caps out of the way (test_ratelimit.py's and test_concurrency.py's)."""
    with module_settings_sync(
        data_dir,
        postgres,
        redis,
        s3,
        session_tag,
        engine_mode="fleet",
        engine_api_key=ENGINE_KEY,
        default_requests_per_minute=100_000,
        default_max_concurrent_requests=1000,
    ) as value:
        yield value


def free_ports(count: int) -> list[int]:
    # Below 55535 and clear of +10000: SeaweedFS servers other sessions start take such pairs.
    return services.free_port_pairs(count)


@dataclass
class ServerProcess:
    """A `loraplex` server of the test's own (an engine, or a platform replica) and its log."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, so no withdrawal from the registry; its key expires on its own."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def serving_process(command: list[str], env: dict[str, str], url: str, log: Path, what: str) -> Iterator[ServerProcess]:
    """`command` as a server process logging to `log`, once /healthz at `url` answers; stopped (SIGTERM, then
    SIGKILL) on exit."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    running = ServerProcess(process, url, log)
    try:
        started = poll(lambda: process.poll() is not None or healthy(url), 90, interval_s=0.2)
        assert started and process.poll() is None, f"the {what} did not start:\n{running.log_tail()}"
        yield running
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def engine_process(
    settings: Settings,
    checkpoint: Path,
    s3_server: S3Server,
    log_dir: Path,
    *,
    engine_id: str,
    base_model: str,
    extra: Sequence[str] = (),
) -> Iterator[ServerProcess]:
    """`loraplex engine serve` as its own process, registered in the platform's Redis under `engine_id`, reading
    adapters from the platform's bucket; stopped (SIGTERM, then SIGKILL) on exit."""
    assert settings.redis_url is not None and settings.s3_endpoint_url is not None
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"{engine_id}.log"
    command = [
        str(Path(sys.executable).with_name("loraplex")),
        "engine", "serve", "--model", str(checkpoint), "--port", str(port), "--device", "cpu",
        "--num-threads", "1", "--kv-budget", "16MiB", "--redis-url", settings.redis_url,
        "--redis-prefix", settings.redis_prefix, "--engine-id", engine_id, "--public-url", url,
        "--base-model-name", base_model, "--adapter-root", f"s3://{settings.s3_bucket}/tenants/",
        "--s3-endpoint-url", settings.s3_endpoint_url, *extra,
    ]  # fmt: skip
    # The engine reads S3 with boto3's default credential chain.
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_access_key,
        "AWS_DEFAULT_REGION": s3_server.region,
        "LORAPLEX_ENGINE_API_KEY": ENGINE_KEY,
    }
    with serving_process(command, env, url, log, "engine") as running:
        yield running


@dataclass
class Platform:
    url: str
    app: Litestar

    @property
    def router(self) -> Router:
        router: Router = self.app.state.resources.router
        return router

    def get(self, path: str, headers: dict[str, str]) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=30)

    def post(self, path: str, headers: dict[str, str], **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", headers=headers, timeout=60, **kwargs)

    def engines(self) -> dict[str, dict[str, Any]]:
        """GET /admin/engines, by replica id."""
        response = self.get("/admin/engines", ADMIN)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list"
        return {replica["id"]: replica for replica in body["data"]}


@contextlib.contextmanager
def platform_app(settings: Settings, checkpoint: Path, base_model: str) -> Iterator[Platform]:
    """The platform app on uvicorn (lifespan included) in a thread with its own event loop; `base_model` registered
    with `checkpoint` as its source."""
    (port,) = free_ports(1)
    app = create_app(settings)
    with serving(app, port=port, start_timeout_s=60) as url:
        value = Platform(url, app)
        response = value.post("/admin/base-models", ADMIN, json={"name": base_model, "source": str(checkpoint)})
        assert response.status_code == 201, response.text
        yield value


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str
    adapter_id: str
    digest: str

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.key)

    def openai(self, platform: Platform) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{platform.url}/v1", api_key=self.key, max_retries=0, timeout=60)

    def source(self, bucket: str | None) -> str:
        """Where the platform stored the adapter: the s3:// folder of its two files."""
        return f"s3://{bucket}/tenants/{self.id}/adapters/{self.adapter_id}"


def keyed_tenant(platform: Platform, prefix: str) -> tuple[str, str]:
    """A new tenant, named `prefix`-<random>, and an API key of it: (tenant id, key)."""
    response = platform.post("/admin/tenants", ADMIN, json={"name": f"{prefix}-{secrets.token_hex(3)}"})
    assert response.status_code == 201, response.text
    tenant_id = response.json()["id"]
    response = platform.post(f"/admin/tenants/{tenant_id}/api-keys", ADMIN, json={"name": "k"})
    assert response.status_code == 201, response.text
    return tenant_id, response.json()["key"]


def make_tenant(platform: Platform, checkpoint: Path, folder: Path, *, base_model: str, endpoint: str) -> Tenant:
    """A tenant with a key, a random PEFT adapter uploaded through the API, and `endpoint` over it."""
    tenant_id, key = keyed_tenant(platform, "fleet")

    adapter_dir = make_peft_adapter(
        checkpoint, folder / "adapter", seed=1, r=8, lora_alpha=16, target_modules="all-linear"
    )
    files = {name: (name, (adapter_dir / name).read_bytes()) for name in (CONFIG_FILE, WEIGHTS_FILE)}
    response = platform.post(
        "/v1/adapters", bearer(key), data={"name": "support-adapter", "base_model": base_model}, files=files
    )
    assert response.status_code == 201, response.text
    adapter = response.json()
    assert adapter["status"] == "ready"
    response = platform.post(
        "/v1/endpoints", bearer(key), json={"name": endpoint, "base_model": base_model, "adapter_id": adapter["id"]}
    )
    assert response.status_code == 201, response.text
    return Tenant(tenant_id, key, adapter["id"], adapter["digest"])


def settings_environment(settings: Settings, **overrides: Any) -> dict[str, str]:
    """`settings` (and `overrides`) as the LORAPLEX_* environment a `loraplex` process reads them from."""
    env: dict[str, str] = {}
    for name in Settings.model_fields:
        value = overrides.get(name, getattr(settings, name))
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, list | dict):
            value = json.dumps(value)
        env[f"LORAPLEX_{name.upper()}"] = str(value)
    return env


@contextlib.contextmanager
def platform_process(settings: Settings, log_dir: Path, name: str, **overrides: Any) -> Iterator[ServerProcess]:
    """`loraplex platform serve` as its own process (another replica on the same database, Redis and bucket),
    with `overrides` of `settings`; stopped (SIGTERM, then SIGKILL) on exit."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"{name}.log"
    env = {key: value for key, value in os.environ.items() if not key.startswith("LORAPLEX_")} | settings_environment(
        settings, host="127.0.0.1", port=port, **overrides
    )
    command = [str(Path(sys.executable).with_name("loraplex")), "platform", "serve"]
    with serving_process(command, env, url, log, "platform") as running:
        yield running
