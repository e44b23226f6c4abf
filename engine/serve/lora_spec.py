"""`lora_adapter`, the request field that names an adapter by its files and digest (ours, not OpenAI's), and the
bounds of adapter names the server accepts."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, StrictStr, field_validator

MAX_ADAPTER_NAME_CHARS = 256
DIGEST_PREFIX = "sha256:"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class LoraAdapterSpec(BaseModel):
    """`lora_adapter`: run the request with the adapter whose two files (PEFT's save_pretrained folder) are at
    `source` and hash to `digest` (`adapter_digest`'s "sha256:<64 hex>"). Not OpenAI's: a trusted caller's field.

    The digest is trusted as the adapter's identity (the prefix cache and the pool key on it) and verified when the
    engine reads the files: content that hashes otherwise fails the request. Which sources are accepted at all is
    the server's `AdapterRoots`' decision, not this shape's.
    """

    model_config = ConfigDict(extra="forbid")  # unlike the requests': a misspelt key here must not pass unnoticed

    name: StrictStr  # how logs and metrics call it
    source: StrictStr  # s3://bucket/prefix, or an absolute folder
    digest: StrictStr

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not value or len(value) > MAX_ADAPTER_NAME_CHARS or not value.isprintable() or value != value.strip():
            raise ValueError(
                f"name must be 1 to {MAX_ADAPTER_NAME_CHARS} printable characters, without surrounding spaces"
            )
        return value

    @field_validator("source")
    @classmethod
    def _source_shape(cls, value: str) -> str:
        if not value or not value.isprintable():
            raise ValueError("source must be an s3://bucket/prefix URI or an absolute folder")
        return value

    @field_validator("digest")
    @classmethod
    def _digest_shape(cls, value: str) -> str:
        digest = value.lower()  # hex digits are case-free; the engine's digests are lower case
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"digest must be {DIGEST_PREFIX!r} followed by 64 hex digits")
        return digest


__all__ = ["DIGEST_PREFIX", "MAX_ADAPTER_NAME_CHARS", "LoraAdapterSpec"]
