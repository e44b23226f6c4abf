"""A closed loop of keep-alive HTTP/1.1 clients for throughput at saturation, cheap enough on the client side that
the servers, not the load, take the CPU (httpx costs a few times more per request than the whole of this).

Each client sends one prepared request, reads the whole answer, and sends the next at once; `saturate` counts the
answers completed within the measured window, after a warm-up in which the clients already run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class Throughput:
    """What a closed loop completed in its measured window."""

    num_ok: int  # answers with status 200
    num_failed: int  # any other status
    seconds: float  # the window's length
    clients: int
    completion_tokens: int = 0  # the usage of the answers with status 200

    @property
    def requests_per_s(self) -> float:
        return self.num_ok / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests_per_s": self.requests_per_s,
            "tokens_per_s": self.tokens_per_s,
            "num_ok": self.num_ok,
            "num_failed": self.num_failed,
            "completion_tokens": self.completion_tokens,
            "seconds": self.seconds,
            "clients": self.clients,
        }


def completion_tokens(body: bytes) -> int:
    """An OpenAI answer's `usage.completion_tokens`: a JSON body's, or a stream's (its usage event, sent with
    `stream_options.include_usage`, is the last before [DONE]). 0 where the answer carries no usage."""
    if body.lstrip().startswith(b"{"):
        usage = json.loads(body).get("usage") or {}
        return int(usage.get("completion_tokens", 0))
    for line in reversed(body.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            usage = json.loads(line[5:]).get("usage") or {}
            return int(usage.get("completion_tokens", 0))
    return 0


def prepared_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[str, int, bytes]:
    """(host, port, the bytes of a keep-alive POST of `body` as JSON to `url`)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    lines = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One whole HTTP/1.1 response: (status, body); the body by Content-Length or chunked transfer encoding."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    fields = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        if name:
            fields[name.strip().lower()] = value.strip()
    if "content-length" in fields:
        return status, await reader.readexactly(int(fields["content-length"]))
    if fields.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return status, bytes(body)
            body += chunk[:-2]
    raise ValueError(f"a response without Content-Length or chunked encoding (status {status})")


async def saturate(
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    clients: int = 16,
    seconds: float = 10.0,
    warmup_s: float = 2.0,
    at_window: Callable[[], None] | None = None,
) -> Throughput:
    """`clients` keep-alive connections each sending `body` to `url` back to back for `warmup_s + seconds`; counts
    the answers that complete within the last `seconds`. `at_window` is called when that window opens and when it
    closes (to read what else it should cover, such as CPU times)."""
    host, port, request = prepared_post(url, body, headers)
    started = time.perf_counter()
    window_start = started + warmup_s
    window_end = window_start + seconds
    counts = {"ok": 0, "failed": 0, "tokens": 0}

    async def client() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < window_end:
                writer.write(request)
                status, answer = await read_response(reader)
                if window_start <= time.perf_counter() <= window_end:
                    counts["ok" if status == 200 else "failed"] += 1
                    if status == 200:
                        counts["tokens"] += completion_tokens(answer)
        finally:
            writer.close()
            await writer.wait_closed()

    async def marks() -> None:
        if at_window is not None:
            await asyncio.sleep(warmup_s)
            at_window()
            await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
            at_window()

    await asyncio.gather(marks(), *(client() for _ in range(clients)))
    return Throughput(
        num_ok=counts["ok"],
        num_failed=counts["failed"],
        seconds=seconds,
        clients=clients,
        completion_tokens=counts["tokens"],
    )
