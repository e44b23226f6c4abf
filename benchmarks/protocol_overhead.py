"""What each agent protocol adds on the engine server over chat completions of the same request (issue 36).

A `loraplex engine serve` of the demo model answers the same conversation as a chat completion, as OpenAI's
response (POST /v1/responses) and as Anthropic's message (POST /v1/messages), each of which the server converts into
that chat and back, greedy and with the same token limit, so all run the same tokens through the engine and differ
by the protocol's conversion and writing alone. One keep-alive client takes them in turn, --requests of each, in two
modes: `whole` (non-streamed, one token: where
the protocol's share of a request is largest) and `streamed` (STREAM_TOKENS tokens, read to the end of the stream).
Reported: p50 / p90 latency of each, and what each protocol adds: the median over rounds of its latency less chat's
in the same round.

    .venv/bin/python benchmarks/protocol_overhead.py [--requests 200]

writes benchmarks/results/protocol_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from serve_launch import launched_engine, machine  # siblings: benchmarks/ is on sys.path when a script in it runs

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "protocol_overhead.json"
DEMO = REPO / "demo" / "model"
NAME = "loraplex-demo"
MESSAGES = [{"role": "user", "content": 'Tell me about the "for" statement.'}]
STREAM_TOKENS = 16
WARMUP = 5


def _requests(tokens: int, stream: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    chat: dict[str, Any] = {"model": NAME, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    message: dict[str, Any] = {"model": NAME, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    response: dict[str, Any] = {"model": NAME, "input": MESSAGES, "max_output_tokens": tokens, "temperature": 0}
    if stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
        message |= {"stream": True}
        response |= {"stream": True}
    return {
        "chat": ("/v1/chat/completions", chat),
        "responses": ("/v1/responses", response),
        "messages": ("/v1/messages", message),
    }


def _timed(client: httpx.Client, path: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    if body.get("stream"):
        with client.stream("POST", path, json=body) as response:
            response.raise_for_status()
            for _ in response.iter_bytes():
                pass
    else:
        client.post(path, json=body).raise_for_status()
    return (time.perf_counter() - started) * 1000


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": statistics.median(ordered), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))]}


def measure(client: httpx.Client, requests: int, tokens: int, stream: bool) -> dict[str, Any]:
    paths = _requests(tokens, stream)
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths.items())
    for index in range(WARMUP + requests):
        rotated = order[index % len(order) :] + order[: index % len(order)]  # each protocol first in turn
        for name, (path, body) in rotated:
            elapsed = _timed(client, path, body)
            if index >= WARMUP:
                times[name].append(elapsed)
    figures: dict[str, Any] = {name: _summary(values) for name, values in times.items()}
    figures["tokens"] = tokens
    # Paired: each round sends every protocol once, so the median of the rounds' differences cancels the drift of a
    # shared machine that the difference of two medians keeps.
    figures["added_p50_ms"] = {
        name: statistics.median(p - c for p, c in zip(times[name], times["chat"], strict=True))
        for name in paths
        if name != "chat"
    }
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests of each protocol per mode")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    modes: dict[str, Any] = {}
    with (
        launched_engine(DEMO, served_model_name=NAME, engine_args=["--dtype", "float32"]) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):
        for mode, (tokens, stream) in {"whole": (1, False), "streamed": (STREAM_TOKENS, True)}.items():
            modes[mode] = figures = measure(client, args.requests, tokens, stream)
            added = ", ".join(f"{name} {value:+.3f} ms" for name, value in figures["added_p50_ms"].items())
            print(f"{mode}: chat {figures['chat']['p50_ms']:.2f} ms p50; added: {added}")
    document = {"machine": machine(os.cpu_count() or 1), "requests": args.requests, "modes": modes}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
