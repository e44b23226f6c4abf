"""vLLM's metric names on the engine server's /metrics (issue 22, point 2): what an endpoint picker of the Gateway API
Inference Extension configured for vLLM reads (its model-server protocol), and the request histograms vLLM's
dashboards query, with vLLM's types, labels and bucket edges, beside loraplex's own series.

One tiny random model with one sequence slot and two adapters: a long request holds the slot while another waits, so
the running and waiting adapters, the queue and the pool are seen while they hold; a scrape is parsed as Prometheus
parses it."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from _support.adapters import make_peft_adapter
from _support.checkpoints import tiny_spec
from _support.engine_server import running_engine_server
from _support.waiting import wait_for
from litestar import Litestar
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_state import EngineState
from loraplex.engine.lora.ref import LoRARequest
from loraplex.engine.memory.page_pool import PoolUsage
from loraplex.engine.serve.async_engine import AsyncEngine
from loraplex.engine.serve.metrics import VllmMetrics
from loraplex.engine.serve.server import create_engine_app, load_lora_modules
from loraplex.engine.tools.demo import write_random_model

pytestmark = pytest.mark.unit

MODEL = "tiny-vllm"
MAX_LORAS = 4
MAX_ADAPTERS_PER_BATCH = 2  # the lower of the two is how many adapters can run at once: vLLM's max_lora
NO_EOS: dict[str, Any] = {"ignore_eos": True, "temperature": 0}

GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)
LORA_INFO = "vllm:lora_requests_info"
# Each histogram with the bucket edges vLLM gives it (vllm/v1/metrics/loggers.py), +Inf last.
REQUEST_EDGES = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "vllm:time_to_first_token_seconds": (
        *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0),
        *(80.0, 160.0, 640.0, 2560.0, float("inf")),
    ),
    "vllm:inter_token_latency_seconds": (
        *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0),
        *(80.0, float("inf")),
    ),
    "vllm:request_queue_time_seconds": (*REQUEST_EDGES, 480.0, 960.0, 1920.0, 7680.0, float("inf")),
    "vllm:e2e_request_latency_seconds": (*REQUEST_EDGES, 480.0, 960.0, 1920.0, 7680.0, float("inf")),
}
TTFT, ITL, QUEUE, E2E = HISTOGRAMS


@dataclass(frozen=True)
class Server:
    url: str
    engine: AsyncEngine

    def scrape(self) -> dict[str, Metric]:
        response = httpx.get(f"{self.url}/metrics")
        assert response.status_code == 200
        return {family.name: family for family in text_string_to_metric_families(response.text)}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{self.url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    @contextlib.contextmanager
    def stream(self, path: str, body: dict[str, Any]) -> Iterator[Iterator[str]]:
        """A streamed request held open while the block runs (its 200 means the engine has queued it); yields its
        non-empty lines. Leaving the block early closes the connection, which aborts the request."""
        with (
            httpx.Client(base_url=self.url, timeout=60) as client,
            client.stream("POST", path, json={**body, "stream": True}) as response,
        ):
            assert response.status_code == 200
            yield (line for line in response.iter_lines() if line)

    def idle(self) -> bool:
        state = self.engine.state()
        return state.num_running == 0 and state.num_waiting == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("vllm-metrics")
    base = write_random_model(root / "base", tiny_spec(4096))
    adapters = [
        LoRARequest(
            name, make_peft_adapter(base, root / name, seed=seed, r=8, lora_alpha=16, target_modules="all-linear")
        )
        for seed, name in enumerate(("first", "second"), start=1)
    ]
    config = EngineConfig(
        model=base,
        device="cpu",
        kv_budget=2**22,
        served_model_name=MODEL,
        num_threads=1,
        max_num_seqs=1,
        max_loras=MAX_LORAS,
        max_adapters_per_batch=MAX_ADAPTERS_PER_BATCH,
    )

    async def app(engine: AsyncEngine, url: str) -> Litestar:
        return create_engine_app(engine, await load_lora_modules(engine, adapters))

    with running_engine_server(config, app) as (url, engine):
        yield Server(url, engine)


def _only_sample(family: Metric) -> tuple[dict[str, str], float]:
    assert len(family.samples) == 1, f"{family.name}: {family.samples}"
    sample = family.samples[0]
    return sample.labels, sample.value


def _value(families: dict[str, Metric], name: str, suffix: str = "") -> float:
    """The one sample of `name` + `suffix` (e.g. `_count`) in a family of vLLM's names, checked to carry
    model_name alone."""
    samples = [s for s in families[name].samples if s.name == name + suffix]
    assert len(samples) == 1, f"{name}{suffix}: {samples}"
    assert samples[0].labels == {"model_name": MODEL}
    return samples[0].value


def _lora_info(families: dict[str, Metric]) -> tuple[dict[str, str], float]:
    family = families[LORA_INFO]
    assert family.type == "gauge"
    return _only_sample(family)


# --- names, types, labels ----------------------------------------------------------------------------------------


def test_every_vllm_name_has_vllm_type_labels_and_buckets(server: Server) -> None:
    wait_for(server.idle, what="an idle engine")
    families = server.scrape()
    for name in GAUGES:
        assert families[name].type == "gauge", name
        labels, _ = _only_sample(families[name])
        assert labels == {"model_name": MODEL}, name
    for name, edges in HISTOGRAMS.items():
        family = families[name]
        assert family.type == "histogram", name
        buckets = [s for s in family.samples if s.name == f"{name}_bucket"]
        assert tuple(float(s.labels["le"]) for s in buckets) == edges, name
        assert all({k: v for k, v in s.labels.items() if k != "le"} == {"model_name": MODEL} for s in buckets), name
        assert {s.name for s in family.samples} == {f"{name}_bucket", f"{name}_count", f"{name}_sum"}, name
        assert _value(families, name, "_count") == buckets[-1].value  # the +Inf bucket holds every observation
    # vLLM's LoRA gauge: no model_name; its value is when the lists were read, which the picker sorts series by.
    before = time.time()
    labels, value = _lora_info(server.scrape())
    assert labels == {"max_lora": str(MAX_ADAPTERS_PER_BATCH), "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before - 1 <= value <= time.time() + 1
    # Ours stay beside them.
    for name in ("loraplex_engine_num_requests_running", "loraplex_engine_time_to_first_token_seconds"):
        assert name in families


# --- the request histograms --------------------------------------------------------------------------------------


def test_every_request_is_observed_once_and_its_times_are_ordered(server: Server) -> None:
    wait_for(server.idle, what="an idle engine")
    before = server.scrape()
    max_tokens = [5, 7, 6, 4]
    server.post("/v1/completions", {"model": MODEL, "prompt": "Base, whole", "max_tokens": max_tokens[0], **NO_EOS})
    chat = {"messages": [{"role": "user", "content": "Base, streamed"}], "max_tokens": max_tokens[1], **NO_EOS}
    with server.stream("/v1/chat/completions", {"model": MODEL, **chat}) as lines:
        assert list(lines)[-1] == "data: [DONE]"
    answer = server.post(
        "/v1/chat/completions",
        {
            "model": "first",
            "messages": [{"role": "user", "content": "An adapter"}],
            "max_tokens": max_tokens[2],
            **NO_EOS,
        },
    )
    assert answer["model"] == "first" and answer["usage"]["completion_tokens"] == max_tokens[2]
    body = {"model": "second", "prompt": "Another adapter, streamed", "max_tokens": max_tokens[3], **NO_EOS}
    with server.stream("/v1/completions", body) as lines:
        events = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    def grew(name: str, suffix: str) -> float:
        return _value(server.scrape(), name, suffix) - _value(before, name, suffix)

    wait_for(lambda: grew(E2E, "_count") == 4, what="every request's end recorded")
    # One observation per request, adapters' requests too (under the base model's name, as vLLM labels them)...
    assert grew(TTFT, "_count") == grew(QUEUE, "_count") == grew(E2E, "_count") == 4
    # ...and one inter-token latency per token after each request's first (one token per step, no speculation).
    assert grew(ITL, "_count") == sum(n - 1 for n in max_tokens)
    # Per request, queue <= TTFT <= e2e and the gaps between tokens fit in its e2e: so do the sums.
    queue, ttft, itl, e2e = (grew(name, "_sum") for name in (QUEUE, TTFT, ITL, E2E))
    assert 0 <= queue <= ttft <= e2e
    assert 0 < itl <= e2e
    # The same records feed our own histogram.
    ours = "loraplex_engine_time_to_first_token_seconds"
    assert _count(server.scrape(), ours) - _count(before, ours) == 4


def _count(families: dict[str, Metric], name: str) -> float:
    return next(s.value for s in families[name].samples if s.name == f"{name}_count")


# --- the load gauges and the adapters, while requests run and wait ------------------------------------------------


def test_running_and_waiting_requests_and_their_adapters_show_while_they_hold(server: Server) -> None:
    wait_for(server.idle, what="an idle engine")
    before = server.scrape()
    holder = {"model": "first", "prompt": [5 + i for i in range(20)], "max_tokens": 3000, **NO_EOS}
    waiter = {"model": "second", "prompt": "I wait for the slot", "max_tokens": 4, **NO_EOS}
    engine = server.engine
    with contextlib.ExitStack() as holding:
        held = holding.enter_context(server.stream("/v1/completions", holder))
        next(held)  # its first token: it runs
        with server.stream("/v1/completions", waiter) as waiting:
            wait_for(lambda: engine.state().num_waiting == 1, what="the second request to wait")
            waited_from = time.monotonic()
            families = server.scrape()
            assert _value(families, "vllm:num_requests_running") == 1
            assert _value(families, "vllm:num_requests_waiting") == 1
            usage = _value(families, "vllm:kv_cache_usage_perc")
            assert 0 < usage <= 1  # the running request's blocks and its pinned adapter
            labels, _ = _lora_info(families)
            assert labels == {
                "max_lora": str(MAX_ADAPTERS_PER_BATCH),
                "running_lora_adapters": "first",
                "waiting_lora_adapters": "second",
            }
            steps = engine.state().num_steps
            wait_for(lambda: engine.state().num_steps >= steps + 20, what="the holder to go on generating")
            assert engine.state().num_waiting == 1
            released_at = time.monotonic()
            holding.close()  # the holder's client leaves: it is aborted, and the waiting request runs
            done = [json.loads(line.removeprefix("data: ")) for line in waiting if line != "data: [DONE]"]
            assert done[-1]["choices"][0]["finish_reason"] == "length"

    def grew(name: str, suffix: str) -> float:
        return _value(server.scrape(), name, suffix) - _value(before, name, suffix)

    wait_for(lambda: grew(E2E, "_count") == 2, what="both requests' ends recorded")
    assert grew(QUEUE, "_count") == 2
    # The second request waited at least from when it was seen waiting until the slot was given up.
    assert grew(QUEUE, "_sum") >= released_at - waited_from > 0

    wait_for(server.idle, what="an idle engine")
    families = server.scrape()
    assert _value(families, "vllm:num_requests_running") == _value(families, "vllm:num_requests_waiting") == 0
    # Idle: the prefix cache's blocks and the idle adapters are evictable, so none of the pool counts as used.
    assert _value(families, "vllm:kv_cache_usage_perc") == 0
    labels, _ = _lora_info(families)
    assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""


# --- the adapter lists' bounds -----------------------------------------------------------------------------------


def test_adapter_lists_hold_at_most_max_lora_names_and_never_split_a_name() -> None:
    state = EngineState(
        num_waiting=5,
        num_running=2,
        pool=PoolUsage(num_pages=10, num_free=4, page_bytes=1, by_kind={"kv": 5, "adapter": 1}, num_evictable=2),
        num_preemptions=0,
        num_steps=0,
        running_adapters=("zeta", "alpha"),
        waiting_adapters=("x,y", "delta", "beta", "gamma"),
    )
    registry = CollectorRegistry(auto_describe=True)
    VllmMetrics(registry, lambda: state, model_name=MODEL, max_lora=2)
    assert registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": MODEL}) == pytest.approx(0.4)
    assert registry.get_sample_value("vllm:gpu_cache_usage_perc", {"model_name": MODEL}) == pytest.approx(0.4)
    lora = next(m for m in registry.collect() if m.name == LORA_INFO)
    labels, _ = _only_sample(lora)
    # Sorted; a name with a comma would read as two names, so it is left out; the first max_lora names in queue order.
    assert labels == {"max_lora": "2", "running_lora_adapters": "alpha,zeta", "waiting_lora_adapters": "beta,delta"}
