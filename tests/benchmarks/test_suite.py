"""The serving suite's naive peer (benchmarks/naive_server.py) against transformers + peft, and the suite's result
file (benchmarks/suite.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import suite
import torch
import uvicorn
from _support.checkpoints import tiny_spec
from naive_server import NaiveScheduler, chat_prompt_ids, create_app
from suite_assets import write_model

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo_adapter import write_random_adapter

pytestmark = pytest.mark.unit

BASE = "tiny"
ADAPTERS = ("ad-a", "ad-b")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the time of the day"}]


@dataclasses.dataclass(frozen=True)
class Served:
    url: str
    scheduler: NaiveScheduler
    model_dir: Path
    adapters: dict[str, Path]


@contextlib.contextmanager
def _serving(scheduler: NaiveScheduler) -> Iterator[str]:
    """The naive server's app on uvicorn in a thread; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(scheduler), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("naive")
    model_dir = write_model(root / BASE, tiny_spec(max_position_embeddings=1024))
    config = ModelConfig.from_dir(model_dir)
    adapters = {
        name: write_random_adapter(root / name, config, rank=4, seed=i, init_std=0.2) for i, name in enumerate(ADAPTERS)
    }
    num_threads = torch.get_num_threads()
    scheduler = NaiveScheduler.load(model_dir, list(adapters.items()), max_batch_size=8, base_name=BASE)
    with _serving(scheduler) as url:
        yield Served(url, scheduler, model_dir, adapters)
    torch.set_num_threads(num_threads)


def _reference(served: Served, adapter: str | None, max_tokens: int) -> str:
    """transformers' greedy answer to MESSAGES, with `adapter` merged into the base by peft (None: the base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    model = AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, served.adapters[adapter]).merge_and_unload()
    ids = torch.tensor([chat_prompt_ids(tokenizer, MESSAGES)])
    with torch.inference_mode():
        out = model.eval().generate(
            ids,
            attention_mask=torch.ones_like(ids),  # (without it, generate masks the prompt's ids equal to the pad id)
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False))


def test_a_streamed_chat_through_the_openai_sdk_is_the_merged_models_greedy_answer(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [BASE, *ADAPTERS]
    answers = {}
    for model in (ADAPTERS[0], ADAPTERS[1], BASE, ADAPTERS[0]):  # merged, switched, unmerged, merged again
        stream = client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed, not in one piece
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
        assert answers.setdefault(model, text) == text
    assert answers[ADAPTERS[0]] == _reference(served, ADAPTERS[0], 12)
    assert answers[ADAPTERS[1]] == _reference(served, ADAPTERS[1], 12)
    assert answers[BASE] == _reference(served, None, 12)
    assert len(set(answers.values())) == 3  # the adapters change the answer
    missing = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


@dataclasses.dataclass
class _Timed:
    sent: float
    first: float | None = None
    last: float | None = None
    streaming: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set at the first text


async def _stream(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, timed: _Timed) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line and json.loads(line[5:])["choices"][0]["delta"]:
                timed.first = timed.first or time.perf_counter()
                timed.last = time.perf_counter()
                timed.streaming.set()


def test_another_adapters_request_waits_for_the_running_batch_and_the_oldest_goes_next(served: Served) -> None:
    """A long request of adapter A runs; B, then A again, arrive during it. B waits for A's batch to end; the second
    A is not added to the running batch, and waits behind B (the oldest waiting request)."""

    async def scenario() -> tuple[_Timed, _Timed, _Timed]:
        async with httpx.AsyncClient(timeout=60) as client:
            first_a = _Timed(time.perf_counter())
            running = asyncio.create_task(_stream(client, served.url, ADAPTERS[0], 300, first_a))
            await first_a.streaming.wait()  # A's batch is running
            b = _Timed(time.perf_counter())
            waiting_b = asyncio.create_task(_stream(client, served.url, ADAPTERS[1], 4, b))
            await asyncio.sleep(0.05)
            second_a = _Timed(time.perf_counter())
            await asyncio.gather(running, waiting_b, _stream(client, served.url, ADAPTERS[0], 4, second_a))
            return first_a, b, second_a

    batches = served.scheduler.num_batches
    first_a, b, second_a = asyncio.run(scenario())
    assert first_a.last is not None and b.first is not None and b.last is not None and second_a.first is not None
    assert b.sent < second_a.sent < first_a.last  # both arrived while A's batch ran
    assert b.first > first_a.last  # B waited for it to end
    assert second_a.first > b.last  # and went before the later request of A
    assert served.scheduler.num_batches - batches == 3


def test_the_quick_suite_writes_the_documented_result_file(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    suite.main(["--quick", "--only", "pool_budget,rank_mix", "--out", str(out), "--no-progress"])
    document = json.loads(out.read_text())
    assert set(document) >= {"machine", "commit", "date", "duration_s", "quick", "models", "headline", "sweeps"}
    assert set(document["machine"]) == {
        "cpu",
        "cpu_model",
        "cpu_capability",
        "isa_level",
        "native_level",
        "amx",
        "kind",
        "threads",
        "torch",
    }
    assert document["quick"] is True and document["headline"] == []
    datetime.datetime.fromisoformat(document["date"])
    assert document["models"]["large"] is None
    assert set(document["models"]["small"]) == {"parameters", "hidden", "layers"}
    assert 50e6 < document["models"]["small"]["parameters"] < 60e6
    sweeps = document["sweeps"]
    assert set(sweeps) >= {"adapters", "rank_mix", "rate", "prefix_cache", "pool_budget"}
    assert sweeps["adapters"] == sweeps["rate"] == sweeps["prefix_cache"] == []
    assert [p["ranks"] for p in sweeps["rank_mix"]] == ["8", "8-64"]
    for point in sweeps["rank_mix"]:
        summary = point["summary"]
        assert summary["num_errors"] == 0 and summary["num_ok"] == summary["num_requests"] > 0
        assert summary["output_tokens_per_s"] > 0 and summary["ttft"]["count"] == summary["num_ok"]
        assert summary["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 250.0}
    pool = sweeps["pool_budget"]
    assert [p["budget_mib"] for p in pool] == sorted(p["budget_mib"] for p in pool)
    assert all(p["unified_resident"] >= p["padded_resident"] for p in pool)
    assert pool[-1]["unified_resident"] > pool[-1]["padded_resident"] > pool[0]["padded_resident"]
