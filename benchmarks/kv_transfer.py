"""KV transfer between two engines against recomputing: bytes per prompt token, time to fetch a prompt's blocks, and
time to first token with and without them.

Two `loraplex engine serve` processes of the benchmark model (~56M random Llama, float32, 8 layers, 4 KV heads of
64; context 8,192), one thread each, with an API key (which KV transfer needs), A and B:
1. Prefill and decode apart, prompts of 256 to 4,096 tokens (`--lengths`): B computing a fresh prompt (one token
   out: its prefill) against A prefilling it (pinned) and B decoding from A's blocks (fetch, adopt, the last block's
   tokens, one token out); and the fetch alone (POST /v1/kv/blocks for the prompt's hashes), with its body's bytes
   per token. Median of `--repeats`, each on a prompt of its own.
2. Chat turns across replicas: a conversation's turns went to A; its next turn (history of 512 to 4,096 tokens and a
   question of 32) goes to B, streamed, which either computes the history itself or pulls A's cached blocks of it
   first (what the platform asks of it when balance moves a prefix: `kv_transfer_params` without a transfer id).
   Time to first token as the client sees it.

    .venv/bin/python benchmarks/kv_transfer.py [--lengths 256,512,1024,2048,4096] [--repeats 3]

writes benchmarks/results/kv_transfer.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serve_launch import launched_engine, machine
from suite import commit

from loraplex.engine.memory.prefix_cache import chain_hashes
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.tools.demo import BENCHMARK_SPEC, write_random_model

RESULTS = Path(__file__).parent / "results" / "kv_transfer.json"
KEY = "kv-transfer-benchmark"
HEADERS = {"Authorization": f"Bearer {KEY}"}
BLOCK = 16
QUESTION = 32


class Engine:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, headers=HEADERS, timeout=600)

    def complete(self, prompt: list[int], **extra: Any) -> tuple[float, dict[str, Any]]:
        """Seconds to the whole answer (one token out unless `extra` says otherwise), and the answer."""
        body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True} | extra
        started = time.perf_counter()
        response = self.client.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - started
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return elapsed, answer

    def first_token(self, prompt: list[int], **extra: Any) -> float:
        """Seconds to the first streamed token: the stream's first chunk of a one-token answer (a random model's
        tokens often have no text, and a chunk without text waits for the next token's)."""
        body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True} | extra
        started = time.perf_counter()
        with self.client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and '"choices":[{' in line:
                    return time.perf_counter() - started
        raise RuntimeError("the stream ended without a token")

    def kv(self) -> dict[str, int]:
        stats: dict[str, int] = self.client.get("/v1/state").json()["kv_transfer"]
        return stats


def prompt_of(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(length)]


def apart(a: Engine, b: Engine, length: int, repeats: int, rng: random.Random, vocab: int) -> dict[str, Any]:
    recompute, transfer, fetch, bytes_per_token = [], [], [], []
    for _ in range(repeats):
        recompute.append(b.complete(prompt_of(rng, length, vocab))[0])

        prompt = prompt_of(rng, length, vocab)
        _, first = a.complete(prompt, kv_transfer_params={"do_remote_decode": True})
        params = first["kv_transfer_params"]
        imported = b.kv()["imported_tokens"]
        transfer.append(b.complete(prompt, kv_transfer_params={"do_remote_prefill": True, **params})[0])
        assert b.kv()["imported_tokens"] - imported == params["num_blocks"] * BLOCK, "the decode did not adopt"

        hashes = [h.hex() for h in chain_hashes(prompt, None, None, BLOCK, (length - 1) // BLOCK)]
        started = time.perf_counter()
        response = a.client.post("/v1/kv/blocks", json={"block_hashes": hashes})
        fetch.append(time.perf_counter() - started)
        response.raise_for_status()
        bytes_per_token.append(len(response.content) / (len(hashes) * BLOCK))
    return {
        "prompt_tokens": length,
        "recompute_s": statistics.median(recompute),
        "transfer_s": statistics.median(transfer),
        "fetch_s": statistics.median(fetch),
        "bytes_per_token": statistics.median(bytes_per_token),
    }


def chat_turn(a: Engine, b: Engine, history: int, repeats: int, rng: random.Random, vocab: int) -> dict[str, Any]:
    recompute, pulled = [], []
    for _ in range(repeats):
        for into in (recompute, pulled):
            conversation = prompt_of(rng, history, vocab)
            a.complete(conversation)  # the earlier turns went to A: its cache holds the history
            turn = conversation + prompt_of(rng, QUESTION, vocab)
            extra = {"kv_transfer_params": {"do_remote_prefill": True, "remote_url": a.url}} if into is pulled else {}
            into.append(b.first_token(turn, **extra))
    return {
        "history_tokens": history,
        "question_tokens": QUESTION,
        "ttft_recompute_s": statistics.median(recompute),
        "ttft_prefix_pull_s": statistics.median(pulled),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--histories", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    histories = [int(v) for v in args.histories.split(",")]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        spec = dataclasses.replace(BENCHMARK_SPEC, torch_dtype="float32", max_position_embeddings=8192)
        model = write_random_model(Path(tmp) / "model", spec)
        config = ModelConfig.from_dir(model)
        engine_args = ["--api-key", KEY, "--num-threads", "1", "--kv-budget", "1GiB", "--served-model-name", "bench"]
        engine_args += ["--max-num-batched-tokens", "8192"]
        with (
            launched_engine(model, engine_args=engine_args) as url_a,
            launched_engine(model, engine_args=engine_args) as url_b,
        ):
            a, b = Engine(url_a), Engine(url_b)
            a.complete(prompt_of(rng, 64, config.vocab_size))  # first requests warm both up
            b.complete(prompt_of(rng, 64, config.vocab_size))
            separate = []
            for length in lengths:
                separate.append(apart(a, b, length, args.repeats, rng, config.vocab_size))
                print(json.dumps(separate[-1]), flush=True)
            turns = []
            for history in histories:
                turns.append(chat_turn(a, b, history, args.repeats, rng, config.vocab_size))
                print(json.dumps(turns[-1]), flush=True)
    document = {
        "benchmark": "kv_transfer",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "machine": machine(1),
        "model": {
            "num_layers": config.num_layers,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "dtype": "float32",
            "parameters": config.num_parameters(),
        },
        # K and V of every layer for one token: what a block's page holds per token.
        "kv_bytes_per_token": 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4,
        "prefill_decode": separate,
        "chat_turns": turns,
        "repeats": args.repeats,
    }
    RESULTS.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
