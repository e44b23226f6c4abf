"""The engine server's edge, on a real uvicorn socket: its shared API key (vLLM's --api-key), and what a hostile
client sends it (JSON nested past the parser's depth, NUL bytes in the URL, prompts megabytes long, adapter paths
the filesystem refuses), each a 4xx in OpenAI's envelope. One tiny random model serves the module, twice: without
a key and with one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.engine_server import running_engine_server
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.serve.serving import OFFLOAD_TOKENIZE_CHARS
from loraplex.engine.tools.demo import RandomModelSpec, write_random_model

pytestmark = pytest.mark.unit

TINY = RandomModelSpec(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    vocab_size=512,
    max_position_embeddings=4096,
)
MODEL = "edge"
API_KEY = "engine-key-for-tests-0123"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = write_random_model(tmp_path_factory.mktemp("edge-model"), TINY)
    return EngineConfig(model=path, device="cpu", kv_budget=2**20, served_model_name=MODEL, num_threads=1)


def _server(config: EngineConfig, api_key: str | None) -> Any:
    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, api_key=api_key)

    return running_engine_server(config, app)


@pytest.fixture(scope="module")
def open_server(config: EngineConfig) -> Iterator[tuple[str, AsyncEngine]]:
    with _server(config, None) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_url(config: EngineConfig) -> Iterator[str]:
    with _server(config, API_KEY) as (url, _):
        yield url


def _error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# --- the shared API key -------------------------------------------------------------------------------------------


def test_with_an_api_key_every_v1_route_needs_it(keyed_url: str, tmp_path: Path) -> None:
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/state", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, f"{keyed_url}{path}", json=body, headers=headers, timeout=30)
            assert _error(response, 401)["code"] == "invalid_api_key", (path, headers)
    # The right key, as the openai SDK sends it.
    client = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert client.chat.completions.create(**CHAT).choices  # type: ignore[call-overload]
    assert [m.id for m in client.models.list()] == [MODEL]
    response = httpx.post(
        f"{keyed_url}/v1/unload_lora_adapter",
        json={"lora_name": "never-loaded"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert response.status_code == 404, response.text  # past the key: the adapter is what is missing


def test_with_an_api_key_probes_and_scrapes_stay_open(keyed_url: str) -> None:
    assert httpx.get(f"{keyed_url}/healthz", timeout=30).status_code == 200
    assert httpx.get(f"{keyed_url}/metrics", timeout=30).status_code == 200


def test_without_an_api_key_nothing_is_asked(open_server: tuple[str, AsyncEngine]) -> None:
    url, _ = open_server
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_an_empty_api_key_is_refused(open_server: tuple[str, AsyncEngine]) -> None:
    _, engine = open_server
    with pytest.raises(ValueError, match="api_key"):
        create_engine_app(engine, api_key=" ")


# --- hostile requests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", ["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000], ids=["array", "object"])
def test_json_nested_past_the_parsers_depth_is_400(open_server: tuple[str, AsyncEngine], body: str) -> None:
    url, _ = open_server
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter"):
        response = httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert "nested too deeply" in _error(response)["message"], path


def test_a_nul_byte_in_the_url_is_400(open_server: tuple[str, AsyncEngine]) -> None:
    url, _ = open_server
    for path in ("/v1/models?x=%00", "/v1/state?a=b%00c"):
        assert "NUL" in _error(httpx.get(f"{url}{path}", timeout=30))["message"], path


def test_an_adapter_path_the_filesystem_refuses_is_400(open_server: tuple[str, AsyncEngine]) -> None:
    url, _ = open_server
    for lora_path in ("/tmp/" + "a" * 300, "/" + "/".join(["b" * 250] * 20)):
        body = {"lora_name": "long", "lora_path": lora_path}
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
        assert response.status_code == 400, response.text


def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized(
    open_server: tuple[str, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, engine = open_server
    tokenizer = engine.core.tokenizer
    assert tokenizer.max_chars_per_token is not None
    calls: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: calls.append(len(text)) or encode(text, **kw))
    huge = "ab " * 1_300_000  # 3.9 MB
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": huge, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
    ):
        started = time.perf_counter()
        error = _error(httpx.post(f"{url}{path}", json=body, timeout=60))
        assert error["code"] == "context_length_exceeded", error
        assert "characters long" in error["message"]
        assert time.perf_counter() - started < 5, "refused only after tokenizing"
    assert not calls


def test_long_prompts_are_tokenized_off_the_event_loop(
    open_server: tuple[str, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt under the cheap bound but long is tokenized in a worker thread, a short one on the loop."""
    url, engine = open_server
    tokenizer = engine.core.tokenizer
    threads: dict[int, str] = {}
    encode = tokenizer.encode

    def recording(text: str, **kwargs: Any) -> list[int]:
        threads[len(text)] = threading.current_thread().name
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    assert tokenizer.max_chars_per_token is not None
    bound = engine.core.max_model_len * tokenizer.max_chars_per_token
    long_prompt = "x" * min(bound - 1, OFFLOAD_TOKENIZE_CHARS * 2)
    assert len(long_prompt) >= OFFLOAD_TOKENIZE_CHARS
    for prompt in ("short prompt", long_prompt):
        response = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=60
        )
        assert response.status_code in (200, 400), response.text
    assert threads[len("short prompt")] == "engine-server"
    assert threads[len(long_prompt)] != "engine-server"


def test_text_parts_are_read_and_other_parts_named(open_server: tuple[str, AsyncEngine]) -> None:
    url, _ = open_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
    as_text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=3, temperature=0
    )
    as_parts = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}],
        max_tokens=3,
        temperature=0,
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage is not None and as_text.usage is not None
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image]}]}
    error = _error(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30))
    assert "image_url" in error["message"] and error["param"] == "messages[0].content", error


def test_a_request_is_checked_once_on_its_way_in(
    open_server: tuple[str, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server checks it (so that a bad one is a 400 before any byte streams); neither AsyncEngine nor the
    engine core checks it again."""
    url, engine = open_server
    calls: list[int] = []
    check = engine.core.check_request

    def counting(token_ids: list[int], params: Any) -> Any:
        calls.append(len(token_ids))
        return check(token_ids, params)

    monkeypatch.setattr(engine.core, "check_request", counting)
    for stream in (False, True):
        response = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
        assert response.status_code == 200, response.text
    assert len(calls) == 2
