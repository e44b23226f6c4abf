"""Errors at the edge, in the client's language.

`/v1` (what OpenAI SDKs call) answers in OpenAI's envelope: `{"error": {message, type, param, code}}`, except
Anthropic's routes (`/v1/messages...`), which answer in Anthropic's: `{"type": "error", "error": {type, message}}`
with a `request-id` header, an overloaded engine as 529. Everything else (`/admin`, health) answers RFC 9457
problem details. One handler picks the shape by path, so
routing errors (unknown URL, wrong method) and body validation errors are shaped like the handlers' own errors.
"""

from __future__ import annotations

import logging
import secrets
from http import HTTPStatus
from types import TracebackType
from typing import Any

import asyncpg
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from redis.exceptions import RedisError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from loraplex.engine.serve import messages

logger = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1"
ANTHROPIC_PREFIX = "/v1/messages"
PROBLEM_JSON = "application/problem+json"
# What a 503 tells the client to wait before retrying (OpenAI's SDKs honour Retry-After).
RETRY_AFTER_S = 5

# Postgres SQLSTATEs that say the server is not answering queries now, rather than that the query is wrong:
# query_canceled (our statement_timeout), admin_shutdown, crash_shutdown, cannot_connect_now; class 08 is
# connection exceptions.
_UNAVAILABLE_SQLSTATES = frozenset({"57014", "57P01", "57P02", "57P03"})
# character_not_in_repertoire, untranslatable_character: text Postgres cannot store (a NUL byte); the edge
# refuses such text first (schemas.Printable), this is the net under it.
_UNSTORABLE_TEXT_SQLSTATES = frozenset({"22021", "22P05"})
_DATABASE_MODULES = ("sqlalchemy", "asyncpg", "aiosqlite", "sqlite3")
_ASYNCPG_UNAVAILABLE = (
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.InterfaceError,
)


class ApiError(Exception):
    """An error the client caused or must know about; rendered by `handle_exception`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def invalid_api_key(message: str = "Incorrect API key provided.") -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def not_found(what: str, object_id: object) -> ApiError:
    # Same answer for "does not exist" and "belongs to someone else": never reveal another tenant's objects.
    return ApiError(404, f"No {what} with id '{object_id}'.", code="not_found")


def conflict(message: str, *, param: str | None = None) -> ApiError:
    return ApiError(409, message, code="conflict", param=param)


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _openai_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    if status_code == 429:
        return "rate_limit_error"
    if status_code == 403:
        return "permission_error"
    return "invalid_request_error"


def openai_error(
    status_code: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response[dict[str, Any]]:
    body = {"error": {"message": message, "type": _openai_type(status_code), "param": param, "code": code}}
    return Response(body, status_code=status_code, headers=headers)


def problem(
    request: Request[Any, Any, Any],
    status_code: int,
    detail: str,
    *,
    code: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> Response[dict[str, Any]]:
    body: dict[str, Any] = {
        "type": f"urn:loraplex:problem:{code}" if code else "about:blank",
        "title": _phrase(status_code),
        "status": status_code,
        "detail": detail,
        "instance": request.url.path,
    }
    if code:
        body["code"] = code
    if errors:
        body["errors"] = errors
    return Response(body, status_code=status_code, media_type=PROBLEM_JSON, headers=headers)


def _phrase(status_code: int) -> str:
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return "Error"


def _is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error(
    status_code: int, message: str, *, code: str | None = None, headers: dict[str, str] | None = None
) -> Response[dict[str, Any]]:
    """An error in Anthropic's envelope (`messages.error_body`: its types by status, 529 for an overloaded engine),
    with the `request-id` header its clients log."""
    status_code, body = messages.error_body(status_code, message, overloaded=code == "overloaded")
    return Response(body, status_code=status_code, headers={**(headers or {}), "request-id": anthropic_request_id()})


def anthropic_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def _is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def _validation_details(exc: ValidationException) -> tuple[str, str | None, list[dict[str, Any]]]:
    extra = exc.extra if isinstance(exc.extra, list) else []
    errors = [e for e in extra if isinstance(e, dict)]
    if not errors:
        return str(exc.detail or "Invalid request."), None, []
    first = errors[0]
    param = first.get("key") or None
    message = str(first.get("message", "invalid value"))
    if message == "Extra inputs are not permitted" and param:  # pydantic's words for an unknown field; OpenAI's:
        text = f"Unrecognized request argument supplied: {param} (the fields this API takes: /schema)"
    else:
        text = f"Invalid value for '{param}': {message}" if param else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more)"
    return text, param, errors


def _sqlstate(exc: DBAPIError) -> str | None:
    state = getattr(exc.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _raised_in(exc: BaseException, modules: tuple[str, ...]) -> bool:
    traceback: TracebackType | None = exc.__traceback__
    while traceback is not None:
        name = traceback.tb_frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith(modules):
            return True
        traceback = traceback.tb_next
    return False


def unavailable_dependency(exc: BaseException) -> str | None:
    """`database` or `service` when `exc` says a dependency is down, frozen or too slow (refused connections,
    timeouts, a full pool), else None. Such a request may well succeed later: it answers 503 with Retry-After."""
    if isinstance(exc, (PoolTimeout, OperationalError, InterfaceError, *_ASYNCPG_UNAVAILABLE)):
        return "database"
    if isinstance(exc, DBAPIError):
        state = _sqlstate(exc)
        unavailable = exc.connection_invalidated or state in _UNAVAILABLE_SQLSTATES or (state or "").startswith("08")
        return "database" if unavailable else None
    if isinstance(exc, OSError):  # ConnectionError and TimeoutError included: asyncpg raises them unwrapped
        return "database" if _raised_in(exc, _DATABASE_MODULES) else "service"
    if isinstance(exc, RedisError):
        return "service"
    return None


def _unstorable_text(exc: BaseException) -> bool:
    return isinstance(exc, DBAPIError) and _sqlstate(exc) in _UNSTORABLE_TEXT_SQLSTATES


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """Render any exception in the shape the path calls for."""
    status_code = 500
    message = "The server had an error while processing your request."
    code: str | None = None
    param: str | None = None
    errors: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    openai = _is_openai_path(request.url.path)

    if isinstance(exc, ApiError):
        status_code, message, code, param, headers = (
            exc.status_code,
            exc.message,
            exc.code,
            exc.param,
            dict(exc.headers),
        )
    elif isinstance(exc, ValidationException):
        status_code = 400
        message, param, errors = _validation_details(exc)
        code = "invalid_request"
    elif isinstance(exc, HTTPException):
        status_code = exc.status_code
        headers = dict(exc.headers or {})
        if status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
            code = "unknown_url"
        elif status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
            code = "method_not_allowed"
        else:
            message = str(exc.detail)
            code = "invalid_request" if status_code == 400 else None
    elif (dependency := unavailable_dependency(exc)) is not None:
        logger.warning("%s %s: the %s is unavailable: %r", request.method, request.url.path, dependency, exc)
        status_code = 503
        if dependency == "database":
            message, code = "The database is unavailable or too slow right now; retry shortly.", "database_unavailable"
        else:
            message, code = "A service this request needs is unavailable; retry shortly.", "service_unavailable"
    elif _unstorable_text(exc):
        status_code, code = 400, "invalid_request"
        message = "A text field holds a character that cannot be stored (a NUL byte)."
    else:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
    if status_code == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    if _is_anthropic_path(request.url.path):
        return anthropic_error(status_code, message, code=code, headers=headers)
    if openai:
        return openai_error(status_code, message, code=code, param=param, headers=headers)
    return problem(request, status_code, message, code=code, errors=errors, headers=headers)
