"""HttpEngineClient, the platform's HTTP client to fleet engines, against a small HTTP/1.1 server that answers as an
engine does (SSE events in chunks, then [DONE]): it keeps one connection across requests, drops it when a stream is
closed early (the engine then aborts the request), reads events of any length, and maps each failure to the error
the router acts on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from loraplex.platform.domain.fleet.client import (
    EngineRequestError,
    EngineUnavailable,
    EngineUnreachable,
    HttpEngineClient,
)


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def sse(event: dict[str, Any] | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()


@dataclass
class Engine:
    """What the server saw: connections opened, requests read, connections the client closed."""

    url: str = ""
    connections: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


Answer = Callable[[dict[str, Any], asyncio.StreamWriter], Any]


async def events_answer(
    events: list[bytes], writer: asyncio.StreamWriter, *, end: bool = True, pause_s: float = 0.0
) -> None:
    """A streamed 200 of `events`; its last chunk (the body's end) `pause_s` after them, as an ASGI server sends it
    after the app's last message, or never (`end=False`)."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for event in events:
        writer.write(chunk(event))
        await writer.drain()
    await asyncio.sleep(pause_s)
    if end:
        writer.write(b"0\r\n\r\n")
        await writer.drain()


async def serve(answer: Answer) -> tuple[asyncio.Server, Engine]:
    engine = Engine()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        engine.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(value)
                    for name, _, value in (line.partition(b":") for line in head.split(b"\r\n"))
                    if name.strip().lower() == b"content-length"
                )
                body = json.loads(await reader.readexactly(length))
                engine.requests.append(body)
                if await answer(body, writer) is False:
                    break
            writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            engine.closed_by_client.set()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    return server, engine


@pytest.fixture
async def streaming() -> AsyncIterator[Engine]:
    """An engine that streams two token events, a usage event and [DONE] to every request."""

    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        events = [sse({"choices": [{"delta": {"content": word}}]}) for word in ("a", "b")]
        usage = sse({"choices": [], "usage": {"completion_tokens": 2}})
        await events_answer([*events, usage, sse("[DONE]")], writer, pause_s=0.05)

    server, engine = await serve(answer)
    async with server:
        yield engine


