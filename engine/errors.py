"""Errors the engine raises to its callers. Each message is fit to show to an API user or an operator."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class CheckpointError(EngineError, ValueError):
    """A model folder is missing a file, names an unsupported architecture, or has a bad field or tensor."""


class RequestError(EngineError, ValueError):
    """A request is invalid (bad sampling parameters, prompt too long, ...)."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class ContextLengthExceeded(RequestError):
    def __init__(self, message: str, *, param: str = "messages") -> None:
        super().__init__(message, code="context_length_exceeded", param=param)


class EngineOverloaded(EngineError):
    """The engine's waiting queue is full (requests or tokens): the request was refused before anything of it was
    queued or allocated. `retry_after_s` is the engine's estimate of when the queue will have drained enough."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerFailed(EngineError):
    """A tensor-parallel rank failed to start, or died: the engine cannot run a step without it."""
