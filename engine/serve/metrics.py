"""Prometheus metrics of one engine server.

Each server app owns an `EngineMetrics` with its own registry (never prometheus_client's global one), so two
apps in one process, as in tests, never share or double-register series. Request counters and latency
histograms are recorded by the server as requests end; load gauges (running, waiting, pool pages, preemptions)
are read from the engine's latest state snapshot when scraped, so they can never drift from it.

Beside loraplex's own names, `VllmMetrics` adds vLLM's, with vLLM's types, labels and bucket edges, so that an
endpoint picker of the Gateway API Inference Extension configured for vLLM (its model-server protocol, proposal 003),
and dashboards written for vLLM, read this server unchanged (decision 0042): the gauges `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction, 0 to 1; also as `vllm:gpu_cache_usage_perc`, its
deprecated name, which endpoint pickers up to v1.0 read by default) and `vllm:lora_requests_info`, and the
histograms `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:request_queue_time_seconds`
and `vllm:e2e_request_latency_seconds`, each labelled `model_name` (the served model name, adapters' requests too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from loraplex.engine.core.engine_state import EngineState  # these metrics only read the engine's snapshot
    from loraplex.engine.memory.page_pool import PoolUsage

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the classic text format every Prometheus version scrapes

_PREFIX = "loraplex_engine"
# Seconds: from tens of milliseconds (short prompts on a GPU) to minutes (long generations on a CPU).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# vLLM's bucket edges (its PrometheusStatLogger), so that quantiles queried from our vllm: histograms mean what they
# mean on vLLM's.
_VLLM_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_VLLM_ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0),
    *(2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_VLLM_REQUEST_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0),
    *(40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished engine request, as the server saw it."""

    finish_reason: str  # stop | length | abort (client went away) | error
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    time_to_first_token_s: float | None  # None when no token came out
    latency_s: float
    adapter: str = ""  # the LoRA adapter's name; "" for the base model
    num_reasoning_tokens: int = 0  # of the generated tokens, those of its think block
    queue_time_s: float | None = None  # from entering the engine to its first scheduling; None: never seen running
    # Between consecutive outputs that brought new tokens, as the server received them (one per step after the
    # first token, as vLLM's inter-token latency: a step that emits several tokens counts once).
    inter_token_latencies_s: tuple[float, ...] = ()


