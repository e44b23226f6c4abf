"""Talking to an engine: the OpenAI-compatible engine server, over HTTP or in process.

Both clients speak the same protocol (the engine's own HTTP API), so there is one code path: the in-process
client drives the engine's ASGI app directly, streaming its response body as it is sent, without a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine, MutableMapping
from contextlib import suppress
from typing import Any, Protocol

import aiohttp

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
ASGIApp = Callable[..., Coroutine[Any, Any, None]]  # an ASGI 3 app: (scope, receive, send)


class EngineUnavailable(Exception):
    """The engine could not be reached, or broke off its answer."""


class EngineUnreachable(EngineUnavailable):
    """No connection could be opened to the engine: the request never reached it, so another replica may take it."""


# The engine's error code for a refusal by its bounded waiting queue (503, with Retry-After, before any byte).
OVERLOADED = "overloaded"


class EngineRequestError(Exception):
    """The engine refused the request: its status and OpenAI error body, to pass on to the client, and its
    Retry-After in seconds (None when it sent none, or one that is not a number of seconds)."""

    def __init__(self, status_code: int, body: dict[str, Any], *, retry_after_s: float | None = None) -> None:
        super().__init__(f"engine answered {status_code}: {body}")
        self.status_code = status_code
        self.body = body
        self.retry_after_s = retry_after_s

    @property
    def code(self) -> str | None:
        error = self.body.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        return code if isinstance(code, str) else None

    @property
    def overloaded(self) -> bool:
        """The engine's waiting queue is full: it refused the request before queueing any of it."""
        return self.status_code == 503 and self.code == OVERLOADED


def retry_after_seconds(value: str | bytes | None) -> float | None:
    """A Retry-After header's delay in seconds; None when absent, or given as an HTTP date (engines send seconds)."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    try:
        seconds = float(text.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class EngineClient(Protocol):
    def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST an OpenAI request with stream=true; yield every SSE event's JSON until [DONE].

        Raises EngineRequestError when the engine refuses it (before any event), EngineUnavailable when it cannot
        be reached or the stream breaks. Closing the iterator early cancels the request on the engine.
        """
        ...

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a request whose answer is one JSON object (embeddings) and return it; raises as `stream` does."""
        ...

    async def close(self) -> None: ...


def _answer(raw: bytes) -> dict[str, Any]:
    """A whole answer's JSON object; anything else means the engine broke off, not that the request failed."""
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise EngineUnavailable(f"the engine sent an unreadable answer: {raw[:200]!r}")
    return answer


def _event(data: str) -> dict[str, Any]:
    """One SSE event's JSON object; anything else means the stream is broken, not that the request failed."""
    try:
        event = json.loads(data)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        raise EngineUnavailable(f"the engine sent an unreadable event: {data[:200]!r}")
    return event


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            # The rest of the body (its last chunk) is read too, so that its connection is kept for the next
            # request instead of being dropped as one with an unread body.
            async for _ in lines:
                pass
            return
        yield _event(data)
    # Every answer the engine gives ends with [DONE], errors included: a body without it was cut off.
    raise EngineUnavailable("the engine's stream ended before [DONE]")


