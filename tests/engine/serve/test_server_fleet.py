"""The engine server as the platform drives it: a request's own adapter (`lora_adapter`: name, source, digest)
accepted only from the operator's adapter roots, running usage in every streamed chunk
(`stream_options.continuous_usage_stats`), and registration in the fleet's Redis registry.

One tiny random Llama and one real PEFT adapter made against it. Greedy outputs with ignore_eos are compared with
the offline `LLM` running the same adapter through a LoRARequest (whose numbers test_lora_correctness checks
against peft), so a request that ran the wrong weights, or none, shows up as other text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import torch
from _support.adapters import make_peft_adapter
from _support.checkpoints import tiny_spec
from _support.engine_server import running_engine_server
from _support.services import RedisServer
from _support.waiting import poll
from click.testing import CliRunner
from litestar import Litestar

from loraplex.engine import LLM, LoRARequest, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.lora import adapter_digest, read_adapter_dir
from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.lora_registry import AdapterRoots
from loraplex.engine.serve.registration import RegistrationConfig
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.tools.demo import write_random_model
from loraplex.platform.cli import main

TINY = tiny_spec()
MODEL = "tiny"
PLATFORM_NAME = "tiny-base"  # the platform's name of the base model (--base-model-name)
MAX_MODEL_LEN = 256
PROMPT = "The adapter says"
MAX_TOKENS = 12
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS}
CONTINUOUS: dict[str, Any] = {"include_usage": True, "continuous_usage_stats": True}
RECORD_FIELDS = {
    "id",
    "url",
    "base_model",
    "adapters",
    "free_pages",
    "evictable_pages",
    "num_pages",
    "num_waiting",
    "num_running",
    "max_model_len",
    "updated_at",
    "role",
}


@dataclass(frozen=True)
class Setup:
    base: Path
    root: Path  # the adapter root the server allows
    adapter: Path  # under `root`
    digest: str
    expected: dict[bool, str]  # the offline engine's greedy text for PROMPT, with the adapter (True) and without
    scratch: Path  # outside `root`

    def spec(self, **changes: str) -> dict[str, str]:
        """A `lora_adapter` field for the adapter, with `changes`."""
        return {"name": "tenant-a/adapter@v1", "source": str(self.adapter), "digest": self.digest, **changes}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    scratch = tmp_path_factory.mktemp("server-fleet")
    base = write_random_model(scratch / "base", TINY)
    root = scratch / "adapters"
    adapter = make_peft_adapter(
        base, root / "tenant-a" / "adapter", seed=1, r=8, lora_alpha=16, target_modules="all-linear"
    )
    num_threads = torch.get_num_threads()
    llm = LLM(base, device="cpu", kv_budget=4 * 2**20, max_model_len=MAX_MODEL_LEN, num_threads=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {
        False: llm.generate(PROMPT, params)[0].outputs[0].text,
        True: llm.generate(PROMPT, params, lora_request=LoRARequest("a", adapter))[0].outputs[0].text,
    }
    torch.set_num_threads(num_threads)
    assert expected[True] != expected[False], "the adapter must change this prompt's greedy text"
    return Setup(base, root, adapter, adapter_digest(*read_adapter_dir(adapter)), expected, scratch)


def _config(model_path: Path) -> EngineConfig:
    return EngineConfig(
        model=model_path,
        device="cpu",
        kv_budget=4 * 2**20,
        max_model_len=MAX_MODEL_LEN,
        served_model_name=MODEL,
        num_threads=2,
    )


def _running_server(
    config: EngineConfig, make_app: Callable[[AsyncEngine, str], Litestar]
) -> contextlib.AbstractContextManager[tuple[str, AsyncEngine]]:
    """`make_app(engine, url)` on a uvicorn server (lifespan included), in a thread with its own event loop."""

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return make_app(engine, url)

    return running_engine_server(config, app, check_exit=True)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def _complete(url: str, model: str = MODEL, lora_adapter: dict[str, str] | None = None) -> str:
    extra: dict[str, Any] = {"ignore_eos": True}
    if lora_adapter is not None:
        extra["lora_adapter"] = lora_adapter
    response = _client(url).completions.create(model=model, prompt=PROMPT, **GREEDY, extra_body=extra)
    assert response.model == model
    text: str = response.choices[0].text
    return text


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=30)


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def server(setup: Setup) -> Iterator[str]:
    """A server that accepts adapters under `setup.root`."""

    def make_app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, adapter_roots=[str(setup.root)])

    with _running_server(_config(setup.base), make_app) as (url, _):
        yield url


# --- a request's own adapter -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_lora_adapter_runs_the_adapter_as_the_offline_engine_does(setup: Setup, server: str) -> None:
    assert _complete(server, lora_adapter=setup.spec()) == setup.expected[True]
    assert _complete(server) == setup.expected[False]  # the base model is untouched
    assert _complete(server, lora_adapter=setup.spec(name="another name, same files")) == setup.expected[True]


@pytest.mark.unit
def test_lora_adapter_in_a_chat_stream_with_running_usage(setup: Setup, server: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hello there"}]
    answers = {}
    for adapter in (None, setup.spec()):
        extra: dict[str, Any] = {"ignore_eos": True}
        if adapter is not None:
            extra["lora_adapter"] = adapter
        stream = _client(server).chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options=CONTINUOUS, **GREEDY, extra_body=extra
        )
        chunks = list(stream)
        assert {chunk.model for chunk in chunks} == {MODEL}
        assert all(chunk.usage is not None for chunk in chunks)
        answers[adapter is not None] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answers[True] != answers[False]


@pytest.mark.unit
def test_lora_adapter_digest_may_be_upper_case(setup: Setup, server: str) -> None:
    upper = "sha256:" + setup.digest.removeprefix("sha256:").upper()
    assert _complete(server, lora_adapter=setup.spec(digest=upper)) == setup.expected[True]


def _sibling(setup: Setup) -> str:
    """A copy of the adapter in a folder whose name starts with the root's."""
    folder = setup.scratch / f"{setup.root.name}-evil" / "adapter"
    shutil.copytree(setup.adapter, folder, dirs_exist_ok=True)
    return str(folder)


