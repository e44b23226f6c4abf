"""Overload on the engine server: a bounded waiting queue (requests and tokens) refuses past its bounds with 503
`overloaded` and Retry-After before any byte (streamed or not), leaves nothing of the refused request behind, and
counts the refusal per fairness key and priority on /metrics; OpenAI's service tiers map to priorities and are
echoed. One tiny random model with one sequence slot: a long request holds the slot, the others wait."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.checkpoints import tiny_spec
from _support.engine_server import running_engine_server
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.protocol import ChatCompletionRequest
from loraplex.engine.serve.server import create_engine_app
from loraplex.engine.tools.demo import write_random_model

pytestmark = pytest.mark.unit

MODEL = "busy"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, AsyncEngine]]:
    path = write_random_model(tmp_path_factory.mktemp("overload-model"), tiny_spec(4096))
    config = EngineConfig(
        model=path,
        device="cpu",
        kv_budget=2**22,
        served_model_name=MODEL,
        num_threads=1,
        max_num_seqs=1,
        max_waiting_requests=2,
        max_waiting_tokens=200,
    )

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine)

    with running_engine_server(config, app) as running:
        yield running


def _completion(prompt_len: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [5 + i % 90 for i in range(prompt_len)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


@contextlib.contextmanager
def _streaming(url: str, body: dict[str, Any]) -> Iterator[httpx.Response]:
    """A streamed request held open until the block ends (its 200 means the engine has queued it)."""
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
    ):
        assert response.status_code == 200
        yield response


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _overloaded(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")  # no stream was begun
    assert 1 <= int(response.headers["retry-after"]) <= 60
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "server_error"
    return error


def test_a_full_queue_refuses_with_503_and_retry_after(server: tuple[str, AsyncEngine]) -> None:
    url, engine = server
    core = engine.core
    with _streaming(url, _completion(4, 3000, user="holder")):  # holds the one slot
        _wait_for(lambda: engine.state().num_running == 1)
        with _streaming(url, _completion(150, 4, user="tenant-b")):  # waits: 150 of the 200 waiting tokens
            _wait_for(lambda: engine.state().num_waiting == 1)
            ids_before = set(core.requests)
            # 150 + 100 tokens would pass the token bound: refused, streamed or not.
            for stream in (False, True):
                response = httpx.post(f"{url}/v1/completions", json=_completion(100, 4, stream=stream), timeout=30)
                assert "tokens" in _overloaded(response)["message"]
            assert set(core.requests) == ids_before  # nothing of the refused requests was queued
            with _streaming(url, _completion(10, 4, user="tenant-b")):  # a small one still fits: 2 waiting
                _wait_for(lambda: engine.state().num_waiting == 2)
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                with pytest.raises(openai.InternalServerError) as raised:
                    client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="tenant-c"
                    )
                assert raised.value.status_code == 503
                assert raised.value.response.headers["retry-after"]
                metrics = httpx.get(f"{url}/metrics").text
                assert 'loraplex_engine_requests_refused_total{fairness_key="tenant-c",priority="0"} 1.0' in metrics
                assert 'loraplex_engine_fairness_requests_waiting{fairness_key="tenant-b",priority="0"} 2.0' in metrics
                assert 'loraplex_engine_fairness_requests_running{fairness_key="holder",priority="0"} 1.0' in metrics
                assert 'loraplex_engine_fairness_service{fairness_key="holder"}' in metrics
                assert 'loraplex_engine_fairness_served_tokens_total{fairness_key="holder"}' in metrics
                # The agent protocols refuse in their own shapes: Anthropic's 529 overloaded_error, OpenAI's 503.
                hi = [{"role": "user", "content": "hi"}]
                message = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": hi})
                assert message.status_code == 529 and message.headers["retry-after"]
                assert message.json()["error"]["type"] == "overloaded_error"
                response = httpx.post(
                    f"{url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2}
                )
                assert _overloaded(response)["message"]
    # Every request ended (the held ones aborted as their clients left): the pool has nothing left allocated.
    _wait_for(lambda: not core.requests and engine.state().num_waiting == engine.state().num_running == 0)
    usage = core.pool.usage()
    assert usage.num_free + usage.num_evictable == usage.num_pages  # only prefix-cache blocks no request holds


def test_a_queue_with_room_takes_requests_again(server: tuple[str, AsyncEngine]) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    done = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert done.choices[0].finish_reason in ("length", "stop")


def test_service_tiers_are_priorities_and_are_echoed(server: tuple[str, AsyncEngine]) -> None:
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, service_tier="flex"
    )
    assert chat.service_tier == "flex"
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert {chunk.service_tier for chunk in stream} == {"default"}
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.extend(q.priority for q in engine.state().queues)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=200, extra_body={"ignore_eos": True, "service_tier": "priority"}
        )
    finally:
        stop.set()
        watcher.join()
    assert -1 in seen
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "service_tier": "scale"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "service_tier"


def test_an_explicit_priority_wins_over_the_tier() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**body, "service_tier": "flex"}).effective_priority == 1
    assert ChatCompletionRequest.model_validate({**body, "service_tier": "priority"}).effective_priority == -1
    assert ChatCompletionRequest.model_validate({**body, "service_tier": "auto"}).effective_priority == 0
    assert ChatCompletionRequest.model_validate({**body, "service_tier": "flex", "priority": 7}).effective_priority == 7


def test_bounds_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_waiting_requests"):
        EngineConfig(model=tmp_path, max_waiting_requests=0)
    with pytest.raises(ValueError, match="max_waiting_tokens"):
        EngineConfig(model=tmp_path, max_waiting_tokens=0)