class HttpEngineClient:
    """One engine replica over HTTP. `on_unreachable` is called when a connection cannot even be opened (the
    request never reached the engine), so that the fleet can route around a replica that has gone away.

    aiohttp, not httpx: its C parser and lighter request path take much less CPU per proxied request, and every
    request and streamed event of every tenant goes through here (docs/decisions/0044)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        on_unreachable: Callable[[], None] | None = None,
        api_key: str | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        # Each read may wait up to timeout_s (a long prefill sends nothing for a while); opening a connection 5 s.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._on_unreachable = on_unreachable
        self._session: aiohttp.ClientSession | None = None  # made on the serving loop, at the first request

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No cap on connections: the engine queues and schedules requests itself and announces its queue to the
            # router, where a cap here would hold requests back unseen.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers, auto_decompress=False
            )
        return self._session

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        url = f"{self._base_url}{path}"
        try:
            async with self._client().post(url, json=body) as response:
                if response.status != 200:
                    raw = await response.read()
                    retry_after_s = retry_after_seconds(response.headers.get("retry-after"))
                    raise EngineRequestError(response.status, _error_body(raw), retry_after_s=retry_after_s)
                finished = False
                try:
                    async for event in _events(_lines(response.content.iter_any())):
                        yield event
                    finished = True
                finally:
                    if not finished:  # closed early or broken: drop the connection, so the engine aborts the request
                        response.close()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise self._unreachable(exc) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"engine at {self._base_url} failed: {exc!r}") from exc

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._client().post(f"{self._base_url}{path}", json=body) as response:
                raw = await response.read()
                if response.status != 200:
                    retry_after_s = retry_after_seconds(response.headers.get("retry-after"))
                    raise EngineRequestError(response.status, _error_body(raw), retry_after_s=retry_after_s)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise self._unreachable(exc) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"engine at {self._base_url} failed: {exc!r}") from exc
        return _answer(raw)

    def _unreachable(self, exc: Exception) -> EngineUnreachable:
        if self._on_unreachable is not None:
            self._on_unreachable()
        return EngineUnreachable(f"engine at {self._base_url} is unreachable: {exc}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a body sent in chunks of any size (no limit on a line's length: an event may be long)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode()
    if buffer:
        yield buffer.decode()


# Queued after the in-process app's last message, when its task has ended (compared by identity).
_APP_ENDED: Message = {"type": "loraplex.app_ended"}


class InProcessEngineClient:
    """Runs requests through the engine's ASGI app in this process, streaming the body as the app sends it."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async with self._running(path, body) as (start, take):
            status = int(start.get("status", 500))
            if status != 200:
                raise _refusal(start, await _whole_body(take))
            buffer = ""
            while True:
                message = await take()
                buffer += message.get("body", b"").decode()
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    if line.startswith("data:"):
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        yield _event(data)
                if not message.get("more_body"):
                    raise EngineUnavailable("the in-process engine's stream ended before [DONE]")

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._running(path, body) as (start, take):
            raw = await _whole_body(take)
            if int(start.get("status", 500)) != 200:
                raise _refusal(start, raw)
            return _answer(raw)

    @contextlib.asynccontextmanager
    async def _running(
        self, path: str, body: dict[str, Any]
    ) -> AsyncIterator[tuple[Message, Callable[[], Coroutine[Any, Any, Message]]]]:
        """The app running `body` as a POST to `path`: its response's start message, and how to take its next
        message. On leaving, the app sees a client that went away (so it aborts an unfinished engine request)."""
        payload = json.dumps(body).encode()
        chunks: asyncio.Queue[Message] = asyncio.Queue()
        disconnect = asyncio.Event()
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            await chunks.put(message)

        scope: Message = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            "client": ("127.0.0.1", 0),
            "server": ("in-process", 0),
            "state": {},
        }
        task: asyncio.Task[None] = asyncio.create_task(self._app(scope, receive, send))
        task.add_done_callback(lambda _: chunks.put_nowait(_APP_ENDED))  # after every message it sent
        try:
            yield await self._next(chunks, task), lambda: self._next(chunks, task)
        finally:
            disconnect.set()  # the app sees a client that went away: it aborts the engine request
            if not task.done():
                task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task

    @staticmethod
    async def _next(chunks: asyncio.Queue[Message], task: asyncio.Task[None]) -> Message:
        """The app's next message; after the last one, `_APP_ENDED` (queued when its task ends) raises. A message
        already queued is taken without waiting on the event loop."""
        message = await chunks.get()
        if message is _APP_ENDED:
            raise EngineUnavailable(f"the in-process engine stopped answering: {task.exception()}")
        return message

    async def close(self) -> None:
        return None


async def _whole_body(take: Callable[[], Coroutine[Any, Any, Message]]) -> bytes:
    raw = b""
    while True:
        message = await take()
        raw += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return raw


def _refusal(start: Message, raw: bytes) -> EngineRequestError:
    """The engine's refusal, from its response's start message (status, Retry-After) and body."""
    # ASGI headers: (name, value) pairs of bytes, names lowercase by convention only.
    header = next((v for k, v in start.get("headers") or () if k.lower() == b"retry-after"), None)
    return EngineRequestError(
        int(start.get("status", 500)), _error_body(raw), retry_after_s=retry_after_seconds(header)
    )


def _error_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    text = raw.decode(errors="replace")[:500]
    return {"error": {"message": f"engine error: {text}", "type": "server_error", "param": None, "code": None}}