async def collect(client: HttpEngineClient, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [event async for event in client.stream("/v1/chat/completions", body or {"stream": True})]


async def test_requests_share_one_connection_and_every_event_arrives(streaming: Engine) -> None:
    client = HttpEngineClient(streaming.url, api_key="engine-key")
    try:
        for _ in range(3):
            events = await collect(client, {"model": "m"})
            assert [e.get("usage") for e in events] == [None, None, {"completion_tokens": 2}]
    finally:
        await client.close()
    assert streaming.connections == 1  # the body after [DONE] was read: the connection went back to the pool
    assert streaming.requests == [{"model": "m"}] * 3


async def test_a_stream_closed_early_drops_its_connection() -> None:
    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        event = sse({"choices": [{"delta": {"content": "a"}}]})
        if body.get("hang"):  # an engine still generating: the stream stays open
            await events_answer([event], writer, end=False)
        else:
            await events_answer([event, sse("[DONE]")], writer)

    server, engine = await serve(answer)
    client = HttpEngineClient(engine.url)
    async with server:
        try:
            events = client.stream("/v1/chat/completions", {"hang": True})
            await anext(events)
            await events.aclose()  # type: ignore[attr-defined]
            await asyncio.wait_for(engine.closed_by_client.wait(), 5)  # the engine sees its client go, and aborts
            assert len(await collect(client)) == 1  # the next request gets a connection of its own
        finally:
            await client.close()
    assert engine.connections == 2


async def test_an_event_longer_than_any_buffer_is_read_whole() -> None:
    long_text = "x" * 300_000

    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        event = sse({"choices": [{"delta": {"content": long_text}}]})
        await events_answer([event[:1000], event[1000:], sse("[DONE]")], writer)

    server, engine = await serve(answer)
    client = HttpEngineClient(engine.url)
    async with server:
        try:
            (event,) = await collect(client)
        finally:
            await client.close()
    assert event["choices"][0]["delta"]["content"] == long_text


async def test_a_refusal_carries_the_engines_status_body_and_retry_after() -> None:
    error = {"error": {"message": "queue full", "type": "server_error", "param": None, "code": "overloaded"}}

    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        raw = json.dumps(error).encode()
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 2\r\ncontent-length: %d\r\n\r\n" % len(raw))
        writer.write(raw)
        await writer.drain()

    server, engine = await serve(answer)
    client = HttpEngineClient(engine.url)
    async with server:
        try:
            with pytest.raises(EngineRequestError) as refused:
                await collect(client)
        finally:
            await client.close()
    assert refused.value.status_code == 503 and refused.value.body == error
    assert refused.value.overloaded and refused.value.retry_after_s == 2.0


async def test_a_body_cut_before_done_or_an_unreadable_event_is_a_broken_engine() -> None:
    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        if body.get("case") == "unreadable":
            await events_answer([sse("not json"), sse("[DONE]")], writer)
            return True
        await events_answer([sse({"choices": []})], writer, end=False)
        return False  # the connection closes without the body's last chunk

    server, engine = await serve(answer)
    client = HttpEngineClient(engine.url)
    async with server:
        try:
            with pytest.raises(EngineUnavailable, match=r"failed|before"):
                await collect(client, {"case": "cut"})
            with pytest.raises(EngineUnavailable, match="unreadable event"):
                await collect(client, {"case": "unreadable"})
        finally:
            await client.close()


async def test_an_engine_that_cannot_be_reached_is_unreachable_and_reported() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens there now
    reported: list[bool] = []
    client = HttpEngineClient(f"http://127.0.0.1:{port}", on_unreachable=lambda: reported.append(True))
    try:
        with pytest.raises(EngineUnreachable):
            await collect(client)
    finally:
        await client.close()
    assert reported == [True]


async def test_a_whole_answer_is_posted_and_read_with_the_same_errors() -> None:
    """`post`, for answers that are one JSON object (embeddings): the object, on the shared connection; the engine's
    refusal with its status and body; a body that is no JSON object is a broken engine; nothing listening is
    unreachable and reported."""
    error = {"error": {"message": "bad input", "type": "invalid_request_error", "param": "input", "code": None}}

    async def answer(body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        status, raw = {
            "ok": (b"200 OK", json.dumps({"data": [{"embedding": [0.5]}], "usage": {"prompt_tokens": 3}}).encode()),
            "bad": (b"400 Bad Request", json.dumps(error).encode()),
            "broken": (b"200 OK", b"[1, 2]"),
        }[body["case"]]
        writer.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(raw))
        )
        writer.write(raw)
        await writer.drain()

    server, engine = await serve(answer)
    client = HttpEngineClient(engine.url)
    async with server:
        try:
            for _ in range(2):
                got = await client.post("/v1/embeddings", {"case": "ok"})
                assert got == {"data": [{"embedding": [0.5]}], "usage": {"prompt_tokens": 3}}
            with pytest.raises(EngineRequestError) as refused:
                await client.post("/v1/embeddings", {"case": "bad"})
            assert refused.value.status_code == 400 and refused.value.body == error
            with pytest.raises(EngineUnavailable, match="unreadable answer"):
                await client.post("/v1/embeddings", {"case": "broken"})
        finally:
            await client.close()
    assert engine.connections == 1
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    reported: list[bool] = []
    gone = HttpEngineClient(f"http://127.0.0.1:{port}", on_unreachable=lambda: reported.append(True))
    try:
        with pytest.raises(EngineUnreachable):
            await gone.post("/v1/embeddings", {"case": "ok"})
    finally:
        await gone.close()
    assert reported == [True]
