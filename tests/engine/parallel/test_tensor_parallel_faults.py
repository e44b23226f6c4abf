"""A split engine that loses a rank goes down cleanly: in-flight requests end with an error, /healthz fails, the
fleet entry is withdrawn, and no process is left behind; a rank outlives no engine; and a split the model or the
machine cannot honour is refused at start with what to change."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis
import torch
from _support.engine_server import running_engine_server
from _support.services import RedisServer
from _support.waiting import poll
from click.testing import CliRunner
from litestar import Litestar

from loraplex.engine import LLM, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.errors import WorkerFailed
from loraplex.engine.parallel.group import rank_devices
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.registration import RegistrationConfig
from loraplex.engine.serve.server import create_engine_app
from loraplex.platform.cli import main


def _gone(pids: list[int]) -> bool:
    """None of the processes runs any more (a zombie not yet reaped counts as gone: it runs nothing)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


@pytest.mark.unit
def test_a_size_that_does_not_divide_the_heads_is_refused(checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide this model: it has 4 attention heads"):
        LLM(checkpoint("llama-gqa"), device="cpu", tensor_parallel_size=3)
    result = CliRunner().invoke(
        main, ["engine", "serve", "--model", str(checkpoint("llama-gqa")), "--tensor-parallel-size", "3"]
    )
    assert result.exit_code != 0
    assert "does not divide this model" in result.output


@pytest.mark.unit
def test_missing_devices_are_refused_before_anything_starts(checkpoint: Callable[..., Path]) -> None:
    found = torch.cuda.device_count()
    with pytest.raises(
        ValueError, match=f"needs {found + 1} CUDA devices from cuda:0 on, but this machine has {found}"
    ):
        rank_devices(torch.device("cuda"), found + 1)
    before = psutil.Process().children()
    with pytest.raises(ValueError, match="CUDA devices"):
        LLM(checkpoint("llama-gqa"), device="cuda", tensor_parallel_size=found + 2 if found else 2)
    assert psutil.Process().children() == before, "a rank was started for a machine that cannot hold the split"


@pytest.mark.unit
def test_a_rank_that_dies_between_requests_fails_the_next_one(checkpoint: Callable[..., Path]) -> None:
    llm = LLM(checkpoint("llama-gqa"), dtype="float32", device="cpu", kv_budget=2**20, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
        (pid,) = llm.engine.worker_pids
        os.kill(pid, signal.SIGKILL)
        assert poll(lambda: llm.engine.workers is not None and llm.engine.workers.failure is not None, 5.0)
        with pytest.raises(WorkerFailed, match="rank 1 exited"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
        assert _gone([pid])
    finally:
        llm.close()


@pytest.mark.integration
def test_a_rank_killed_mid_stream_takes_the_server_down_cleanly(
    checkpoint: Callable[..., Path], redis_server: RedisServer, redis_prefix: str
) -> None:
    engine_id = f"tp-{secrets.token_hex(3)}"
    key = f"{redis_prefix}fleet:engine:{engine_id}"
    client = redis.Redis.from_url(redis_server.url)
    config = EngineConfig(
        model=checkpoint("llama-gqa"), dtype="float32", device="cpu", kv_budget=2**20, tensor_parallel_size=2
    )

    async def make_app(engine: AsyncEngine, url: str) -> Litestar:
        registration = RegistrationConfig(
            redis_url=redis_server.url, engine_id=engine_id, url=url, prefix=redis_prefix, interval_s=0.5, ttl_s=10
        )
        return create_engine_app(engine, registration=registration)

    try:
        with running_engine_server(config, make_app) as (url, engine):
            assert poll(lambda: client.exists(key) == 1, 5.0), "the engine never registered"
            (pid,) = engine.core.worker_pids
            events: list[dict[str, Any]] = []
            failed: list[str] = []

            def stream() -> None:
                body = {"model": engine.model_name, "prompt": [3, 4, 5], "max_tokens": 200, "stream": True}
                body |= {"ignore_eos": True, "temperature": 0}
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line.removeprefix("data: "))
                            (failed if "error" in event else events).append(event)

            reader = threading.Thread(target=stream)
            reader.start()
            assert poll(lambda: len(events) >= 3, 10.0), "the stream never started"
            os.kill(pid, signal.SIGKILL)
            reader.join(30)
            assert not reader.is_alive(), "the stream hung after its engine lost a rank"
            assert failed, f"the stream ended without an error after {len(events)} chunks"
            assert len(events) < 200
            assert poll(lambda: httpx.get(f"{url}/healthz").status_code == 503, 5.0)
            assert poll(lambda: client.exists(key) == 0, 5.0), "the dead engine is still in the fleet"
            assert (
                httpx.post(f"{url}/v1/completions", json={"model": engine.model_name, "prompt": "x"}).status_code >= 500
            )
            assert _gone([pid])
            assert not [p for p in psutil.Process().children() if p.pid == pid]
    finally:
        client.close()


@pytest.mark.unit
def test_ranks_exit_when_the_engine_process_is_killed(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from loraplex.engine import LLM
            if __name__ == "__main__":
                llm = LLM({str(checkpoint("llama-gqa"))!r}, device="cpu", kv_budget=2**20, tensor_parallel_size=2)
                print(*llm.engine.worker_pids, flush=True)
                time.sleep(120)
            """
        )
    )
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        pids = [int(pid) for pid in process.stdout.readline().split()]
        assert len(pids) == 1 and not _gone(pids)
        process.kill()
        process.wait(10)
        assert poll(lambda: _gone(pids), 5.0), "a rank outlived its engine"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
