"""Errors raised while reading a LoRA adapter. Each message is written for the API user who uploaded it.

The engine raises them when it loads an adapter and the platform raises the same ones on upload, so a message
must stand on its own: it names the file, the adapter_config.json field or the tensor at fault (also kept in
`field`, for an API's `param`), and says what was expected.
"""

from __future__ import annotations

from loraplex.engine.errors import EngineError


class AdapterError(EngineError, ValueError):
    """An adapter cannot be served. `field` names the culprit: a file, a config field or a tensor (or None)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = None if field is None else shorten(field)


class AdapterFormatError(AdapterError):
    """A file is missing, is pickle or code, is not valid safetensors / JSON, or holds an unexpected tensor."""


class AdapterConfigError(AdapterError):
    """An adapter_config.json field has a bad type or value."""


class UnsupportedAdapterFeature(AdapterConfigError):
    """adapter_config.json asks for a PEFT feature loraplex does not serve (DoRA, biases, embeddings, ...)."""


class AdapterShapeError(AdapterError):
    """A tensor does not fit the base model (wrong shape, layer out of range) or the config's rank."""


class AdapterRankError(AdapterError):
    """A module's rank is over the limit this server accepts."""


class AdapterValueError(AdapterError):
    """A tensor holds NaN or infinite values, or values that overflow the serving dtype."""


def shorten(text: str, limit: int = 120) -> str:
    """Text from an upload, cut short for a message: one field of a hostile file can hold megabytes."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
