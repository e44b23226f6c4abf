"""A serving load generator: drives any OpenAI-compatible server (a loraplex engine, the platform with a tenant key,
vLLM or another peer) with a trace and measures what its clients would see.

The trace (benchmarks/serve_trace.py), seeded:
- synthetic: `--num-requests` single-turn requests of `--input-len` random words and `--output-len` tokens out
  (each "N", "LOW:HIGH" or "lognormal:MEAN[:SIGMA]");
- `--chat`: multi-turn conversations, `--conversations-per-tenant` for each of `--num-tenants` tenants, each tenant
  with its own system prompt (`--system-len` words) and model; every turn resends the history (the answers the
  server gave) plus a new question, after `--think-s` seconds;
- `--trace FILE`: a JSON trace in serve_trace's shape.
Models: `--base-share` of the requests (or tenants) go to the base model, the rest to adapters (`--adapters a,b` or
`--num-adapters N --adapter-prefix lora-`) drawn with Zipf popularity of exponent `--zipf-alpha`. Arrivals: a Poisson
process at `--rate` requests (conversations) per second, or a closed loop of `--concurrency` clients, each sending
its next request when the previous one is answered. Output lengths are held to the drawn `max_tokens` with
`ignore_eos` (the engine's and vLLM's extra; `--output-control min-tokens` for the platform, which refuses unknown
fields; `--extra-body JSON` adds any other field).

Per request it records (streaming, `stream_options.include_usage`) the time to first token (the first chunk that
carries text), the gaps between text-bearing chunks (a chunk may carry several tokens), the end-to-end latency, the
prompt, output and cached tokens of the closing usage chunk, and the HTTP status and message of an error. It reports
requests/s and tokens/s, goodput under an SLO (`--slo-ttft-ms`, `--slo-tpot-ms`) and the mean, p50, p90 and p99 of
TTFT, TPOT ((e2e - ttft) / (output tokens - 1)), ITL and E2E.

    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8100 --rate 4 --num-requests 200 \\
        --adapters upper,terse --base-share 0.2 --input-len 64:192 --output-len 64 [--api-key KEY]
    .venv/bin/python benchmarks/serve.py --launch-engine demo/model --lora upper=demo/adapters/upper \\
        --lora terse=demo/adapters/terse --engine-args "--num-threads 2" --concurrency 4 --chat

`--launch-engine MODEL_DIR` starts `loraplex engine serve` on a free port for the run (its log goes to a temporary
file, named if it fails) and stops it afterwards. Writes benchmarks/results/serve.json (`--out`): the config, the
machine, the server's model list, the summary and every request's record; prints the summary.

As a library (a sweep driver): build a trace with serve_trace's `synthetic_trace` / `chat_trace`, send it with
`run_trace(trace, target, concurrency=...)`, summarize with serve_stats' `summarize`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from serve_launch import EngineLaunchError, launched_engine
from serve_stats import RequestRecord, Slo, Summary, summarize, summary_table
from serve_trace import Conversation, Distribution, ModelMix, chat_trace, load_trace, num_turns, synthetic_trace

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "serve.json"
Api = Literal["chat", "completions"]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where requests go and what every body carries besides the turn's own fields."""

    base_url: str  # without /v1
    api: Api = "chat"
    api_key: str | None = None
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)  # merged into every request last
    min_tokens_equal_max: bool = False  # send min_tokens = max_tokens (servers without ignore_eos)
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return f"{self.base_url.rstrip('/')}/v1/{'chat/completions' if self.api == 'chat' else 'completions'}"


@dataclasses.dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]  # in completion order
    num_unsent: int  # turns never sent: their conversation's earlier turn failed
    duration_s: float  # from the run's start to its last answer


# --- one request ---------------------------------------------------------------------------------------------------


