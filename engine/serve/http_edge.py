"""Guards at the HTTP edge that the engine server and the platform share: what a hostile client can send before
any handler runs must be a 400, never a 500.

- `GuardedRequest` (the apps' `request_class`): a JSON body nested deeper than the decoder recurses is refused
  with a 400 instead of escaping as a `RecursionError`.
- `refuse_nul_bytes` (the apps' `before_request`): a NUL byte in the path or the query string is refused, so that
  no path id or query parameter carrying one reaches a database (Postgres refuses NUL in text; SQLite would not).
"""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.exceptions import ClientException

NESTED_TOO_DEEPLY = "The JSON body is nested too deeply to be parsed."
NUL_IN_URL = "The URL must not contain a NUL byte (%00)."


class GuardedRequest(Request[Any, Any, Any]):
    """Litestar's request, whose `json()` refuses a body nested past the decoder's recursion limit with a 400."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except RecursionError:
            raise ClientException(NESTED_TOO_DEEPLY) from None


async def refuse_nul_bytes(request: Request[Any, Any, Any]) -> None:
    """Raise a 400 for a NUL byte in the (decoded) path or the query string, raw or percent-encoded."""
    query = request.scope.get("query_string", b"")
    if "\x00" in request.scope["path"] or b"\x00" in query or b"%00" in query:
        raise ClientException(NUL_IN_URL)


__all__ = ["NESTED_TOO_DEEPLY", "NUL_IN_URL", "GuardedRequest", "refuse_nul_bytes"]