def _outside(setup: Setup) -> str:
    folder = setup.scratch / "outside" / "adapter"
    shutil.copytree(setup.adapter, folder, dirs_exist_ok=True)
    return str(folder)


def _link_out(setup: Setup) -> str:
    """A symlink inside the root that leads out of it."""
    link = setup.root / "link-out"
    if not link.exists():
        link.symlink_to(Path(_outside(setup)).parent, target_is_directory=True)
    return str(link / "adapter")


@pytest.mark.unit
@pytest.mark.parametrize(
    "source",
    [
        _outside,
        _sibling,
        _link_out,
        lambda setup: f"{setup.root}/../outside/adapter",
        lambda setup: "adapters/tenant-a/adapter",
        lambda setup: "s3://bucket/adapters/tenant-a/adapter",
        lambda setup: "/",
    ],
    ids=["outside", "sibling-with-the-root-as-prefix", "symlink-out", "dot-dot", "relative", "s3", "fs-root"],
)
def test_a_source_outside_the_roots_is_400(setup: Setup, server: str, source: Callable[[Setup], str]) -> None:
    response = _post(server, {"max_tokens": 2, "lora_adapter": setup.spec(source=source(setup))})
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "lora_adapter"
    assert error["code"] == "lora_adapter_source_not_allowed"
    assert "lora_adapter.source" in error["message"]


@pytest.mark.unit
def test_a_wrong_digest_fails_the_request_with_400_saying_the_files_changed(setup: Setup, server: str) -> None:
    wrong = "sha256:" + "0" * 64
    body = {"max_tokens": 4, "lora_adapter": setup.spec(digest=wrong)}
    response = _post(server, body)
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "lora_adapter"
    assert "changed" in error["message"] and wrong in error["message"]

    with httpx.stream("POST", f"{server}/v1/completions", json={"prompt": PROMPT, "stream": True, **body}) as stream:
        assert stream.status_code == 200  # the load fails after the stream began
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
    failure, done = events
    assert done == "[DONE]"
    assert json.loads(failure)["error"]["param"] == "lora_adapter"
    assert "changed" in json.loads(failure)["error"]["message"]
    assert _complete(server, lora_adapter=setup.spec()) == setup.expected[True]  # the right digest still works


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"digest": "sha256:1234"}, "lora_adapter.digest"),
        ({"digest": "md5:" + "0" * 64}, "lora_adapter.digest"),
        ({"name": ""}, "lora_adapter.name"),
        ({"source": ""}, "lora_adapter.source"),
        ({"path": "/x"}, "lora_adapter.path"),
    ],
    ids=["short-digest", "other-hash", "empty-name", "empty-source", "unknown-field"],
)
def test_a_malformed_lora_adapter_is_400_naming_the_field(
    setup: Setup, server: str, change: dict[str, str], param: str
) -> None:
    response = _post(server, {"max_tokens": 2, "lora_adapter": setup.spec(**change)})
    assert response.status_code == 400
    assert _error(response)["param"] == param


