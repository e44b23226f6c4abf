"""An engine and its HTTP app on a uvicorn server in a thread, as the engine server tests need it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import torch
import uvicorn
from litestar import Litestar

from loraplex.engine.core.config import EngineConfig
from loraplex.engine.serve.async_engine import AsyncEngine


@contextlib.contextmanager
def running_engine_server(
    config: EngineConfig,
    make_app: Callable[[AsyncEngine, str], Awaitable[Litestar]],
    *,
    check_exit: bool = False,
) -> Iterator[tuple[str, AsyncEngine]]:
    """`await make_app(engine, url)` on a uvicorn server, in a thread with its own event loop, as in production;
    yields (url, engine). torch's process-wide thread count, which the engine sets, is given back afterwards. With
    `check_exit`, a server that failed while running fails the caller after it stops."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    started: list[tuple[uvicorn.Server, AsyncEngine]] = []
    failure: list[BaseException] = []

    async def serve() -> None:
        engine = await AsyncEngine.create(config)
        try:
            uv = uvicorn.Server(uvicorn.Config(await make_app(engine, url), log_level="warning"))
            started.append((uv, engine))
            await uv.serve(sockets=[sock])
        finally:
            await engine.shutdown()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:
            failure.append(exc)

    num_threads = torch.get_num_threads()
    thread = threading.Thread(target=run, name="engine-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (started and started[0][0].started):
            assert not failure, f"the server failed to start: {failure[0]!r}"
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        yield url, started[0][1]
    finally:
        if started:
            started[0][0].should_exit = True
        thread.join(15)
        sock.close()
        torch.set_num_threads(num_threads)
    if check_exit:
        assert not failure, f"the server failed: {failure[0]!r}"
