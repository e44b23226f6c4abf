"""Helpers for the console's tests: signing in over HTTP as a browser does, and Debian's Chromium for Playwright."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from playwright.async_api import Browser, async_playwright

CHROMIUM_MISSING = (
    "The console's browser tests need Debian's Chromium: `sudo apt-get install chromium` (or run `make test`, "
    "which installs it). Looked for /usr/bin/chromium and `chromium` on PATH."
)
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
# Screenshots of every console page, for review: build/test-output/console/ in the repository (ignored by git).
SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "test-output" / "console"


class _Client(Protocol):
    async def get(self, url: str, **kwargs: Any) -> Any: ...
    async def post(self, url: str, **kwargs: Any) -> Any: ...


def chromium_executable() -> str:
    """Debian's chromium; a failure (never a skip) when it is missing. Playwright's own browser download is not used."""
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    found = shutil.which("chromium")
    if found is None:
        pytest.fail(CHROMIUM_MISSING)
    return found


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Debian's Chromium, headless, driven by Playwright; closed after the block."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium_executable(), headless=True)
        try:
            yield browser
        finally:
            await browser.close()


@contextlib.contextmanager
def other_browser(client: Any) -> Iterator[Any]:
    """Another browser on the same app: the test client with a cookie jar of its own while the block runs (one test
    client per app: a second one would start the app's lifespan again, on another event loop)."""
    saved = client.cookies
    client.cookies = httpx.Cookies()
    try:
        yield client
    finally:
        client.cookies = saved


def csrf_token(html: str) -> str:
    """The CSRF token of the first form on a page."""
    found = _CSRF.search(html)
    assert found is not None, "no CSRF field on the page"
    return found.group(1)


async def sign_in(client: _Client, key: str) -> Any:
    """Open /console, post the sign-in form with `key`, and return the answer (303 on success); the client keeps
    the cookies, as a browser would."""
    form = await client.get("/console")
    assert form.status_code == 200, f"no sign-in form (already signed in?): {form.status_code}"
    return await client.post("/console/sign-in", data={"key": key, "csrf_token": csrf_token(form.text)})


async def page_token(client: _Client, path: str) -> str:
    """The CSRF token of a signed-in page."""
    response = await client.get(path)
    assert response.status_code == 200, (path, response.status_code, response.text[:300])
    return csrf_token(response.text)


WIDTHS = (1280, 390)


async def review(page: Any, name: str) -> None:
    """Check the page at a laptop's width and a phone's (390 px): nothing wider than the window (no sideways
    scrolling), and write a full-page screenshot of each to SCREENSHOTS/<name>-<width>.png for review."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    original = page.viewport_size
    try:
        for width in WIDTHS:
            await page.set_viewport_size({"width": width, "height": 900})
            overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{name} is {overflow} px wider than a {width} px window"
            await page.screenshot(path=SCREENSHOTS / f"{name}-{width}.png", full_page=True)
    finally:
        if original is not None:
            await page.set_viewport_size(original)


class BrowserProblems:
    """What a page must never do: log an error (a CSP violation is one), open a dialog, or load from elsewhere."""

    def __init__(self, page: Any, origin: str) -> None:
        self.messages: list[str] = []
        page.on("console", lambda m: self.messages.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.messages.append(f"page error: {e}"))
        page.on("dialog", lambda d: self.messages.append(f"dialog: {d.message}"))
        page.on("request", lambda r: None if r.url.startswith((origin, "data:")) else self.messages.append(r.url))

    def check(self) -> None:
        assert not self.messages, self.messages
