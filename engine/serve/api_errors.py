"""Errors the OpenAI-compatible server answers with, raised by the serving logic and caught by the HTTP layer.

They live apart from both so that the dependency runs one way: `server` imports `serving`, and both import these.
"""

from __future__ import annotations

from pydantic import BaseModel


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


__all__ = ["ApiError", "ClientDisconnected", "ErrorDetail", "ErrorResponse"]
