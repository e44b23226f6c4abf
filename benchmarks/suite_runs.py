"""How the serving suite (benchmarks/suite.py) runs one measurement: the traces it sends (serve_trace's), the servers
it starts (the loraplex engine and the naive peer, each in a process of its own), and one trace sent to one server
with serve.py's driver and summarized with serve_stats'."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from naive_server import launched_naive_server
from rich.console import Console
from serve import Target, run_trace, run_with_progress, summary_document
from serve_launch import launched_engine
from serve_stats import Slo, summarize
from serve_trace import Conversation, Distribution, ModelMix, Turn, chat_trace, random_words, synthetic_trace

logger = logging.getLogger(__name__)

# The engine's page pool (KV blocks and resident adapters): fixed, so a run does not depend on the memory free.
KV_BUDGET = "1GiB"
# Every request: greedy (the naive server's only mode; sampled at temperature 1, a random model's flat distribution
# mostly picks padding ids that write no text) and held to its max_tokens.
REQUEST_FIELDS: dict[str, Any] = {"temperature": 0, "ignore_eos": True}
WARM_UP_CONCURRENCY = 8
WARM_UP_SEED = 10_000


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Single-turn requests over the first `num_adapters` adapters of a set (Zipf popularity of exponent
    `zipf_alpha`): a closed loop of `concurrency` clients, or Poisson arrivals at `rate` per second. Lengths are
    serve_trace distributions: words in, tokens out (ignore_eos holds every answer to its length)."""

    num_requests: int
    input_len: str
    output_len: str
    num_adapters: int
    concurrency: int | None = None
    rate: float | None = None
    zipf_alpha: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a trace has either a concurrency or a rate")

    def trace(self, base_model: str, adapters: Sequence[str]) -> list[Conversation]:
        if self.num_adapters > len(adapters):
            raise ValueError(f"the trace asks for {self.num_adapters} adapters, the set has {len(adapters)}")
        return synthetic_trace(
            num_requests=self.num_requests,
            mix=ModelMix(base_model, tuple(adapters[: self.num_adapters]), self.zipf_alpha),
            input_len=Distribution.parse(self.input_len),
            output_len=Distribution.parse(self.output_len),
            rate=self.rate,
            seed=self.seed,
        )

    def describe(self) -> dict[str, Any]:
        arrivals = "closed loop" if self.concurrency is not None else "poisson"
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return {"arrivals": arrivals, **fields, "input_len": f"{self.input_len} words", "output_len": self.output_len}


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    """Multi-turn chats (serve_trace's chat_trace): each tenant a system prompt and an adapter, its conversations
    starting as Poisson arrivals at `rate` per second, `think_s` between an answer and the next question."""

    num_tenants: int
    conversations_per_tenant: int
    turns: str
    system_len: str
    question_len: str
    answer_len: str
    think_s: str
    rate: float
    seed: int = 0

    def trace(self, base_model: str, adapters: Sequence[str]) -> list[Conversation]:
        return chat_trace(
            num_tenants=self.num_tenants,
            conversations_per_tenant=self.conversations_per_tenant,
            mix=ModelMix(base_model, tuple(adapters)),
            turns=Distribution.parse(self.turns),
            system_len=Distribution.parse(self.system_len),
            question_len=Distribution.parse(self.question_len),
            answer_len=Distribution.parse(self.answer_len),
            think_s=Distribution.parse(self.think_s),
            rate=self.rate,
            seed=self.seed,
        )


@dataclasses.dataclass(frozen=True)
class Runner:
    """Starts servers and sends traces, all with the run's thread count, SLO and console."""

    console: Console
    slo: Slo
    threads: int
    progress: bool = True

    @contextlib.contextmanager
    def loraplex(
        self, model_dir: Path, loras: Sequence[tuple[str, Path]], *, engine_args: Sequence[str] = ()
    ) -> Iterator[str]:
        """`loraplex engine serve` on `model_dir` with `loras`; yields its URL."""
        args = ["--num-threads", str(self.threads), "--kv-budget", KV_BUDGET, *engine_args]
        with launched_engine(model_dir, [f"{name}={path}" for name, path in loras], engine_args=args) as url:
            yield url

    @contextlib.contextmanager
    def naive(self, model_dir: Path, loras: Sequence[tuple[str, Path]]) -> Iterator[str]:
        """benchmarks/naive_server.py on `model_dir` with `loras`; yields its URL."""
        with launched_naive_server(model_dir, loras, threads=self.threads) as url:
            yield url

    def drive(
        self, trace: Sequence[Conversation], url: str, *, label: str, concurrency: int | None = None
    ) -> dict[str, Any]:
        """Send `trace` to the server at `url` (REQUEST_FIELDS in every body); its summary as result files hold it."""
        target = Target(url, extra_body=dict(REQUEST_FIELDS))
        if self.progress:
            result = run_with_progress(trace, target, concurrency=concurrency, console=self.console, description=label)
        else:
            result = asyncio.run(run_trace(trace, target, concurrency=concurrency))
        summary = summarize(result.records, result.duration_s, self.slo, result.num_unsent)
        if summary.num_errors:
            logger.warning("%s: %d requests failed: %s", label, summary.num_errors, summary.errors)
        return summary_document(summary)

    def warm_up(self, url: str, models: Sequence[str]) -> None:
        """One short request to each of `models`, outside the clock: first-call allocations, and each adapter loaded
        into the server as it would be after serving a while."""
        rng = random.Random(WARM_UP_SEED)  # words of their own: no prefix shared with a measured trace's prompts
        trace = [
            Conversation(i, 0.0, model, None, (Turn(random_words(rng, 16), 2, 0.0),)) for i, model in enumerate(models)
        ]
        target = Target(url, extra_body=dict(REQUEST_FIELDS))
        result = asyncio.run(run_trace(trace, target, concurrency=WARM_UP_CONCURRENCY))
        failed = [r for r in result.records if not r.ok]
        if failed:
            raise RuntimeError(f"warm-up of {url} failed: {failed[0].status} {failed[0].error}")
