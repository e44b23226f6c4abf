"""Disaggregated prefill and decode between two `loraplex engine serve` processes, driven as the platform drives them:
the prefill engine answers with its pinned blocks' transfer id, the decode engine fetches them and produces exactly
the tokens one engine does (greedy, base model and LoRA); a prefill engine killed before or during the transfer, or
a peer sending blocks that are not the request's, costs the decode engine a recompute, never the request; pinned
blocks are freed once their time to live runs out."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from _support.adapters import make_peft_adapter
from _support.checkpoints import VOCAB
from _support.waiting import poll

from loraplex.engine.memory.prefix_cache import chain_hashes
from loraplex.engine.serve.kv_transfer import decode_blocks, encode_blocks

pytestmark = pytest.mark.unit

KEY = "kv-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 10


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Engine:
    url: str
    process: subprocess.Popen[bytes]

    def complete(self, model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body | extra, headers=HEADERS, timeout=60)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def kv(self) -> dict[str, int]:
        stats: dict[str, int] = httpx.get(f"{self.url}/v1/state", headers=HEADERS).json()["kv_transfer"]
        return stats


@contextlib.contextmanager
def engines(base: Path, adapter: Path, *roles: list[str]) -> Iterator[list[Engine]]:
    """One `loraplex engine serve` process per extra-argument list, all up before the block runs."""
    started: list[Engine] = []
    try:
        for extra in roles:
            port = _free_port()
            command = [
                str(Path(sys.executable).with_name("loraplex")), "engine", "serve", "--model", str(base),
                "--port", str(port), "--api-key", KEY, "--kv-budget", "4MiB", "--max-model-len", "256",
                "--lora", f"adapter={adapter}", "--num-threads", "1", "--served-model-name", "base", *extra,
            ]  # fmt: skip
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started.append(Engine(f"http://127.0.0.1:{port}", process))
        for engine in started:

            def up(engine: Engine = engine) -> bool:
                assert engine.process.poll() is None, "an engine server exited while starting"
                try:
                    return httpx.get(f"{engine.url}/healthz", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            assert poll(up, 90.0), "an engine server did not start"
        yield started
    finally:
        for engine in started:
            if engine.process.poll() is None:
                engine.process.send_signal(signal.SIGINT)
        for engine in started:
            try:
                engine.process.wait(15)
            except subprocess.TimeoutExpired:
                engine.process.kill()


@pytest.fixture(scope="module")
def assets(checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = checkpoint("llama-gqa")
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("kv-adapter") / "a", seed=3, r=8, lora_alpha=16,
                                target_modules="all-linear")  # fmt: skip
    return base, adapter


@pytest.fixture(scope="module")
def fleet(assets: tuple[Path, Path]) -> Iterator[list[Engine]]:
    """A prefill engine (pins for 3 s), a decode engine, and a lone engine to compare with."""
    base, adapter = assets
    with engines(
        base,
        adapter,
        ["--role", "prefill", "--kv-transfer-ttl", "3"],
        ["--role", "decode", "--kv-fetch-timeout", "2"],
        [],
    ) as started:
        yield started


def _prompt(seed: int, length: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(length)]


def _tokens(answer: dict[str, Any]) -> str:
    text: str = answer["choices"][0]["text"]
    return text


@pytest.mark.parametrize("model", ["base", "adapter"])
def test_a_decode_from_a_prefill_engine_gives_one_engines_tokens(model: str, fleet: list[Engine]) -> None:
    prefill, decode, alone = fleet
    prompt = _prompt(1 if model == "adapter" else 2)
    first = prefill.complete(model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["num_blocks"] == 4 and params["remote_url"] == prefill.url and params["num_cached_tokens"] == 0
    before = decode.kv()
    answer = decode.complete(model, prompt, kv_transfer_params={"do_remote_prefill": True, **params})
    assert _tokens(answer) == _tokens(alone.complete(model, prompt))
    after = decode.kv()
    assert after["imported_tokens"] - before["imported_tokens"] == 4 * 16, "the decode engine computed it all"
    assert after["fetch_failures"] == before["fetch_failures"]
    # Billed as one engine would have: the prompt was computed (on the prefill engine), not found in a cache.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert prefill.kv()["pinned_transfers"] == 0, "the fetch releases the pin"


def test_pinned_blocks_are_freed_after_their_time_to_live(fleet: list[Engine]) -> None:
    prefill = fleet[0]
    prefill.complete("base", _prompt(3), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert prefill.kv()["pinned_pages"] == 4
    assert poll(lambda: prefill.kv()["pinned_pages"] == 0, 8.0), "the pin outlived its time to live"
    state = httpx.get(f"{prefill.url}/v1/state", headers=HEADERS).json()
    assert state["pool"]["num_free"] + state["pool"]["num_evictable"] == state["pool"]["num_pages"]


class _FakePeer(BaseHTTPRequestHandler):
    """Answers POST /v1/kv/blocks with `body`, or with half of it before hanging up (`cut`)."""

    body = b""
    cut = False

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body[: len(self.body) // 2] if self.cut else self.body)
        if self.cut:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *_: Any) -> None:
        pass


@contextlib.contextmanager
def fake_peer(body: bytes, *, cut: bool = False) -> Iterator[str]:
    handler = type("Peer", (_FakePeer,), {"body": body, "cut": cut})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.mark.parametrize("tamper", ["hash", "tokens", "cut"])
def test_blocks_that_are_not_the_requests_are_refused_and_recomputed(tamper: str, fleet: list[Engine]) -> None:
    prefill, decode, alone = fleet
    prompt = _prompt(4 + len(tamper))
    params = prefill.complete("base", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"
    ]
    # The real blocks, fetched as the decode engine would, then altered.
    response = httpx.post(
        f"{prefill.url}/v1/kv/blocks",
        json={"block_hashes": _hashes_of(prompt), "transfer_id": params["transfer_id"], "release": True},
        headers=HEADERS,
    )
    assert response.status_code == 200
    blocks = decode_blocks(response.content)
    assert blocks.num_blocks == 4
    if tamper == "hash":
        blocks.hashes[0] = bytes(32)
    elif tamper == "tokens":
        blocks.tokens[0] = tuple(reversed(blocks.tokens[0]))
    before = decode.kv()
    with fake_peer(encode_blocks(blocks), cut=tamper == "cut") as url:
        answer = decode.complete(
            "base", prompt, kv_transfer_params={"do_remote_prefill": True, **params, "remote_url": url}
        )
    assert _tokens(answer) == _tokens(alone.complete("base", prompt))
    after = decode.kv()
    assert after["imported_tokens"] == before["imported_tokens"], "blocks that are not the request's were adopted"
    assert after["fetch_failures"] - before["fetch_failures"] == (1 if tamper == "cut" else 0)


def _hashes_of(prompt: list[int]) -> list[str]:
    """The chained hashes of the prompt's blocks, as an engine computes them (no salt, no adapter)."""
    return [h.hex() for h in chain_hashes(prompt, None, None, 16, (len(prompt) - 1) // 16)]


def test_a_killed_prefill_engine_costs_the_decode_engine_a_recompute(
    assets: tuple[Path, Path], fleet: list[Engine]
) -> None:
    _, decode, alone = fleet
    with engines(*assets, ["--role", "prefill"]) as (prefill,):
        prompt = _prompt(9)
        params = prefill.complete("adapter", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
            "kv_transfer_params"
        ]
        os.kill(prefill.process.pid, signal.SIGKILL)
        prefill.process.wait(10)
        before = decode.kv()
        started = time.monotonic()
        answer = decode.complete("adapter", prompt, kv_transfer_params={"do_remote_prefill": True, **params})
        assert time.monotonic() - started < 30
    assert _tokens(answer) == _tokens(alone.complete("adapter", prompt))
    assert decode.kv()["fetch_failures"] - before["fetch_failures"] == 1