class _StateCollector(Collector):
    """Reads the engine's state snapshot at scrape time."""

    def __init__(
        self,
        state: Callable[[], EngineState],
        is_healthy: Callable[[], bool],
        refusals: Callable[[], Mapping[tuple[str, int], int]],
    ) -> None:
        self._state = state
        self._is_healthy = is_healthy
        self._refusals = refusals

    def collect(self) -> Iterable[Metric]:
        state = self._state()
        yield GaugeMetricFamily(f"{_PREFIX}_healthy", "1 while the engine thread serves requests.", self._is_healthy())
        yield GaugeMetricFamily(f"{_PREFIX}_num_requests_running", "Requests being generated.", state.num_running)
        yield GaugeMetricFamily(f"{_PREFIX}_num_requests_waiting", "Requests queued for a slot.", state.num_waiting)
        yield GaugeMetricFamily(f"{_PREFIX}_pool_pages_total", "Pages in the memory pool.", state.pool.num_pages)
        yield GaugeMetricFamily(f"{_PREFIX}_pool_pages_free", "Free pages in the memory pool.", state.pool.num_free)
        used = GaugeMetricFamily(f"{_PREFIX}_pool_pages_used", "Pages in use, by kind.", labels=["kind"])
        for kind, count in sorted(state.pool.by_kind.items()):
            used.add_metric([kind], count)
        yield used
        yield GaugeMetricFamily(f"{_PREFIX}_pool_page_bytes", "Bytes per page (all layers).", state.pool.page_bytes)
        yield CounterMetricFamily(
            f"{_PREFIX}_preemptions", "Requests preempted (recomputed later) for lack of pages.", state.num_preemptions
        )
        yield CounterMetricFamily(f"{_PREFIX}_steps", "Engine steps run.", state.num_steps)
        yield CounterMetricFamily(
            f"{_PREFIX}_interleaved_steps",
            "Of the steps, those run between two layers of a longer one, for newly arrived requests.",
            state.num_interleaved_steps,
        )
        paths = GaugeMetricFamily(
            f"{_PREFIX}_operator_path",
            "1 for the implementation each hot operator runs (a native CPU level, torch or triton).",
            labels=["operator", "path"],
        )
        for operator, path in state.operators:
            paths.add_metric([operator, path], 1)
        yield paths
        yield GaugeMetricFamily(
            f"{_PREFIX}_weight_bytes", "Bytes of model weights held (quantized ones with scales).", state.weight_bytes
        )
        yield GaugeMetricFamily(
            f"{_PREFIX}_num_tokens_waiting", "Tokens the waiting requests have to compute.", state.num_waiting_tokens
        )
        yield from self._fairness(state)
        yield from self._speculation(state)

    def _speculation(self, state: EngineState) -> Iterable[Metric]:
        """Speculative decoding per adapter ("" the base model): proposed, kept and emitted tokens, the acceptance
        rate (kept / proposed) and the mean accepted length (kept per verifying row-step)."""
        if not state.speculation:
            return
        labels = ["lora_name"]
        proposed = CounterMetricFamily(
            f"{_PREFIX}_spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.", labels=labels
        )
        accepted = CounterMetricFamily(
            f"{_PREFIX}_spec_decode_num_accepted_tokens", "Proposed tokens kept by verification.", labels=labels
        )
        emitted = CounterMetricFamily(
            f"{_PREFIX}_spec_decode_num_emitted_tokens",
            "Tokens emitted by row-steps that verified proposals (kept + one each).",
            labels=labels,
        )
        rate = GaugeMetricFamily(
            f"{_PREFIX}_spec_decode_acceptance_rate", "Kept / proposed speculative tokens since start.", labels=labels
        )
        length = GaugeMetricFamily(
            f"{_PREFIX}_spec_decode_mean_accepted_length",
            "Proposed tokens kept per row-step that verified proposals, since start.",
            labels=labels,
        )
        for name, counts in state.speculation:
            proposed.add_metric([name], counts.num_proposed)
            accepted.add_metric([name], counts.num_accepted)
            emitted.add_metric([name], counts.num_emitted)
            rate.add_metric([name], counts.num_accepted / counts.num_proposed if counts.num_proposed else 0.0)
            length.add_metric([name], counts.num_accepted / counts.num_steps if counts.num_steps else 0.0)
        yield from (proposed, accepted, emitted, rate, length)

    def _fairness(self, state: EngineState) -> Iterable[Metric]:
        """Fair share: queues per fairness key and priority, each key's VTC books, refusals of a full queue."""
        labels = ["fairness_key", "priority"]
        waiting = GaugeMetricFamily(
            f"{_PREFIX}_fairness_requests_waiting", "Requests waiting, by fairness key and priority.", labels=labels
        )
        running = GaugeMetricFamily(
            f"{_PREFIX}_fairness_requests_running", "Requests running, by fairness key and priority.", labels=labels
        )
        for queue in state.queues:
            waiting.add_metric([queue.fairness_key, str(queue.priority)], queue.num_waiting)
            running.add_metric([queue.fairness_key, str(queue.priority)], queue.num_running)
        yield waiting
        yield running
        service = GaugeMetricFamily(
            f"{_PREFIX}_fairness_service",
            "Each fairness key's Virtual Token Counter (weighted service; idle keys are lifted to the lowest active).",
            labels=["fairness_key"],
        )
        served = CounterMetricFamily(
            f"{_PREFIX}_fairness_served_tokens",
            "Tokens computed (prompt and generated), by fairness key.",
            labels=["fairness_key"],
        )
        preempted = CounterMetricFamily(
            f"{_PREFIX}_fairness_preemptions", "Requests preempted, by fairness key.", labels=["fairness_key"]
        )
        for key in state.keys:
            service.add_metric([key.fairness_key], key.service)
            served.add_metric([key.fairness_key], key.num_served_tokens)
            preempted.add_metric([key.fairness_key], key.num_preemptions)
        yield service
        yield served
        yield preempted
        refused = CounterMetricFamily(
            f"{_PREFIX}_requests_refused",
            "Requests refused with 503 overloaded (the waiting queue was full), by fairness key and priority.",
            labels=labels,
        )
        for (key_name, priority), count in sorted(self._refusals().items()):
            refused.add_metric([key_name, str(priority)], count)
        yield refused


