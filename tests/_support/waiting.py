"""The one way tests wait: for a condition the code exposes, polled until it holds or the time runs out.

Tests never sleep to let something happen (or not happen): they wait for the state that says it did.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

INTERVAL_S = 0.05


def poll(condition: Callable[[], T], timeout_s: float = 5.0, *, interval_s: float = INTERVAL_S) -> T | None:
    """`condition()`'s first truthy value, or None once `timeout_s` have passed (it is tried once more then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


def wait_for(
    condition: Callable[[], T], timeout_s: float = 15.0, *, interval_s: float = INTERVAL_S, what: str = ""
) -> T:
    """`condition()`'s first truthy value; fails the test (naming `what`) after `timeout_s`."""
    value = poll(condition, timeout_s, interval_s=interval_s)
    assert value is not None, f"timed out after {timeout_s} s waiting for {what or 'the condition'}"
    return value


async def wait_for_async(
    condition: Callable[[], Awaitable[T]], timeout_s: float = 15.0, *, interval_s: float = INTERVAL_S, what: str = ""
) -> T:
    """`wait_for` for a condition that must be awaited (on the test's event loop)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what or 'the condition'}"
        await asyncio.sleep(interval_s)


__all__ = ["poll", "wait_for", "wait_for_async"]
