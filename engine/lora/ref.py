"""How callers name an adapter: `LoRARequest` (vLLM's shape, for the offline API and the engine server) and
`AdapterRef` (what the engine keeps: a name, where the files are, and the content digest that identifies them).

The digest, not the name or the path, is the identity: new content under an old name is a new adapter, so the
old weights are never served for it (and, with the prefix cache, never share KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

S3_SCHEME = "s3://"


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter to run a request with: `name` is how outputs and metrics call it; `path` is a local folder
    written by PEFT's save_pretrained, or an s3://bucket/prefix holding the same two files."""

    name: str
    path: str | Path

    def __post_init__(self) -> None:
        if not self.name or not str(self.path):
            raise ValueError("a LoRARequest needs a name and a path")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    name: str
    source: str  # a local folder or an s3:// URI
    digest: str  # "sha256:<hex>" of the adapter's files

    @property
    def is_s3(self) -> bool:
        return self.source.startswith(S3_SCHEME)

    def __str__(self) -> str:
        return f"{self.name} ({self.digest[:19]})"