def request_body(target: Target, conversation: Conversation, turn: int, answers: Sequence[str]) -> dict[str, Any]:
    """The body of `conversation`'s turn `turn`, given the answers to its earlier turns."""
    spec = conversation.turns[turn]
    body: dict[str, Any] = {
        "model": conversation.model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.min_tokens_equal_max:
        body["min_tokens"] = spec.max_tokens
    history = [(conversation.turns[i].question, answers[i]) for i in range(turn)]
    if target.api == "chat":
        messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
        for question, answer in history:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        body["messages"] = [*messages, {"role": "user", "content": spec.question}]
    else:
        parts = [conversation.system] if conversation.system else []
        parts += [f"User: {question}\nAssistant: {answer}" for question, answer in history]
        body["prompt"] = "\n\n".join([*parts, f"User: {spec.question}\nAssistant:"])
    body.update(target.extra_body)
    return body


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message") or payload["error"])
    return str(payload)[:500]


def _chunk_text(chunk: dict[str, Any], api: Api) -> tuple[str, str]:
    """A chunk's answer text and its reasoning text (chat's reasoning_content), over its choices."""
    if api == "completions":
        return "".join(choice.get("text") or "" for choice in chunk.get("choices") or ()), ""
    deltas = [choice.get("delta") or {} for choice in chunk.get("choices") or ()]
    return "".join(d.get("content") or "" for d in deltas), "".join(d.get("reasoning_content") or "" for d in deltas)


async def send(
    client: httpx.AsyncClient, target: Target, body: dict[str, Any], record: RequestRecord, t0: float
) -> str:
    """Send one streaming request and fill `record` in; returns the answer's text (content only, for the next turn).
    Never raises for what the server or the network does: that is recorded as the request's error."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    parts: list[str] = []
    start = time.perf_counter()
    record.sent_s = start - t0
    last: float | None = None
    usage: dict[str, Any] | None = None
    done = False
    try:
        async with client.stream("POST", target.url, json=body, headers=headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                raw = await response.aread()
                try:
                    record.error = _error_message(json.loads(raw))
                except ValueError:
                    record.error = raw.decode(errors="replace")[:500]
                return ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"a chunk that is not a JSON object: {data[:100]}")
                if "error" in chunk:
                    record.error = _error_message(chunk)
                    return ""
                record.served_model = chunk.get("model", record.served_model)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                content, reasoning = _chunk_text(chunk, target.api)
                parts.append(content)
                if content or reasoning:
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        record.error = f"{type(exc).__name__}: {exc}"
        return ""
    record.e2e_s = time.perf_counter() - start
    if not done:
        record.error = "the stream ended without data: [DONE]"
        return ""
    if usage is not None:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    record.ok = True
    return "".join(parts)


# --- a run ---------------------------------------------------------------------------------------------------------


async def run_trace(
    trace: Sequence[Conversation],
    target: Target,
    *,
    concurrency: int | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_unsent: Callable[[int], None] | None = None,
) -> RunResult:
    """Send `trace` to `target`: open loop (every conversation starts at its `start_s`) or, with `concurrency`, a
    closed loop of that many clients taking conversations in trace order. A conversation's turns go one after the
    other, each `think_s` after the previous answer; an error ends its conversation. `on_record` sees every record as
    it completes, `on_unsent` the number of turns an error left unsent (a progress bar's two feeds)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    records: list[RequestRecord] = []
    unsent = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(target.timeout_s, connect=min(30.0, target.timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def converse(conversation: Conversation, due_s: float) -> None:
            nonlocal unsent
            answers: list[str] = []
            for turn, spec in enumerate(conversation.turns):
                if turn:
                    await asyncio.sleep(spec.think_s)
                    due_s = time.perf_counter() - t0
                record = RequestRecord(conversation.index, turn, conversation.model, scheduled_s=due_s, sent_s=due_s)
                body = request_body(target, conversation, turn, answers)
                answers.append(await send(client, target, body, record, t0))
                records.append(record)
                if on_record is not None:
                    on_record(record)
                if not record.ok:
                    left = len(conversation.turns) - turn - 1
                    unsent += left
                    if on_unsent is not None and left:
                        on_unsent(left)
                    return

        if concurrency is None:
            tasks: list[asyncio.Task[None]] = []
            for conversation in sorted(trace, key=lambda c: c.start_s):
                delay = conversation.start_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(converse(conversation, conversation.start_s)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(trace)

            async def client_loop() -> None:
                for conversation in queue:  # one iterator shared by the clients: each takes the next
                    await converse(conversation, time.perf_counter() - t0)

            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    return RunResult(records, unsent, duration)


def run_with_progress(
    trace: Sequence[Conversation],
    target: Target,
    *,
    concurrency: int | None,
    console: Console,
    description: str = "requests",
) -> RunResult:
    """`run_trace` with a progress bar of requests answered (rich), labelled `description`."""
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=num_turns(trace), errors=0)
        errors = 0

        def on_record(record: RequestRecord) -> None:
            nonlocal errors
            errors += not record.ok
            progress.update(task, advance=1, errors=errors)

        def on_unsent(count: int) -> None:
            progress.update(task, advance=count)

        return asyncio.run(run_trace(trace, target, concurrency=concurrency, on_record=on_record, on_unsent=on_unsent))


# --- the command line ----------------------------------------------------------------------------------------------


def list_models(base_url: str, api_key: str | None) -> list[str]:
    """The ids /v1/models lists (an engine lists its base model first, then its adapters); [] when it fails."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return [str(card["id"]) for card in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        logger.warning("GET /v1/models failed: %s", exc)
        return []


def build_trace(args: argparse.Namespace, base_model: str) -> list[Conversation]:
    if args.trace is not None:
        return load_trace(args.trace)
    if args.adapters is not None:
        adapters = tuple(name.strip() for name in args.adapters.split(",") if name.strip())
    elif args.num_adapters:
        adapters = tuple(f"{args.adapter_prefix}{i}" for i in range(args.num_adapters))
    else:
        adapters = tuple(spec.partition("=")[0].strip() for spec in args.lora)
    mix = ModelMix(base_model, adapters, args.zipf_alpha, args.base_share)
    rate = args.rate if args.concurrency is None else None
    if args.chat:
        return chat_trace(
            num_tenants=args.num_tenants,
            conversations_per_tenant=args.conversations_per_tenant,
            mix=mix,
            turns=args.turns,
            system_len=args.system_len,
            question_len=args.input_len,
            answer_len=args.output_len,
            think_s=args.think_s,
            rate=rate,
            seed=args.seed,
        )
    return synthetic_trace(
        num_requests=args.num_requests,
        mix=mix,
        input_len=args.input_len,
        output_len=args.output_len,
        rate=rate,
        seed=args.seed,
    )


def _distribution(text: str) -> Distribution:
    try:
        return Distribution.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8100", help="The server, without /v1.")
    server.add_argument("--api", choices=("chat", "completions"), default="chat", help="The route to drive.")
    server.add_argument("--api-key", default=None, help="Sent as a bearer token (the platform's tenant key).")
    server.add_argument("--model", default=None, help="The base model's name (default: the first /v1/models lists).")
    server.add_argument("--timeout", type=float, default=600.0, help="Seconds a request may take.")
    server.add_argument(
        "--launch-engine", type=Path, default=None, metavar="MODEL_DIR", help="Start `loraplex engine serve` on it."
    )
    server.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="An adapter to launch with.")
    server.add_argument("--engine-args", default="", help='More `engine serve` flags, e.g. "--num-threads 2".')

    load = parser.add_argument_group("load (one of)").add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="Poisson arrivals per second (inf: all at once).")
    load.add_argument("--concurrency", type=int, help="Clients in a closed loop.")

    trace = parser.add_argument_group("trace")
    trace.add_argument("--num-requests", type=int, default=200, help="Single-turn requests (without --chat).")
    trace.add_argument("--input-len", type=_distribution, default="128", help="Words per prompt (chat: per question).")
    trace.add_argument("--output-len", type=_distribution, default="128", help="max_tokens of each request.")
    trace.add_argument("--adapters", default=None, help="Adapter names, most popular first (default: --lora's).")
    trace.add_argument("--num-adapters", type=int, default=0, help="Or N adapters named PREFIX0..PREFIX{N-1}.")
    trace.add_argument("--adapter-prefix", default="lora-")
    trace.add_argument("--zipf-alpha", type=float, default=1.0, help="Adapter popularity: rank k has 1/k**alpha.")
    trace.add_argument("--base-share", type=float, default=0.0, help="Fraction of requests to the base model.")
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--chat", action="store_true", help="Multi-turn conversations instead of single requests.")
    trace.add_argument("--num-tenants", type=int, default=4, help="Tenants (system prompts) of --chat.")
    trace.add_argument("--conversations-per-tenant", type=int, default=3)
    trace.add_argument("--turns", type=_distribution, default="3:6", help="Turns per conversation.")
    trace.add_argument("--system-len", type=_distribution, default="256", help="Words of a tenant's system prompt.")
    trace.add_argument("--think-s", type=_distribution, default="0.3:1.2", help="Seconds between answer and question.")
    trace.add_argument("--trace", type=Path, default=None, help="Replay a JSON trace instead (serve_trace's shape).")

    body = parser.add_argument_group("request body")
    body.add_argument(
        "--output-control",
        choices=("ignore-eos", "min-tokens", "none"),
        default="ignore-eos",
        help="Hold outputs to max_tokens: ignore_eos (engine, vLLM) or min_tokens = max_tokens (also the platform).",
    )
    body.add_argument("--extra-body", type=_json_object, default={}, help="JSON fields added to every request.")

    report = parser.add_argument_group("report")
    report.add_argument("--slo-ttft-ms", type=float, default=None, help="Goodput: TTFT bound.")
    report.add_argument("--slo-tpot-ms", type=float, default=None, help="Goodput: TPOT bound.")
    report.add_argument("--out", type=Path, default=RESULTS, help="The result file.")
    report.add_argument("--no-progress", action="store_true", help="No progress bar.")
    args = parser.parse_args(argv)
    if args.rate is not None and not args.rate > 0:
        parser.error("--rate must be positive")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if not 0 <= args.base_share <= 1:
        parser.error("--base-share must be within [0, 1]")
    if args.zipf_alpha < 0:
        parser.error("--zipf-alpha must be at least 0")
    return args


def _config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key == "api_key":
            value = "***" if value else None  # never written to a result file
        elif isinstance(value, Distribution):
            value = value.describe()
        elif isinstance(value, Path):
            value = str(value)
        config[key] = value
    return config


def run(args: argparse.Namespace, base_url: str, console: Console) -> dict[str, Any]:
    models = list_models(base_url, args.api_key)
    base_model = args.model or (models[0] if models else None)
    if base_model is None:
        raise SystemExit("no --model given and /v1/models listed none")
    trace = build_trace(args, base_model)
    extra: dict[str, Any] = {"ignore_eos": True} if args.output_control == "ignore-eos" else {}
    target = Target(
        base_url=base_url,
        api=args.api,
        api_key=args.api_key,
        extra_body={**extra, **args.extra_body},
        min_tokens_equal_max=args.output_control == "min-tokens",
        timeout_s=args.timeout,
    )
    logger.info("%d conversations, %d requests to %s", len(trace), num_turns(trace), target.url)
    if args.no_progress:
        result = asyncio.run(run_trace(trace, target, concurrency=args.concurrency))
    else:
        result = run_with_progress(trace, target, concurrency=args.concurrency, console=console)
    summary = summarize(result.records, result.duration_s, Slo(args.slo_ttft_ms, args.slo_tpot_ms), result.num_unsent)
    console.print(summary_table(summary))
    return result_document(args, base_url, models, summary, result)


def result_document(
    args: argparse.Namespace, base_url: str, models: list[str], summary: Summary, result: RunResult
) -> dict[str, Any]:
    records = [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in result.records]
    return {
        "benchmark": "serve",
        "config": _config(args),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "system": platform.platform(),
            "python": platform.python_version(),
        },
        "server": {"base_url": base_url, "models": models},
        "summary": summary_document(summary),
        "requests": records,
    }


def summary_document(summary: Summary) -> dict[str, Any]:
    """A run's summary as result files hold it (this one's and the suite's): latencies in ms, the SLO, the errors."""
    return dataclasses.asdict(summary)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    console = Console()
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if args.launch_engine is not None:
            engine = launched_engine(
                args.launch_engine, args.lora, served_model_name=args.model, engine_args=shlex.split(args.engine_args)
            )
            try:
                base_url = stack.enter_context(engine)
            except EngineLaunchError as exc:
                raise SystemExit(f"serve.py: {exc}") from None
        document = run(args, base_url, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