class EngineMetrics:
    def __init__(
        self,
        state: Callable[[], EngineState],
        is_healthy: Callable[[], bool],
        refusals: Callable[[], Mapping[tuple[str, int], int]] = dict,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{_PREFIX}_requests",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(f"{_PREFIX}_prompt_tokens", "Prompt tokens processed.", registry=self.registry)
        self.cached_prompt_tokens = Counter(
            f"{_PREFIX}_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=self.registry
        )
        self.generation_tokens = Counter(f"{_PREFIX}_generation_tokens", "Tokens generated.", registry=self.registry)
        self.reasoning_tokens = Counter(
            f"{_PREFIX}_reasoning_tokens", "Of the tokens generated, those of think blocks.", registry=self.registry
        )
        # Hit rate per adapter = hit / queried. The platform's own /metrics has it per tenant (the engine never
        # learns tenants: it sees only their cache salts).
        self.prefix_queried_tokens = Counter(
            f"{_PREFIX}_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache, by adapter ('' for the base model).",
            ["adapter"],
            registry=self.registry,
        )
        self.prefix_hit_tokens = Counter(
            f"{_PREFIX}_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache, by adapter ('' for the base model).",
            ["adapter"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            f"{_PREFIX}_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            f"{_PREFIX}_request_latency_seconds",
            "From request arrival to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(state, is_healthy, refusals))

    def record(self, record: RequestRecord) -> None:
        self.requests.labels(record.finish_reason).inc()
        self.prompt_tokens.inc(record.num_prompt_tokens)
        self.cached_prompt_tokens.inc(record.num_cached_tokens)
        self.prefix_queried_tokens.labels(record.adapter).inc(record.num_prompt_tokens)
        self.prefix_hit_tokens.labels(record.adapter).inc(record.num_cached_tokens)
        self.generation_tokens.inc(record.num_generated_tokens)
        self.reasoning_tokens.inc(record.num_reasoning_tokens)
        if record.time_to_first_token_s is not None:
            self.time_to_first_token.observe(record.time_to_first_token_s)
        self.request_latency.observe(record.latency_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series; serve it with CONTENT_TYPE."""
        return generate_latest(self.registry)


class LoraMetrics:
    """Per-adapter series of the server's adapter names, added to its `EngineMetrics` registry: finished requests
    by name and finish reason (recorded), and how many adapters are resident and named (read when scraped)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        num_resident: Callable[[], int],
        num_names: Callable[[], int],
    ) -> None:
        self.requests = Counter(
            f"{_PREFIX}_lora_requests",
            "Finished requests that ran with an adapter, by adapter name and finish reason.",
            ["lora_name", "finish_reason"],
            registry=registry,
        )
        registry.register(_LoraCollector(num_resident, num_names))

    def record(self, lora_name: str, finish_reason: str) -> None:
        self.requests.labels(lora_name, finish_reason).inc()


class _LoraCollector(Collector):
    def __init__(self, num_resident: Callable[[], int], num_names: Callable[[], int]) -> None:
        self._num_resident = num_resident
        self._num_names = num_names

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            f"{_PREFIX}_lora_adapters_resident", "Adapters whose weights are in pool pages.", self._num_resident()
        )
        yield GaugeMetricFamily(
            f"{_PREFIX}_lora_adapters_registered", "Adapter names the server answers to.", self._num_names()
        )


class VllmMetrics:
    """vLLM's names for the same server, added to its `EngineMetrics` registry: the request histograms (recorded as
    requests end, from the same records as ours) and the load gauges (read from the engine's snapshot when scraped).

    Every series carries `model_name`, the served model name, whatever adapter a request ran with (as vLLM labels
    them), so their label sets stay one per server; adapter names appear only in `vllm:lora_requests_info`.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        state: Callable[[], EngineState],
        *,
        model_name: str,
        max_lora: int,
    ) -> None:
        """`max_lora`: how many distinct adapters can run at once; requests of more wait (vLLM's --max-loras)."""

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _VLLM_TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _VLLM_ITL_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _VLLM_REQUEST_BUCKETS,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _VLLM_REQUEST_BUCKETS
        )
        registry.register(_VllmStateCollector(state, model_name, max_lora))

    def record(self, record: RequestRecord) -> None:
        if record.time_to_first_token_s is not None:
            self.time_to_first_token.observe(record.time_to_first_token_s)
        for interval in record.inter_token_latencies_s:
            self.inter_token_latency.observe(interval)
        if record.queue_time_s is not None:
            self.queue_time.observe(record.queue_time_s)
        self.e2e_latency.observe(record.latency_s)


def _kv_cache_usage(pool: PoolUsage) -> float:
    """The fraction of the pool that new requests cannot have: pages held and not evictable, so the KV blocks of
    running requests and the adapters they pin. Adapters and KV share the pool, so a pinned adapter's pages are room
    no KV block can take; unreferenced prefix-cache blocks and idle adapters are evicted on demand, so they count as
    free, as vLLM counts its cached blocks that no request holds."""
    if pool.num_pages == 0:
        return 0.0
    return (pool.num_pages - pool.num_free - pool.num_evictable) / pool.num_pages


def _adapter_list(names: Sequence[str], limit: int) -> str:
    """A label value of `vllm:lora_requests_info`: the first `limit` names, sorted, joined by commas (no spaces: the
    endpoint picker splits on the comma alone). Names holding a comma are left out, since they would read as two."""
    return ",".join(sorted([name for name in names if "," not in name][:limit]))


class _VllmStateCollector(Collector):
    def __init__(self, state: Callable[[], EngineState], model_name: str, max_lora: int) -> None:
        self._state = state
        self._model_name = model_name
        self._max_lora = max_lora

    def collect(self) -> Iterable[Metric]:
        state = self._state()
        model = [self._model_name]
        usage = _kv_cache_usage(state.pool)
        for name, description, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", state.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", state.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage (pool pages held by running requests' KV and adapters).",
                usage,
            ),
            # vLLM's deprecated name of the same gauge, which endpoint pickers up to v1.0 read by default.
            (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage (the same as vllm:kv_cache_usage_perc).",
                usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, description, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        # vLLM's shape: the value is when the lists were read (the picker takes the series with the latest), the
        # lists are label values. Each list holds at most max_lora names: that bounds the label values and leaves the
        # picker's test "room for one more adapter" (running and waiting names listed < max_lora) answered as the
        # untruncated lists would answer it.
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        lora.add_metric(
            [
                str(self._max_lora),
                _adapter_list(state.waiting_adapters, self._max_lora),
                _adapter_list(state.running_adapters, self._max_lora),
            ],
            time.time(),
        )
        yield lora
