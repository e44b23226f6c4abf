"""Completions in fleet mode, end to end: the platform (uvicorn, `engine_mode="fleet"`) finds engines in the Redis
registry and streams from them over HTTP; the engine is its own `loraplex engine serve` process reading adapters from
S3 under its --adapter-root. Real Postgres, Redis and SeaweedFS; the `openai` package is the client.

One engine process, one platform server and one tenant (with an endpoint over a real PEFT adapter) serve the whole
module. The tests run in file order and share that state; the last one kills the engine, so it stays last.

A second replica, where one is needed, is a stub engine in this process: it records what the platform sent it and
answers one canned chunk, and the test writes its registry entry (as engine/serve/registration.py would) until its
heartbeat is meant to stop. The router's balancing rules are also checked on their own, over a fixed list of replicas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis
from _support.services import PostgresServer, RedisServer, S3Server
from _support.waiting import poll
from openai.types.chat import ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from loraplex.platform.domain.fleet.client import (
    EngineClient,
    EngineRequestError,
    InProcessEngineClient,
    retry_after_seconds,
)
from loraplex.platform.domain.fleet.registry import AFFINITY_KEY, BALANCE_SLACK, RECENT_S, Replica, Router
from loraplex.platform.kv import RedisStore
from loraplex.platform.settings import Settings

from .conftest import bearer
from .fleet_setup import (
    ADMIN,
    ENGINE_AUTH,
    Platform,
    ServerProcess,
    Tenant,
    engine_process,
    fleet_settings,
    free_ports,
    keyed_tenant,
    make_tenant,
    platform_app,
)

pytestmark = pytest.mark.integration

BASE = "tiny-fleet-base"  # the platform's name of the base model, and the engine's --base-model-name
ENDPOINT = "support-bot"
ENGINE_ID = "engine-1"
MAX_MODEL_LEN = 1024  # the tiny checkpoint's max_position_embeddings
PROMPT = "Write a long story about a lighthouse keeper and the ships that pass by at night."
MAX_TOKENS = 12
HEARTBEAT_TTL_MS = 5000  # the engine's registry key lives this long after its last beat
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
PLATFORM_METRICS = "loraplex_platform"


# --- module fixtures: services, engine process, platform server, tenant -----------------------------------------


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> Iterator[Settings]:
    with fleet_settings(
        tmp_path_factory.mktemp("data"), postgres_server, redis_server, s3_server, session_tag
    ) as value:
        yield value


@pytest.fixture(scope="module")
def engine(
    settings: Settings, tiny_base_checkpoint: Path, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """`loraplex engine serve` as its own process, registered in the platform's Redis under ENGINE_ID."""
    with engine_process(
        settings,
        tiny_base_checkpoint,
        s3_server,
        tmp_path_factory.mktemp("engine"),
        engine_id=ENGINE_ID,
        base_model=BASE,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def platform(settings: Settings, tiny_base_checkpoint: Path) -> Iterator[Platform]:
    with platform_app(settings, tiny_base_checkpoint, BASE) as value:
        yield value


@pytest.fixture(scope="module")
def tenant(platform: Platform, tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    """A tenant with a key, a random PEFT adapter uploaded through the API, and ENDPOINT over it."""
    return make_tenant(
        platform, tiny_base_checkpoint, tmp_path_factory.mktemp("adapter"), base_model=BASE, endpoint=ENDPOINT
    )


# --- helpers ----------------------------------------------------------------------------------------------------


def _engine_chat(engine: ServerProcess, lora_adapter: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    """A chat completion straight from the engine, as the platform would ask for it (greedy, MAX_TOKENS)."""
    request: dict[str, Any] = {
        "model": BASE,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **body,
    }
    if lora_adapter is not None:
        request["lora_adapter"] = lora_adapter
    response = httpx.post(f"{engine.url}/v1/chat/completions", json=request, headers=ENGINE_AUTH, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _lora_adapter(tenant: Tenant, settings: Settings) -> dict[str, str]:
    return {"name": "support-adapter@v1", "source": tenant.source(settings.s3_bucket), "digest": tenant.digest}


def _chat_text(tenant: Tenant, platform: Platform, model: str = ENDPOINT, **extra: Any) -> str:
    answer = tenant.openai(platform).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **extra
    )
    assert answer.model == model
    return answer.choices[0].message.content or ""


def _envelope(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def _num_tokens(chunks: list[ChatCompletionChunk]) -> int:
    """Tokens in these chunks, counted from their logprobs (one entry per token)."""
    return sum(len(choice.logprobs.content or []) for c in chunks for choice in c.choices if choice.logprobs)


def _long_stream(tenant: Tenant, platform: Platform) -> openai.Stream[ChatCompletionChunk]:
    """A greedy stream that runs to its max_tokens (this adapter's text for PROMPT has no EOS in it)."""
    return tenant.openai(platform).chat.completions.create(
        model=ENDPOINT,
        messages=MESSAGES,
        max_tokens=MAX_MODEL_LEN - 200,
        temperature=0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )


def _usage_row(platform: Platform, tenant: Tenant, request_id: str) -> dict[str, Any] | None:
    response = platform.get("/v1/usage", tenant.headers)
    assert response.status_code == 200, response.text
    return next((row for row in response.json()["data"] if row["request_id"] == request_id), None)


# --- completions through the platform ---------------------------------------------------------------------------


def test_chat_through_the_platform_runs_the_endpoints_adapter_on_the_engine(
    settings: Settings, engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    client = tenant.openai(platform)
    direct = _engine_chat(engine, _lora_adapter(tenant, settings))
    base = _engine_chat(engine)
    expected = direct["choices"][0]["message"]["content"]
    assert expected != base["choices"][0]["message"]["content"], "the adapter must change this prompt's greedy text"

    raw = client.chat.completions.with_raw_response.create(
        model=ENDPOINT, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert raw.status_code == 200
    answer = raw.parse()
    assert answer.id.startswith("chatcmpl-") and answer.id != direct["id"]
    assert answer.model == ENDPOINT
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == direct["choices"][0]["finish_reason"]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 0
    assert answer.usage.completion_tokens == direct["usage"]["completion_tokens"] > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens is not None

    raw_stream = client.chat.completions.with_raw_response.create(
        model=ENDPOINT,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw_stream.status_code == 200
    assert raw_stream.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw_stream.parse())
    *content, last = chunks
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {chunk.model for chunk in chunks} == {ENDPOINT}
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected
    assert all(chunk.usage is None for chunk in content)  # running usage is the platform's, not the client's
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        answer.usage.prompt_tokens,
        answer.usage.completion_tokens,
    )
    assert last.usage.prompt_tokens_details is not None
    cached = last.usage.prompt_tokens_details.cached_tokens
    # The same prompt on the same adapter again: its full KV blocks come from the prefix cache, and say so.
    assert cached is not None and 0 < cached < last.usage.prompt_tokens


def _cached_tokens(key: str, platform: Platform) -> int:
    answer = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0).chat.completions.create(
        model=BASE, messages=MESSAGES, max_tokens=2, temperature=0
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached


def test_the_prefix_cache_is_shared_within_a_tenant_only(
    engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    _, other_key = keyed_tenant(platform, "other")

    _cached_tokens(tenant.key, platform)
    assert _cached_tokens(tenant.key, platform) > 0
    assert _cached_tokens(other_key, platform) == 0  # the same tokens, another tenant: nothing to see
    assert _cached_tokens(other_key, platform) > 0


def test_the_engine_answers_only_callers_with_its_key(
    engine: ServerProcess, tenant: Tenant, settings: Settings
) -> None:
    """Anyone who reaches the engine's port could otherwise make it read adapters under its root or load its own:
    without the shared key every /v1 route is a 401, while the platform (which sends it) is served."""
    body = {"model": BASE, "messages": MESSAGES, "max_tokens": 1, "lora_adapter": _lora_adapter(tenant, settings)}
    for path, payload in (
        ("/v1/chat/completions", body),
        ("/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "/tmp"}),
        ("/v1/unload_lora_adapter", {"lora_name": "mine"}),
    ):
        response = httpx.post(f"{engine.url}{path}", json=payload, headers=tenant.headers, timeout=30)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{engine.url}/healthz", timeout=10).status_code == 200


def test_a_tenant_cannot_name_adapter_files_itself(platform: Platform, tenant: Tenant) -> None:
    body = {
        "model": BASE,
        "messages": MESSAGES,
        "max_tokens": 2,
        "lora_adapter": {"name": "x", "source": "s3://anything/else", "digest": tenant.digest},
    }
    response = platform.post("/v1/chat/completions", tenant.headers, json=body)
    assert response.status_code == 400
    error = _envelope(response)
    assert error["type"] == "invalid_request_error"
    assert "lora_adapter" in f"{error['param']} {error['message']}"


def test_legacy_completions_run_the_adapter_too(
    settings: Settings, engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    request = {"model": BASE, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    direct = httpx.post(
        f"{engine.url}/v1/completions",
        json={**request, "lora_adapter": _lora_adapter(tenant, settings)},
        headers=ENGINE_AUTH,
        timeout=60,
    )
    assert direct.status_code == 200, direct.text
    answer = tenant.openai(platform).completions.create(
        model=ENDPOINT, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.object == "text_completion" and answer.model == ENDPOINT
    assert answer.choices[0].text == direct.json()["choices"][0]["text"]
    assert answer.usage is not None and answer.usage.completion_tokens == direct.json()["usage"]["completion_tokens"]


def test_the_engine_refuses_a_source_outside_its_adapter_root(
    settings: Settings, engine: ServerProcess, tenant: Tenant
) -> None:
    for source in (
        f"s3://{settings.s3_bucket}/elsewhere/{tenant.adapter_id}",
        f"s3://{settings.s3_bucket}/tenants-x/{tenant.id}/adapters/{tenant.adapter_id}",
        f"s3://other-{settings.s3_bucket}/tenants/{tenant.id}/adapters/{tenant.adapter_id}",
    ):
        spec = {**_lora_adapter(tenant, settings), "source": source}
        body = {"model": BASE, "messages": MESSAGES, "max_tokens": 2, "lora_adapter": spec}
        response = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=ENGINE_AUTH, timeout=30)
        assert response.status_code == 400, (source, response.text)
        assert _envelope(response)["code"] == "lora_adapter_source_not_allowed"


# --- the fleet as the admin sees it ------------------------------------------------------------------------------


def test_admin_engines_lists_the_replica_with_its_adapters_and_load(
    engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    _chat_text(tenant, platform)  # the adapter is resident on the engine from here on

    def listed_idle_with_adapter() -> dict[str, Any] | None:  # a beat taken while the request ran shows it running
        replica = platform.engines().get(ENGINE_ID)
        idle = replica is not None and replica["adapters"] == [tenant.digest] and replica["num_running"] == 0
        return replica if idle else None

    # Checked on the one record that showed it idle: each read may be another beat.
    replica = poll(listed_idle_with_adapter, 5)
    assert replica is not None, f"adapter not listed: {platform.engines()}"
    assert (replica["url"], replica["base_model"]) == (engine.url, BASE)
    assert 0 < replica["free_pages"] <= replica["num_pages"]
    assert 0 <= replica["evictable_pages"] <= replica["num_pages"]
    assert (replica["num_waiting"], replica["num_running"]) == (0, 0)
    assert replica["max_model_len"] == MAX_MODEL_LEN
    assert abs(replica["updated_at"] - time.time()) < 5

    refused = platform.get("/admin/engines", tenant.headers)  # a tenant key is not an admin token
    assert refused.status_code == 401
    assert refused.json()["code"] == "unauthenticated"  # /admin answers in problem+json


# --- routing between replicas ------------------------------------------------------------------------------------


STUB_TEXT = "stub-engine-reply"


def _stub_events(*, cut_off: bool = False) -> bytes:
    """What the stub answers: STUB_TEXT in one chunk, the finish and usage chunks, [DONE]; or (`cut_off`) only the
    first chunk, as a body that ends where a crashed or restarted proxy cut it."""
    usage = {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    head = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": BASE}
    events = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": STUB_TEXT}}], "usage": usage},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage},
        {**head, "choices": [], "usage": usage},
    ]
    if cut_off:
        return f"data: {json.dumps(events[0])}\n\n".encode()
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@dataclass
class StubEngine:
    """A replica that answers every completion with STUB_TEXT and records the request bodies it got."""

    url: str
    # "engine-0-..." sorts before ENGINE_ID: of two equally loaded replicas the router takes the stub. Each stub has
    # its own id, as the router remembers what it sent to which replica id.
    id: str = field(default_factory=lambda: f"engine-0-{secrets.token_hex(3)}")
    base_model: str = BASE
    received: list[dict[str, Any]] = field(default_factory=list)
    answer: bytes = field(default_factory=_stub_events)
    release: threading.Event = field(default_factory=threading.Event)  # answers wait for it (set: at once)
    # Once the first event is sent, the rest waits for this (set: at once): a stream held open midway.
    midway: threading.Event = field(default_factory=threading.Event)
    # Set: every request is refused as the engine refuses one its full waiting queue cannot take (503 overloaded,
    # with this Retry-After, before any byte of a stream).
    overloaded_retry_after: str | None = None

    def record(self, adapters: list[str]) -> dict[str, Any]:
        """Its registry entry: idle and empty, so that only residency or affinity can beat it."""
        return {
            "id": self.id,
            "url": self.url,
            "base_model": self.base_model,
            "adapters": adapters,
            "free_pages": 1000,
            "evictable_pages": 0,
            "num_pages": 1000,
            "num_waiting": 0,
            "num_running": 0,
            "max_model_len": MAX_MODEL_LEN,
            "updated_at": time.time(),
        }


@contextlib.contextmanager
def serving_stub(**fields: Any) -> Iterator[StubEngine]:
    """A StubEngine (with these fields) answering on a port of its own until the block ends."""
    (port,) = free_ports(1)
    stub = StubEngine(f"http://127.0.0.1:{port}", **fields)
    stub.release.set()
    stub.midway.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            if self.path == "/v1/kv/blocks":  # a peer pulling a prefix it expects here: this stub has no KV
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            stub.received.append(json.loads(body))
            stub.release.wait(60)
            if stub.overloaded_retry_after is not None:
                self._refuse_overloaded(stub.overloaded_retry_after)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            first, separator, rest = stub.answer.partition(b"\n\n")
            self.wfile.write(first + separator)
            stub.midway.wait(60)
            self.wfile.write(rest)

        def _refuse_overloaded(self, retry_after: str) -> None:
            error = {"message": "The queue is full.", "type": "server_error", "param": None, "code": "overloaded"}
            raw = json.dumps({"error": error}).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.send_header("Retry-After", retry_after)
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:  # http.server's signature
            return None

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # the listen backlog: a burst of connections must not be dropped
        daemon_threads = True

    server = Server(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, name="stub-engine", daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        stub.release.set()
        stub.midway.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def stub_engine() -> Iterator[StubEngine]:
    with serving_stub() as stub:
        yield stub


class Heartbeat:
    """Writes one replica's registry entry every second with engine/serve/registration.py's keys and expiry."""

    def __init__(self, redis_url: str, prefix: str, record: Callable[[], dict[str, Any]]) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._prefix = prefix
        self.record = record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stub-heartbeat", daemon=True)

    def beat(self) -> None:
        record = self.record()
        pipe = self._client.pipeline(transaction=False)
        pipe.set(f"{self._prefix}fleet:engine:{record['id']}", json.dumps(record), px=HEARTBEAT_TTL_MS)
        pipe.sadd(f"{self._prefix}fleet:engines", record["id"])
        pipe.execute()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.beat()

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """The replica goes silent (as a crashed one would): no withdrawal, its key expires on its own."""
        self._stop.set()
        self._thread.join(5)

    def withdraw(self) -> None:
        record = self.record()
        self._client.delete(f"{self._prefix}fleet:engine:{record['id']}")
        self._client.srem(f"{self._prefix}fleet:engines", record["id"])

    def members(self) -> set[str]:
        return {m.decode() for m in self._client.smembers(f"{self._prefix}fleet:engines")}

    def close(self) -> None:
        """Stop and withdraw, so that a failed test leaves no entry behind for the next one to trip over."""
        self.stop()
        self.withdraw()
        self._client.close()


def test_router_prefers_the_resident_adapter_and_drops_a_silent_replica(
    settings: Settings,
    engine: ServerProcess,
    platform: Platform,
    tenant: Tenant,
    stub_engine: StubEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="loraplex.platform.domain.fleet.registry")  # each choice, if it fails
    assert settings.redis_url is not None
    expected = _engine_chat(engine, _lora_adapter(tenant, settings))["choices"][0]["message"]["content"]
    base_text = _engine_chat(engine)["choices"][0]["message"]["content"]
    assert _chat_text(tenant, platform) == expected  # one replica: the adapter becomes resident on it

    def idle_with_adapter() -> bool:  # loads decide only between replicas within BALANCE_SLACK: start from idle
        replica = platform.engines()[ENGINE_ID]
        return replica["adapters"] == [tenant.digest] and (replica["num_waiting"], replica["num_running"]) == (0, 0)

    assert poll(idle_with_adapter, 30), platform.engines()
    assert poll(lambda: not platform.router.recent_picks(), RECENT_S + 2)  # it has forgotten its own recent picks

    stub_adapters: list[str] = []
    heartbeat = Heartbeat(settings.redis_url, settings.redis_prefix, lambda: stub_engine.record(stub_adapters))
    heartbeat.start()
    try:
        assert poll(lambda: set(platform.engines()) == {ENGINE_ID, stub_engine.id}, 3)
        cache_key = f"k-{secrets.token_hex(4)}"

        # No adapter and no warm replica: the idle stub wins on load (its id breaks the tie), and this prompt cache
        # key is warm on the stub from now on.
        assert _chat_text(tenant, platform, BASE, prompt_cache_key=cache_key) == STUB_TEXT
        assert len(stub_engine.received) == 1
        assert "lora_adapter" not in stub_engine.received[0]

        # The adapter is resident only on the engine: that beats the stub's warm cache key and its lower load.
        assert _chat_text(tenant, platform, prompt_cache_key=cache_key) == expected
        assert len(stub_engine.received) == 1

        # Resident on both: the replica the key last went to wins (the engine, although the stub sorts first), and a
        # new key goes to the stub, which is sent the adapter by its S3 folder and digest, never a tenant's path.
        stub_adapters.append(tenant.digest)
        heartbeat.beat()
        assert poll(
            lambda: all(replica["adapters"] == [tenant.digest] for replica in platform.engines().values()), timeout_s=3
        ), platform.engines()
        assert _chat_text(tenant, platform, prompt_cache_key=cache_key) == expected, platform.engines()
        assert len(stub_engine.received) == 1
        cache_key = f"k-{secrets.token_hex(4)}"
        assert _chat_text(tenant, platform, prompt_cache_key=cache_key) == STUB_TEXT
        sent = stub_engine.received[-1]
        assert sent["model"] == BASE and sent["stream"] is True
        assert sent["lora_adapter"] == {
            "name": "support-adapter@v1",
            "source": f"s3://{settings.s3_bucket}/tenants/{tenant.id}/adapters/{tenant.adapter_id}",
            "digest": tenant.digest,
        }
        assert (sent["max_tokens"], sent["temperature"]) == (MAX_TOKENS, 0)
        assert "prompt_cache_key" not in sent and "user" not in sent
        # The tenant's cache salt: a keyed derivation of its id (64 hex digits), never the id itself.
        assert len(sent["cache_salt"]) == 64 and str(tenant.id) not in sent["cache_salt"]
        assert all(request["cache_salt"] == sent["cache_salt"] for request in stub_engine.received)

        # The stub's heartbeat stops: within the key's life it leaves the list and the routing, and the engine
        # serves what would have gone to it.
        heartbeat.stop()
        silent_since = time.monotonic()
        assert poll(lambda: set(platform.engines()) == {ENGINE_ID}, HEARTBEAT_TTL_MS / 1000 + 3)
        assert time.monotonic() - silent_since > HEARTBEAT_TTL_MS / 1000 - 2  # it was listed while its key lived
        assert heartbeat.members() == {ENGINE_ID}  # the reader removed the expired member
        num_received = len(stub_engine.received)
        assert _chat_text(tenant, platform, prompt_cache_key=cache_key) == expected
        assert _chat_text(tenant, platform, BASE, prompt_cache_key=cache_key) == base_text
        assert len(stub_engine.received) == num_received
    finally:
        heartbeat.close()


def test_a_stream_the_engine_cuts_off_ends_with_an_error_and_is_billed_as_one(
    settings: Settings, engine: ServerProcess, platform: Platform, tenant: Tenant, stub_engine: StubEngine
) -> None:
    assert settings.redis_url is not None and engine.process.poll() is None
    stub_engine.answer = _stub_events(cut_off=True)
    heartbeat = Heartbeat(settings.redis_url, settings.redis_prefix, lambda: stub_engine.record([]))
    heartbeat.start()  # idle and sorting first: a new cache key's base-model requests go to the stub
    try:
        assert poll(lambda: set(platform.engines()) == {ENGINE_ID, stub_engine.id}, 3)
        stream = tenant.openai(platform).chat.completions.create(
            model=BASE, messages=MESSAGES, stream=True, prompt_cache_key=f"k-{secrets.token_hex(4)}"
        )
        chunks: list[ChatCompletionChunk] = []
        with pytest.raises(openai.APIError) as info:
            chunks.extend(stream)
        assert len(stub_engine.received) == 1
        assert "unavailable" in info.value.message
        assert [c.choices[0].delta.content for c in chunks] == [STUB_TEXT]

        assert poll(lambda: _usage_row(platform, tenant, chunks[0].id) is not None, 5)
        row = _usage_row(platform, tenant, chunks[0].id)
        assert row is not None and (row["status"], row["completion_tokens"]) == ("error", 1)
    finally:
        heartbeat.close()


def test_an_engine_gets_more_concurrent_requests_than_an_http_pool_default(
    settings: Settings, tiny_base_checkpoint: Path, platform: Platform, tenant: Tenant, stub_engine: StubEngine
) -> None:
    """The engine does the queueing (and tells the router about it): the platform must not hold requests back."""
    assert settings.redis_url is not None
    num_requests = 110  # httpx's default pool takes 100 connections per client
    response = platform.post(
        "/admin/base-models", ADMIN, json={"name": "stub-base", "source": str(tiny_base_checkpoint)}
    )
    assert response.status_code == 201, response.text
    stub_engine.base_model = "stub-base"
    stub_engine.release.clear()  # the stub holds every request until all have arrived
    heartbeat = Heartbeat(settings.redis_url, settings.redis_prefix, lambda: stub_engine.record([]))
    heartbeat.start()

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=platform.url, headers=tenant.headers, timeout=60, limits=limits) as http:
            body = {"model": "stub-base", "messages": MESSAGES, "max_tokens": 2}
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(num_requests)))

    try:
        assert poll(lambda: stub_engine.id in platform.engines(), 3)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answers = pool.submit(asyncio.run, burst())
            poll(lambda: len(stub_engine.received) == num_requests, 30)
            num_arrived = len(stub_engine.received)
            stub_engine.release.set()
            responses = answers.result(timeout=60)
        assert num_arrived == num_requests, f"only {num_arrived} of {num_requests} requests reached the engine at once"
        assert [r.status_code for r in responses] == [200] * num_requests
        assert {r.json()["choices"][0]["message"]["content"] for r in responses} == {STUB_TEXT}
    finally:
        heartbeat.close()


def test_a_replica_that_refuses_connections_is_routed_around(
    settings: Settings, engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    """A crashed engine's key outlives it by up to its TTL: the request it refuses goes to the next replica, and
    later ones skip it."""
    assert settings.redis_url is not None
    (closed_port,) = free_ports(1)  # nothing listens there
    ghost = StubEngine(f"http://127.0.0.1:{closed_port}")
    expected = _engine_chat(engine, _lora_adapter(tenant, settings))["choices"][0]["message"]["content"]
    heartbeat = Heartbeat(settings.redis_url, settings.redis_prefix, lambda: ghost.record([tenant.digest]))
    heartbeat.start()  # still beating, adapter resident, idle, sorting first: the router's first choice
    try:
        assert poll(lambda: set(platform.engines()) == {ENGINE_ID, ghost.id}, 3)
        cache_key = f"k-{secrets.token_hex(4)}"  # warm nowhere yet
        assert _chat_text(tenant, platform, prompt_cache_key=cache_key) == expected  # the ghost refused it first
        for _ in range(2):  # the key is warm on the ghost now, and the ghost is still its best choice otherwise
            assert _chat_text(tenant, platform, prompt_cache_key=cache_key) == expected
        assert ghost.id in platform.engines()  # still registered (its key lives): only the routing avoids it

        # A streamed request is retried the same way, before its first byte: a second ghost, first choice again.
        second = StubEngine(f"http://127.0.0.1:{free_ports(1)[0]}")
        second_beat = Heartbeat(settings.redis_url, settings.redis_prefix, lambda: second.record([tenant.digest]))
        second_beat.start()
        try:
            assert poll(lambda: second.id in platform.engines(), 3)
            chunks = tenant.openai(platform).chat.completions.create(
                model=ENDPOINT,
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                prompt_cache_key=f"k-{secrets.token_hex(4)}",
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == expected
        finally:
            second_beat.close()
    finally:
        heartbeat.close()


def test_a_request_no_replica_accepts_is_a_503(
    settings: Settings, tiny_base_checkpoint: Path, platform: Platform, tenant: Tenant
) -> None:
    """Every replica of the base model refuses the connection: after trying each once, 503 engine_unavailable."""
    assert settings.redis_url is not None
    name = f"ghost-base-{secrets.token_hex(3)}"
    response = platform.post("/admin/base-models", ADMIN, json={"name": name, "source": str(tiny_base_checkpoint)})
    assert response.status_code == 201, response.text
    ghosts = [StubEngine(f"http://127.0.0.1:{port}", base_model=name) for port in free_ports(2)]
    heartbeats = [Heartbeat(settings.redis_url, settings.redis_prefix, lambda g=g: g.record([])) for g in ghosts]
    for heartbeat in heartbeats:
        heartbeat.start()
    try:
        assert poll(lambda: {g.id for g in ghosts} <= set(platform.engines()), 3)
        for stream in (False, True):
            body = {"model": name, "messages": MESSAGES, "max_tokens": 2, "stream": stream}
            response = platform.post("/v1/chat/completions", tenant.headers, json=body)
            assert response.status_code == 503, response.text
            assert _envelope(response)["code"] == "engine_unavailable"
    finally:
        for heartbeat in heartbeats:
            heartbeat.close()


def stub_base_model(platform: Platform, tiny_base_checkpoint: Path) -> str:
    """A base model of the calling test's own, which only its stubs serve (the module's engine serves BASE)."""
    name = f"stub-base-{secrets.token_hex(3)}"
    response = platform.post("/admin/base-models", ADMIN, json={"name": name, "source": str(tiny_base_checkpoint)})
    assert response.status_code == 201, response.text
    return name


@contextlib.contextmanager
def registered(settings: Settings, platform: Platform, *stubs: StubEngine) -> Iterator[None]:
    """`stubs` in the registry (idle, no adapter) until the block ends, and in the platform's view of it."""
    assert settings.redis_url is not None
    heartbeats = [Heartbeat(settings.redis_url, settings.redis_prefix, lambda s=s: s.record([])) for s in stubs]
    try:
        for heartbeat in heartbeats:
            heartbeat.start()
        assert poll(lambda: {s.id for s in stubs} <= set(platform.engines()), 3)
        yield
    finally:
        for heartbeat in heartbeats:
            heartbeat.close()


def metric(platform: Platform, name: str, **labels: str) -> float:
    """One sample of the platform's /metrics (0 when the series does not exist yet)."""
    response = platform.get("/metrics", ADMIN)
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def test_a_replica_whose_queue_is_full_hands_the_request_to_the_next(
    settings: Settings, tiny_base_checkpoint: Path, platform: Platform, tenant: Tenant
) -> None:
    """An engine that answers 503 overloaded has run none of the request: it goes to the router's next choice, a
    streamed one before its first byte, and the client sees only the answer."""
    name = stub_base_model(platform, tiny_base_checkpoint)
    tag = secrets.token_hex(3)
    # Ids that sort the full replica first: of two idle replicas the router offers it the request first.
    with (
        serving_stub(id=f"engine-0-a{tag}", base_model=name, overloaded_retry_after="2") as full,
        serving_stub(id=f"engine-0-b{tag}", base_model=name) as free,
        registered(settings, platform, full, free),
    ):
        client = tenant.openai(platform)
        answer = client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=2, prompt_cache_key=f"k-{secrets.token_hex(4)}"
        )
        assert answer.choices[0].message.content == STUB_TEXT
        assert (len(full.received), len(free.received)) == (1, 1)
        stream = client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=2, stream=True, prompt_cache_key=f"k-{secrets.token_hex(4)}"
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == STUB_TEXT
        assert (len(full.received), len(free.received)) == (2, 2)
        row = poll(lambda: _usage_row(platform, tenant, answer.id), 5)
        assert row is not None and row["status"] == "ok"
        overloaded = f"{PLATFORM_METRICS}_engine_overloaded_total"
        assert metric(platform, overloaded, replica=full.id) == 2
        assert metric(platform, overloaded, replica=free.id) == 0


def test_a_request_every_replica_refuses_as_overloaded_is_a_503_with_the_soonest_retry_after(
    settings: Settings, tiny_base_checkpoint: Path, platform: Platform
) -> None:
    """Every replica full: 503 in OpenAI's envelope, code overloaded, the shortest Retry-After the replicas gave,
    a plain JSON answer even for a stream (nothing was streamed), each replica tried once; billed as an error of
    zero tokens, as a request no engine could be reached for is."""
    name = stub_base_model(platform, tiny_base_checkpoint)
    tenant_id, key = keyed_tenant(platform, "full")
    with (
        serving_stub(base_model=name, overloaded_retry_after="7") as first,
        serving_stub(base_model=name, overloaded_retry_after="3") as second,
        registered(settings, platform, first, second),
    ):
        for stream in (False, True):
            body = {"model": name, "messages": MESSAGES, "max_tokens": 2, "stream": stream}
            response = platform.post("/v1/chat/completions", bearer(key), json=body)
            assert response.status_code == 503, response.text
            assert response.headers["content-type"].startswith("application/json")
            assert response.headers["retry-after"] == "3"
            error = _envelope(response)
            assert (error["code"], error["type"]) == ("overloaded", "server_error")
        assert (len(first.received), len(second.received)) == (2, 2)

        client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2, stream=True)
        assert (info.value.status_code, info.value.code) == (503, "overloaded")
        assert info.value.response.headers["retry-after"] == "3"

    usage = platform.get("/v1/usage", bearer(key))
    assert usage.status_code == 200, usage.text
    rows = usage.json()["data"]
    assert [row["status"] for row in rows] == ["error"] * 3
    assert all(row["prompt_tokens"] == row["completion_tokens"] == 0 for row in rows)
    assert metric(platform, f"{PLATFORM_METRICS}_overloaded_total", tenant=tenant_id) == 3


def _sse_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """An event stream's (event, data) pairs."""
    events = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            events.append((lines.get("event", ""), json.loads(lines["data"])))
    return events


def test_agent_protocols_end_a_stream_the_engine_cuts_off_with_their_error_event(
    settings: Settings, tiny_base_checkpoint: Path, platform: Platform
) -> None:
    """Issue 36: Anthropic's `error` event and the Responses API's `response.failed`, after the text the engine
    sent; the SDKs raise or show them; billed as errors for what was sent."""
    name = stub_base_model(platform, tiny_base_checkpoint)
    _, key = keyed_tenant(platform, "cut")
    ask = {"model": name, "max_tokens": 8, "messages": MESSAGES, "stream": True}
    anthropic_headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    with serving_stub(base_model=name, answer=_stub_events(cut_off=True)) as stub, registered(settings, platform, stub):
        response = platform.post("/v1/messages", anthropic_headers, json=ask)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "message_start" and kinds[-1] == "error" and "message_stop" not in kinds, kinds
        text = "".join(data["delta"].get("text", "") for kind, data in events if kind == "content_block_delta")
        assert text == STUB_TEXT
        assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"
        claude = anthropic.Anthropic(base_url=platform.url, api_key=key, max_retries=0, timeout=60)
        stream = claude.messages.stream(model=name, max_tokens=8, messages=MESSAGES)
        with pytest.raises(anthropic.APIStatusError, match="unavailable"):
            stream.__enter__().until_done()
        stream.__exit__(None, None, None)

        sdk = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0, timeout=60)
        seen = list(sdk.responses.create(model=name, input=PROMPT, max_output_tokens=8, stream=True))
        types = [event.type for event in seen]
        assert types[0] == "response.created" and types[-1] == "response.failed", types
        assert "response.completed" not in types
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == STUB_TEXT
        failed = seen[-1].response  # type: ignore[union-attr]
        assert failed.status == "failed" and failed.error is not None and "unavailable" in failed.error.message
        assert [event.sequence_number for event in seen] == list(range(len(seen)))
        kept = sdk.responses.retrieve(failed.id)  # stored as it failed
        assert kept.status == "failed" and kept.output_text == STUB_TEXT and kept.error == failed.error
    rows = poll(lambda: (rows := platform.get("/v1/usage", bearer(key)).json()["data"]) and len(rows) == 3 and rows, 5)
    assert rows and all((row["status"], row["completion_tokens"]) == ("error", 1) for row in rows), rows


def test_agent_protocols_answer_every_replica_overloaded_in_their_envelope(
    settings: Settings, tiny_base_checkpoint: Path, platform: Platform
) -> None:
    """Issue 36: an engine whose queue is full is Anthropic's 529 `overloaded_error` (with a request-id) and the
    Responses API's 503 `overloaded`, before any byte of a stream; the SDKs raise their overloaded errors."""
    name = stub_base_model(platform, tiny_base_checkpoint)
    _, key = keyed_tenant(platform, "full")
    anthropic_headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    with serving_stub(base_model=name, overloaded_retry_after="2") as stub, registered(settings, platform, stub):
        for stream in (False, True):
            body = {"model": name, "max_tokens": 4, "messages": MESSAGES, "stream": stream}
            response = platform.post("/v1/messages", anthropic_headers, json=body)
            assert response.status_code == 529 and response.headers["retry-after"] == "2", response.text
            assert response.json()["error"]["type"] == "overloaded_error" and response.headers["request-id"]
            body = {"model": name, "input": PROMPT, "max_output_tokens": 4, "stream": stream}
            response = platform.post("/v1/responses", bearer(key), json=body)
            assert response.status_code == 503 and response.headers["retry-after"] == "2", response.text
            assert (_envelope(response)["code"], _envelope(response)["type"]) == ("overloaded", "server_error")
        claude = anthropic.Anthropic(base_url=platform.url, api_key=key, max_retries=0, timeout=60)
        with pytest.raises(anthropic.OverloadedError):
            claude.messages.create(model=name, max_tokens=4, messages=MESSAGES)
        sdk = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as info:
            sdk.responses.create(model=name, input=PROMPT, max_output_tokens=4)
        assert (info.value.status_code, info.value.code) == (503, "overloaded")


async def test_the_in_process_client_passes_on_an_overloaded_engines_retry_after() -> None:
    """The embedded mode's engine client reads the refusal from the ASGI start message, as the HTTP one does from
    the response (the 503 tests above)."""
    error = {"message": "The queue is full.", "type": "server_error", "param": None, "code": "overloaded"}

    async def full_engine(scope: Any, receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        await receive()
        headers = [(b"content-type", b"application/json"), (b"Retry-After", b"4")]  # names: any case
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})

    with pytest.raises(EngineRequestError) as info:
        await anext(aiter(InProcessEngineClient(full_engine).stream("/v1/chat/completions", {"model": BASE})))
    assert info.value.overloaded and info.value.retry_after_s == 4.0
    parsed = [retry_after_seconds(v) for v in ("2.5", b"7", "-1", "Wed, 21 Oct 2026 07:28:00 GMT", None)]
    assert parsed == [2.5, 7.0, None, None, None]  # seconds only: engines send no dates


# --- the router's choices, on real Redis -------------------------------------------------------------------------


class StaticFleet:
    """A fleet whose replicas the test sets."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas_now = replicas

    async def replicas(self) -> list[Replica]:
        return self.replicas_now

    def client(self, replica: Replica) -> EngineClient:
        raise AssertionError("the router never opens clients")

    def reachable(self, replica: Replica) -> bool:
        return True

    async def close(self) -> None:
        return None


@pytest.fixture
async def router_kv(redis_server: RedisServer, redis_prefix: str) -> AsyncIterator[RedisStore]:
    kv = RedisStore(redis_server.url, prefix=redis_prefix)
    try:
        yield kv
    finally:
        await kv.close()


def _idle(replica_id: str, **changes: Any) -> Replica:
    return Replica(id=replica_id, url=f"http://{replica_id}", base_model=BASE, num_pages=100, free_pages=100, **changes)


async def test_a_burst_spreads_over_idle_replicas(router_kv: RedisStore) -> None:
    router = Router(StaticFleet([_idle("a"), _idle("b"), _idle("c")]), router_kv)
    picks = [await router.pick(BASE, None, None) for _ in range(6)]
    assert sorted(p.id for p in picks if p is not None) == ["a", "a", "b", "b", "c", "c"]
    assert await router.pick("another-model", None, None) is None


async def test_a_replica_the_request_has_tried_is_never_offered_again(router_kv: RedisStore) -> None:
    digest = "sha256:" + "cd" * 32
    router = Router(StaticFleet([_idle("a", adapters=frozenset({digest})), _idle("b")]), router_kv)
    picked = await router.pick(BASE, digest, None, frozenset({"a"}))
    assert picked is not None and picked.id == "b"  # "a" holds the adapter, but it has refused this request
    assert await router.pick(BASE, digest, None, frozenset({"a", "b"})) is None


async def test_residency_and_warmth_win_only_while_the_load_is_in_balance(router_kv: RedisStore) -> None:
    digest = "sha256:" + "ab" * 32
    busy = _idle("a", adapters=frozenset({digest}), num_waiting=int(BALANCE_SLACK // 2) + 1)
    fleet = StaticFleet([busy, _idle("b")])
    router = Router(fleet, router_kv)
    picked = await router.pick(BASE, digest, "tenant-1:")
    assert picked is not None and picked.id == "b"  # resident, but queueing more than the slack allows

    fleet.replicas_now = [_idle("a", adapters=frozenset({digest}), num_waiting=2), _idle("b")]
    router = Router(fleet, router_kv)
    picked = await router.pick(BASE, digest, "tenant-2:")
    assert picked is not None and picked.id == "a"  # a short queue is worth the resident adapter

    # The tenant's prefix went to "b" last: without an adapter to decide, it goes there again, until "b" has taken
    # more than the slack's worth of recent requests.
    fleet.replicas_now = [_idle("a"), _idle("b")]
    router = Router(fleet, router_kv)
    chosen = [await router.pick(BASE, None, "tenant-1:") for _ in range(int(BALANCE_SLACK) + 2)]
    ids = [c.id for c in chosen if c is not None]
    assert ids[: int(BALANCE_SLACK) + 1] == ["b"] * (int(BALANCE_SLACK) + 1)
    assert ids[-1] == "a"


async def test_balance_names_the_warm_peer_it_passed_over(router_kv: RedisStore) -> None:
    """When load sends a prefix away from the replica it last went to, the choice names that replica: the chosen one
    may fetch the prefix's KV blocks from it (a prefix pull) instead of computing them."""
    fleet = StaticFleet([_idle("a"), _idle("b")])
    first = await Router(fleet, router_kv).choose(BASE, None, "tenant-9:")
    assert first is not None and first.warm_peer is None
    warm = first.replica.id
    fleet.replicas_now = [_idle(r, num_waiting=int(BALANCE_SLACK) if r == warm else 0) for r in ("a", "b")]
    moved = await Router(fleet, router_kv).choose(BASE, None, "tenant-9:")
    assert moved is not None and moved.replica.id != warm
    assert moved.warm_peer is not None and moved.warm_peer.id == warm
    again = await Router(fleet, router_kv).choose(BASE, None, "tenant-9:")
    assert again is not None and again.warm_peer is None, "the prefix went to the new replica: it is warm now"


async def test_prefill_replicas_get_prefills_only(router_kv: RedisStore) -> None:
    digest = "sha256:" + "ef" * 32
    fleet = StaticFleet(
        [
            _idle("p1", role="prefill"),
            _idle("p2", role="prefill", adapters=frozenset({digest})),
            _idle("d", role="decode", num_waiting=20),
        ]
    )
    router = Router(fleet, router_kv)
    assert {(await router.pick(BASE, None, None)).id for _ in range(4)} == {"d"}  # type: ignore[union-attr]
    prefill = await router.pick_prefill(BASE, digest)
    assert prefill is not None and prefill.id == "p2"  # the adapter's resident there
    fleet.replicas_now = [_idle("p1", role="prefill")]
    only = await router.pick(BASE, None, None)
    assert only is not None and only.id == "p1", "with no other replica a prefill one serves whole requests"
    fleet.replicas_now = [_idle("d", role="decode")]
    assert await router.pick_prefill(BASE, None) is None


async def test_a_single_replica_costs_no_affinity_round_trip(router_kv: RedisStore) -> None:
    fleet = StaticFleet([_idle("a")])
    router = Router(fleet, router_kv)
    picked = await router.pick(BASE, None, "tenant-3:")
    assert picked is not None and picked.id == "a"
    assert await router_kv.get(AFFINITY_KEY.format(key="tenant-3:")) is None, "one candidate: nothing to remember"
    # A second replica joins: the affinity is recorded from the next pick on, and followed after it.
    fleet.replicas_now = [_idle("a"), _idle("b")]
    first = await router.pick(BASE, None, "tenant-3:")
    assert first is not None
    assert await router_kv.get(AFFINITY_KEY.format(key="tenant-3:")) == first.id.encode()
    again = await router.pick(BASE, None, "tenant-3:")
    assert again is not None and again.id == first.id


# --- an engine that dies (stays last: it kills the module's engine) ----------------------------------------------


def test_a_client_that_goes_away_stops_the_engine_and_is_billed_for_what_it_got(
    engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    def engine_state() -> dict[str, Any]:
        state: dict[str, Any] = httpx.get(f"{engine.url}/v1/state", headers=ENGINE_AUTH, timeout=10).json()
        return state

    steps_before = engine_state()["num_steps"]  # one decode step per token: nothing else runs on this engine now
    stream = _long_stream(tenant, platform)
    chunks: list[ChatCompletionChunk] = []
    for chunk in stream:
        chunks.append(chunk)
        if _num_tokens(chunks) >= 8:
            break
    stream.close()

    assert poll(lambda: engine_state()["num_running"] == 0, 5), engine_state()
    # The request asked for MAX_MODEL_LEN - 200 tokens; the engine stopped soon after the client left.
    assert engine_state()["num_steps"] - steps_before < MAX_MODEL_LEN // 4

    assert poll(lambda: _usage_row(platform, tenant, chunks[0].id) is not None, 5)
    row = _usage_row(platform, tenant, chunks[0].id)
    assert row is not None and row["status"] == "cancelled"
    # Billed what was sent: at least what this client read, and far from the whole answer.
    assert _num_tokens(chunks) <= row["completion_tokens"] < MAX_MODEL_LEN // 2


def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error_and_bills_what_was_sent(
    engine: ServerProcess, platform: Platform, tenant: Tenant
) -> None:
    stream = _long_stream(tenant, platform)
    chunks: list[ChatCompletionChunk] = []

    def read_and_kill() -> None:
        """Read the stream; once 8 tokens have arrived, SIGKILL the engine (and keep reading)."""
        for chunk in stream:
            chunks.append(chunk)
            if _num_tokens(chunks) >= 8:
                engine.kill()

    with pytest.raises(openai.APIError) as info:
        read_and_kill()
    assert engine.process.poll() is not None, "the stream failed before the engine was killed"
    assert all(choice.finish_reason is None for c in chunks for choice in c.choices), "it ended before the kill"
    num_tokens = _num_tokens(chunks)  # handed to the client
    assert "engine" in info.value.message and "unavailable" in info.value.message
    request_id = chunks[0].id
    assert poll(lambda: _usage_row(platform, tenant, request_id) is not None, 5), "no usage row"
    row = _usage_row(platform, tenant, request_id)
    assert row is not None
    assert row["status"] == "error"
    assert row["model"] == ENDPOINT
    assert row["completion_tokens"] == num_tokens  # exactly what the client got before the break
    assert row["prompt_tokens"] > 0

    # No beats any more: once the key has expired the engine leaves the fleet, and nothing serves the base model.
    assert poll(lambda: ENGINE_ID not in platform.engines(), HEARTBEAT_TTL_MS / 1000 + 3)
    body = {"model": ENDPOINT, "messages": MESSAGES, "max_tokens": 2}
    for stream_it in (False, True):
        response = platform.post("/v1/chat/completions", tenant.headers, json={**body, "stream": stream_it})
        assert response.status_code == 503, response.text
        error = _envelope(response)
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert BASE in error["message"]
    with pytest.raises(openai.InternalServerError) as refused:
        _chat_text(tenant, platform)
    assert refused.value.status_code == 503