@pytest.mark.unit
def test_lora_adapter_needs_the_base_model_as_model(setup: Setup, server: str) -> None:
    response = _post(server, {"model": "someone-else", "max_tokens": 2, "lora_adapter": setup.spec()})
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == "model"
    assert MODEL in error["message"]
    body = {"prompt": PROMPT, "max_tokens": 2, "lora_adapter": setup.spec()}  # no model: the base model
    assert httpx.post(f"{server}/v1/completions", json=body, timeout=30).status_code == 200


@pytest.mark.unit
def test_without_adapter_roots_lora_adapter_is_refused(setup: Setup) -> None:
    def make_app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    with _running_server(_config(setup.base), make_app) as (url, _):
        with pytest.raises(openai.PermissionDeniedError) as info:
            _complete(url, lora_adapter=setup.spec())
        error = info.value.response.json()["error"]
        assert error["param"] == "lora_adapter"
        assert error["code"] == "lora_adapter_not_allowed"
        assert "--adapter-root" in error["message"]
        assert _complete(url) == setup.expected[False]


# --- continuous usage --------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("prompt", [PROMPT, [PROMPT, "Another prompt, longer than the first"]], ids=["one", "two"])
def test_every_chunk_carries_the_usage_so_far(server: str, prompt: str | list[str]) -> None:
    client = _client(server)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            stream=True,
            stream_options=CONTINUOUS,
            logprobs=0,
            **GREEDY,
            extra_body={"ignore_eos": True},
        )
    )
    whole = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body={"ignore_eos": True})
    assert whole.usage is not None

    num_sent = 0  # tokens handed out so far, counted from the chunks' logprobs
    previous = 0
    for chunk in chunks:
        usage = chunk.usage
        assert usage is not None
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None
        assert usage.completion_tokens >= previous
        previous = usage.completion_tokens
        for choice in chunk.choices:
            assert choice.logprobs is not None and choice.logprobs.tokens is not None
            num_sent += len(choice.logprobs.tokens)
        if chunk.choices:
            assert usage.completion_tokens == num_sent  # exactly the tokens handed out so far
    *content, last = chunks
    assert last.choices == []  # the closing usage chunk comes too
    assert last.usage == content[-1].usage
    assert last.usage == whole.usage
    assert whole.usage.completion_tokens == MAX_TOKENS * (1 if isinstance(prompt, str) else len(prompt))


@pytest.mark.unit
def test_without_continuous_usage_only_the_last_chunk_has_usage(server: str) -> None:
    stream = _client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]


# --- the allowed roots -------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("source", "allowed"),
    [
        ("s3://bucket/tenants/t1/adapters/a1", True),
        ("s3://bucket/tenants/t1/adapters/a1/", True),
        ("s3://bucket/tenants", True),
        ("s3://bucket/tenants-x/a1", False),
        ("s3://bucket/tenant", False),
        ("s3://other/tenants/t1", False),
        ("s3://bucket/tenants/../secrets", False),
        ("s3://bucket/tenants//a1", False),
        ("s3://whole-bucket/anything/at/all", True),
        ("s3:///tenants", False),
    ],
)
def test_s3_roots_admit_only_their_prefixes(source: str, allowed: bool) -> None:
    roots = AdapterRoots(["s3://bucket/tenants/", "s3://whole-bucket"])
    if allowed:
        assert roots.check(source) == source.rstrip("/")
    else:
        with pytest.raises(ApiError) as info:
            roots.check(source)
        assert (info.value.status_code, info.value.param) == (400, "lora_adapter")


