"""benchmarks/serve.py, the serving load generator: its statistics and draws against references, and whole runs
against a tiny engine server with one LoRA adapter (closed and open loop, chat and completions, a multi-turn trace
whose shared system prompt the prefix cache serves, and errors that are counted, not raised)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import serve
from _support.checkpoints import tiny_spec
from _support.engine_server import running_engine_server
from litestar import Litestar
from serve_stats import RequestRecord, Slo, percentile, summarize
from serve_trace import Conversation, Distribution, ModelMix, Turn, chat_trace, poisson_arrivals, synthetic_trace

from loraplex.engine import LoRARequest
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.server import create_engine_app, load_lora_modules
from loraplex.engine.tools.demo import write_random_model
from loraplex.engine.tools.demo_adapter import write_random_adapter

pytestmark = pytest.mark.unit

BASE = "tiny"
ADAPTER = "ad-0"


# --- statistics and draws ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    values = rng.lognormal(0, 1, size).tolist()
    for q in (0, 1, 33.3, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def _record(ttft_s: float, e2e_s: float, output_tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        0, 0, BASE, 0.0, 0.0, ok=ok, ttft_s=ttft_s, e2e_s=e2e_s, output_tokens=output_tokens, prompt_tokens=10
    )


def test_goodput_counts_the_ok_requests_within_both_bounds() -> None:
    records = [
        _record(0.1, 1.1, 11),  # TPOT 100 ms: good
        _record(0.3, 1.3, 11),  # TTFT 300 ms: too slow
        _record(0.1, 2.1, 11),  # TPOT 200 ms: too slow
        _record(0.15, 0.15, 1),  # one token: no TPOT, TTFT within: good
        _record(0.1, 1.1, 11, ok=False),  # an error is never good
    ]
    slo = Slo(ttft_ms=200, tpot_ms=150)
    summary = summarize(records, duration_s=2.0, slo=slo)
    assert (summary.num_ok, summary.num_errors, summary.num_good) == (4, 1, 2)
    assert summary.goodput_per_s == pytest.approx(1.0)
    assert summary.requests_per_s == pytest.approx(2.0)
    assert summary.output_tokens_per_s == pytest.approx(34 / 2)
    assert summary.tpot is not None and summary.tpot.count == 3
    assert summarize(records, 2.0, Slo()).goodput_per_s is None
    assert summarize(records, 2.0, Slo(ttft_ms=200)).num_good == 3


def test_poisson_gaps_average_one_over_the_rate() -> None:
    times = poisson_arrivals(random.Random(0), 20_000, rate=5.0)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: the deviation equals the mean
    assert poisson_arrivals(random.Random(0), 5, rate=float("inf")) == [0.0] * 5


def test_adapters_are_drawn_by_zipf_popularity_after_the_base_share() -> None:
    mix = ModelMix(BASE, ("a", "b", "c", "d"), alpha=1.0, base_share=0.2)
    rng = random.Random(0)
    counts = Counter(mix.draw(rng) for _ in range(40_000))
    assert counts[BASE] / 40_000 == pytest.approx(0.2, abs=0.01)
    assert counts["a"] > counts["b"] > counts["c"] > counts["d"]
    assert counts["a"] / counts["b"] == pytest.approx(2.0, rel=0.08)  # rank 1 over rank 2 at alpha 1
    flat = Counter(ModelMix(BASE, ("a", "b"), alpha=0.0).draw(rng) for _ in range(10_000))
    assert flat[BASE] == 0 and flat["a"] / flat["b"] == pytest.approx(1.0, rel=0.08)


def test_length_distributions() -> None:
    rng = random.Random(0)
    assert Distribution.parse("32").draw_int(rng) == 32
    uniform = [Distribution.parse("4:8").draw_int(rng) for _ in range(2000)]
    assert set(uniform) == {4, 5, 6, 7, 8}
    lognormal = Distribution.parse("lognormal:100:0.5")
    assert np.mean([lognormal.draw(rng) for _ in range(20_000)]) == pytest.approx(100, rel=0.03)
    for bad in ("", "8:4", "-1", "lognormal", "lognormal:0", "1:2:3", "x"):
        with pytest.raises(ValueError, match=r"is not|need"):
            Distribution.parse(bad)


def _send_to(body: bytes, status: int = 200) -> RequestRecord:
    """One request through `serve.send` to a fake server that answers `body` with `status`."""
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    record = RequestRecord(0, 0, BASE, 0.0, 0.0)

    async def go() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            await serve.send(client, serve.Target("http://fake"), {"model": BASE}, record, 0.0)

    asyncio.run(go())
    return record


def test_a_stream_that_fails_is_an_error_with_the_servers_message() -> None:
    chunk = b'data: {"model": "tiny", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    error = b'data: {"error": {"message": "the engine failed", "type": "internal_error"}}\n\n'
    done = b"data: [DONE]\n\n"
    failed = _send_to(chunk + error + done)
    assert (failed.ok, failed.status, failed.error) == (False, 200, "the engine failed")
    assert failed.ttft_s is not None  # what came before the error is kept
    cut = _send_to(chunk)
    assert not cut.ok and "[DONE]" in (cut.error or "")
    garbled = _send_to(chunk + b"data: {not json\n\n" + done)
    assert not garbled.ok and (garbled.error or "").startswith("JSONDecodeError")
    overloaded = _send_to(b"<html>busy</html>", status=503)
    assert (overloaded.ok, overloaded.status, overloaded.error) == (False, 503, "<html>busy</html>")
    fine = _send_to(chunk + done)
    assert fine.ok and fine.served_model == "tiny" and fine.output_tokens is None  # no usage chunk came


# --- runs against a server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("serve-driver")
    model = write_random_model(root / "model", tiny_spec(max_position_embeddings=1024))
    adapter = write_random_adapter(root / ADAPTER, ModelConfig.from_dir(model), rank=4, init_std=0.05)

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, await load_lora_modules(engine, [LoRARequest(ADAPTER, adapter)]))

    config = EngineConfig(model=model, device="cpu", kv_budget=4 * 2**20, served_model_name=BASE, num_threads=2)
    with running_engine_server(config, app) as (server_url, _):
        yield server_url


def _target(url: str, api: serve.Api = "chat") -> serve.Target:
    return serve.Target(url, api=api, extra_body={"ignore_eos": True}, timeout_s=60)


def _check_ok(records: list[RequestRecord], trace: list[Conversation]) -> None:
    by_conversation = {c.index: c for c in trace}
    for r in records:
        turn = by_conversation[r.conversation].turns[r.turn]
        assert r.ok and r.status == 200 and r.error is None, r
        assert r.served_model == r.model == by_conversation[r.conversation].model
        assert r.output_tokens == turn.max_tokens  # ignore_eos holds the length
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.prompt_tokens is not None and r.prompt_tokens > 0
        # A chunk carries one token or more (tokens that add no visible text ride with the next): at most one gap
        # per token after the first.
        assert len(r.itl_s) <= turn.max_tokens - 1
        assert r.ttft_s + sum(r.itl_s) <= r.e2e_s + 1e-9
        assert r.tpot_s is not None and r.tpot_s > 0
    assert sum(len(r.itl_s) for r in records) >= len(records)


def test_a_closed_loop_keeps_its_concurrency_and_every_request_is_answered_in_full(url: str) -> None:
    mix = ModelMix(BASE, (ADAPTER,), base_share=0.5)
    trace = synthetic_trace(
        num_requests=12, mix=mix, input_len=Distribution.parse("8:24"), output_len=Distribution.parse("4:10"), seed=1
    )
    assert {c.model for c in trace} == {BASE, ADAPTER}
    result = asyncio.run(serve.run_trace(trace, _target(url), concurrency=3))
    assert len(result.records) == 12 and result.num_unsent == 0
    _check_ok(result.records, trace)
    assert sorted(r.conversation for r in result.records) == list(range(12))
    # Never more than three requests in flight.
    events = sorted(
        [(r.sent_s, 1) for r in result.records] + [(r.sent_s + (r.e2e_s or 0), -1) for r in result.records],
        key=lambda e: (e[0], e[1]),
    )
    in_flight = np.cumsum([delta for _, delta in events])
    assert in_flight.max() == 3
    summary = summarize(result.records, result.duration_s, Slo(ttft_ms=60_000, tpot_ms=60_000))
    assert summary.num_ok == summary.num_good == 12
    assert summary.output_tokens == sum(c.turns[0].max_tokens for c in trace)


def test_an_open_loop_sends_on_the_poisson_schedule_through_completions(url: str) -> None:
    trace = synthetic_trace(
        num_requests=6,
        mix=ModelMix(BASE, (ADAPTER,)),
        input_len=Distribution.parse("16"),
        output_len=Distribution.parse("6"),
        rate=10.0,
        seed=2,
    )
    result = asyncio.run(serve.run_trace(trace, _target(url, "completions")))
    _check_ok(result.records, trace)
    for r in result.records:
        assert r.sent_s >= r.scheduled_s - 1e-3 and r.sent_s - r.scheduled_s < 0.5
    assert result.duration_s >= trace[-1].start_s


def test_a_multi_turn_chat_resends_its_history_and_reuses_the_cached_system_prompt(url: str) -> None:
    trace = chat_trace(
        num_tenants=1,
        conversations_per_tenant=2,
        mix=ModelMix(BASE),
        turns=Distribution.parse("3"),
        system_len=Distribution.parse("96"),
        question_len=Distribution.parse("8"),
        answer_len=Distribution.parse("6"),
        think_s=Distribution.parse("0"),
    )
    result = asyncio.run(serve.run_trace(trace, _target(url), concurrency=1))
    _check_ok(result.records, trace)
    assert [(r.conversation, r.turn) for r in result.records] == [(c, t) for c in (0, 1) for t in range(3)]
    records = result.records
    for earlier, later in itertools.pairwise(records):
        if later.turn:  # the history holds the previous question and answer
            assert later.prompt_tokens is not None and earlier.prompt_tokens is not None
            assert later.prompt_tokens > earlier.prompt_tokens + (earlier.output_tokens or 0)
            assert later.cached_tokens
    assert records[3].turn == 0 and records[3].cached_tokens  # the second conversation reuses the system prompt
    summary = summarize(records, result.duration_s, Slo())
    assert summary.cached_share is not None and summary.cached_share > 0.3


def test_errors_are_recorded_and_counted_never_raised(url: str) -> None:
    trace = [
        Conversation(0, 0.0, BASE, None, (Turn("hello there", 4, 0.0),)),
        Conversation(1, 0.0, "no-such-model", None, (Turn("hello there", 4, 0.0), Turn("and again", 4, 0.0))),
    ]
    result = asyncio.run(serve.run_trace(trace, _target(url), concurrency=2))
    by_conversation = {r.conversation: r for r in result.records}
    assert by_conversation[0].ok
    failed = by_conversation[1]
    assert not failed.ok and failed.status == 404 and "no-such-model" in (failed.error or "")
    assert result.num_unsent == 1  # its second turn had no answer to follow
    summary = summarize(result.records, result.duration_s, Slo(), result.num_unsent)
    assert (summary.num_ok, summary.num_errors, summary.num_unsent) == (1, 1, 1)
    assert list(summary.errors) == [f"404: {failed.error}"]

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    down = asyncio.run(serve.run_trace(trace[:1], _target(closed)))
    assert [(r.ok, r.status) for r in down.records] == [(False, None)]
    assert "ConnectError" in (down.records[0].error or "")


def test_the_command_line_writes_its_result_file(url: str, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    serve.main(
        [
            *("--base-url", url, "--concurrency", "2", "--num-requests", "4", "--input-len", "8"),
            *("--output-len", "3", "--adapters", ADAPTER, "--base-share", "0.5", "--api-key", "secret"),
            *("--slo-ttft-ms", "60000", "--out", str(out), "--no-progress"),
        ]
    )
    document = json.loads(out.read_text())
    assert document["server"]["models"][0] == BASE  # the base model's name came from /v1/models
    assert document["config"]["api_key"] == "***"
    summary = document["summary"]
    assert (summary["num_ok"], summary["num_errors"], summary["num_good"]) == (4, 0, 4)
    assert summary["output_tokens"] == 12
    assert {r["model"] for r in document["requests"]} <= {BASE, ADAPTER}
    assert all(r["tpot_s"] is not None for r in document["requests"])
