"""Errors the OpenAI-compatible server answers with, raised by the serving logic and caught by the HTTP layer, and
how any exception maps to a status and OpenAI's error object (`error_detail`), which the other protocols' envelopes
(engine/serve/protocols/) are made from.

They live apart from both so that the dependency runs one way: `server` imports `serving`, and both import these.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request
from litestar.exceptions import HTTPException, ValidationException
from pydantic import BaseModel

from loraplex.engine.errors import EngineOverloaded, RequestError
from loraplex.engine.serve.async_engine import EngineDeadError, RequestFailed

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error to answer in OpenAI's envelope with this status."""

    def __init__(self, status_code: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


class ClientDisconnected(Exception):
    """The client closed the connection before its non-streaming response was ready."""


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _error_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    if status_code == 429:
        return "rate_limit_error"
    return "invalid_request_error"


def error_detail(exc: BaseException, request: Request[Any, Any, Any] | None = None) -> tuple[int, ErrorDetail]:
    """Map any exception to a status and OpenAI's error body."""
    status_code, message, code, param = 500, "The server had an error while processing your request.", None, None
    if isinstance(exc, ApiError):
        status_code, message, code, param = exc.status_code, exc.message, exc.code, exc.param
    elif isinstance(exc, EngineDeadError):
        status_code, message, code = 503, str(exc), "engine_unavailable"
    elif isinstance(exc, EngineOverloaded):
        status_code, message, code = 503, str(exc), "overloaded"
    elif isinstance(exc, RequestFailed):
        # The adapter's fault (bad files, too large for this pool) is the client's; anything else is ours.
        status_code, message, code = (400 if exc.is_client_error else 500), str(exc), "lora_adapter_load_failed"
        param = "model" if exc.is_client_error else None
        if not exc.is_client_error:
            logger.error("a request failed: %s", exc, exc_info=exc.cause)
    elif isinstance(exc, RequestError):
        status_code, message, code, param = 400, str(exc), exc.code or "invalid_request", exc.param
    elif isinstance(exc, ValidationException):
        status_code, code = 400, "invalid_request"
        message, param = _validation_message(exc)
    elif isinstance(exc, HTTPException):
        status_code, message = exc.status_code, str(exc.detail)
        where = f"{request.method} {request.url.path}" if request is not None else "this request"
        if status_code == 404:
            message, code = f"Invalid URL ({where})", "unknown_url"
        elif status_code == 405:
            message, code = f"Method not allowed ({where})", "method_not_allowed"
        elif status_code == 400:
            code = "invalid_request"
    else:
        logger.error("unhandled error", exc_info=exc)
    return status_code, ErrorDetail(message=message, type=_error_type(status_code), param=param, code=code)


def _param_name(key: str) -> str:
    """Litestar's `messages.0.content` -> OpenAI's `messages[0].content`."""
    name = ""
    for part in key.split("."):
        name += f"[{part}]" if part.isdigit() else (f".{part}" if name else part)
    return name


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    errors = [e for e in (exc.extra if isinstance(exc.extra, list) else []) if isinstance(e, dict)]
    if not errors:
        return str(exc.detail or "Invalid request body."), None
    first = errors[0]
    key = first.get("key")
    if key == "data":  # the body itself is missing, not one of its fields
        return "The request body must be a JSON object.", None
    param = _param_name(str(key)) if key else None
    detail = str(first.get("message", "invalid value")).removeprefix("Value error, ")
    message = f"Invalid value for '{param}': {detail}" if param else f"Invalid request body: {detail}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return message, param


__all__ = ["ApiError", "ClientDisconnected", "ErrorDetail", "ErrorResponse", "error_detail"]