@pytest.mark.unit
@pytest.mark.parametrize("root", ["relative/folder", "s3://", "s3://UPPER/x", "/a/../b", "s3://bucket/a/../b"])
def test_a_malformed_root_is_refused(root: str) -> None:
    with pytest.raises(ValueError, match="adapter root"):
        AdapterRoots([root])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--adapter-root", "s3://"], ["--adapter-root"]),
        (["--engine-id", "e1"], ["--engine-id", "--redis-url"]),
        (["--redis-url", "redis://localhost:6379", "--port", "0"], ["--engine-id", "--public-url"]),
        (["--redis-url", "localhost:6379"], ["--redis-url"]),
        (["--redis-url", "redis://localhost:6379", "--public-url", "gpu-3:8100"], ["--public-url"]),
    ],
    ids=["bad-root", "id-without-redis", "port-0", "redis-url-scheme", "public-url-scheme"],
)
def test_serve_refuses_bad_fleet_options(setup: Setup, args: list[str], words: list[str]) -> None:
    result = CliRunner().invoke(main, ["engine", "serve", "--model", str(setup.base), "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output


# --- fleet registration ------------------------------------------------------------------------------------------


def _record(client: redis.Redis, key: str) -> dict[str, Any] | None:
    raw = client.get(key)
    return None if raw is None else json.loads(raw)


@pytest.mark.integration
def test_the_engine_registers_beats_and_withdraws(setup: Setup, redis_server: RedisServer, redis_prefix: str) -> None:
    engine_id = f"engine-{secrets.token_hex(3)}"
    key, members = f"{redis_prefix}fleet:engine:{engine_id}", f"{redis_prefix}fleet:engines"
    client = redis.Redis.from_url(redis_server.url)
    urls: list[str] = []

    def make_app(engine: AsyncEngine, url: str) -> Litestar:
        urls.append(url)
        registration = RegistrationConfig(
            redis_url=redis_server.url, engine_id=engine_id, url=url, base_model=PLATFORM_NAME, prefix=redis_prefix
        )
        return create_engine_app(engine, adapter_roots=[str(setup.root)], registration=registration)

    try:
        with _running_server(_config(setup.base), make_app) as (url, _):
            assert poll(lambda: client.exists(key) == 1, 2.0), "no registry entry within 2 s"
            record = _record(client, key)
            assert record is not None and set(record) == RECORD_FIELDS
            assert (record["id"], record["url"], record["base_model"]) == (engine_id, urls[0], PLATFORM_NAME)
            assert record["adapters"] == []
            assert record["max_model_len"] == MAX_MODEL_LEN
            assert record["role"] == "both"
            assert 0 < record["free_pages"] <= record["num_pages"]
            assert (record["num_waiting"], record["num_running"]) == (0, 0)
            assert abs(record["updated_at"] - time.time()) < 5
            assert 0 < client.pttl(key) <= 5000
            assert client.sismember(members, engine_id)

            # The platform sends its own name of the base model with the adapter it wants.
            assert _complete(url, PLATFORM_NAME, setup.spec()) == setup.expected[True]

            def resident() -> bool:
                current = _record(client, key)
                return current is not None and current["adapters"] == [setup.digest]

            assert poll(resident, 2.5), f"adapter not listed: {_record(client, key)}"
            later = _record(client, key)
            assert later is not None and later["updated_at"] > record["updated_at"]  # it keeps beating
        assert client.exists(key) == 0
        assert not client.sismember(members, engine_id)
    finally:
        client.close()


@pytest.mark.unit
def test_an_unreachable_redis_never_stops_the_server(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    apps: list[Litestar] = []

    def make_app(engine: AsyncEngine, url: str) -> Litestar:
        registration = RegistrationConfig(redis_url=f"redis://127.0.0.1:{port}", engine_id="e", url=url)
        apps.append(create_engine_app(engine, registration=registration))
        return apps[-1]

    logs = caplog.at_level(logging.WARNING, logger="loraplex.engine.serve.registration")
    with logs, _running_server(_config(setup.base), make_app) as (url, _):
        assert _complete(url) == setup.expected[False]
        assert poll(lambda: "fleet registration" in caplog.text, 3.0)
        beats = apps[0].state.fleet_registration
        assert poll(lambda: beats.num_failed_beats >= 2, 3.0)  # another beat failed, and was not logged again
        assert httpx.get(f"{url}/healthz").status_code == 200
    assert caplog.text.count("fleet registration") == 1
    assert "could not withdraw" in caplog.text
