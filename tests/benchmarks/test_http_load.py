"""http_load: the closed loop that measures throughput at saturation (platform_overhead.py) reads whole answers and
counts only what completed in its window, 200s apart from the rest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from http_load import prepared_post, read_response, saturate


async def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_a_response_is_read_by_its_length_or_its_chunks() -> None:
    sized = await _reader(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhelloHTTP/1.1 ...")
    assert await read_response(sized) == (200, b"hello")
    chunked = await _reader(
        b"HTTP/1.1 429 Too Many Requests\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    )
    assert await read_response(chunked) == (429, b"abcde")
    with pytest.raises(ValueError, match="without Content-Length"):
        await read_response(await _reader(b"HTTP/1.1 200 OK\r\n\r\n"))


def test_the_prepared_request_carries_the_body_and_the_headers() -> None:
    host, port, request = prepared_post("http://127.0.0.1:8123/v1/chat", {"a": 1}, {"Authorization": "Bearer k"})
    assert (host, port) == ("127.0.0.1", 8123)
    head, _, body = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat HTTP/1.1\r\n")
    assert b"Authorization: Bearer k" in head and f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body) == {"a": 1}


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[int]]]:
    """A keep-alive server that answers 200 to every request but each fifth, which gets a 503; yields (url, the
    number of requests answered so far)."""
    answered = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"Content-Length"
                )
                await reader.readexactly(length)
                answered[0] += 1
                status = b"503 Service Unavailable" if answered[0] % 5 == 0 else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
                await asyncio.sleep(0.001)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    listening = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    async with listening:
        yield f"http://127.0.0.1:{port}/x", answered


async def test_saturation_counts_the_window_only_and_the_failures_apart(server: tuple[str, list[int]]) -> None:
    url, answered = server
    result = await saturate(url, {"q": 1}, clients=4, seconds=0.5, warmup_s=0.3)
    counted = result.num_ok + result.num_failed
    assert 0 < counted < answered[0]  # the warm-up's answers are not counted
    assert result.num_failed > 0 and result.num_ok > 3 * result.num_failed
    assert result.requests_per_s == result.num_ok / 0.5
