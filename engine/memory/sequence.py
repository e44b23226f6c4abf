"""How the memory package knows a sequence: `KVSequence`, what the KV cache manager and the prefix cache read of
one (the engine's `Request` is one), and `SequenceBlocks`, the state they keep of it, which nothing else writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.memory.page_pool import PageId


@dataclass(slots=True, eq=False)
class SequenceBlocks:
    """One sequence's KV blocks, written by the KV cache manager and its prefix cache only. Entry i of each KV group's
    table (kv_groups.py) holds the K/V of the sequence's tokens [i * block_size, (i + 1) * block_size) for that
    group's layers; in a sliding-window group, blocks wholly behind the window are NO_PAGE (their pages went back).
    Every group's table has the same length."""

    tables: list[list[PageId]] = field(default_factory=lambda: [[]])  # one per KV group
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, computed once (prefix cache)
    num_offered_blocks: int = 0  # leading full blocks already offered to the prefix cache (while it holds them)
    num_released_blocks: int = 0  # leading blocks the window groups have given back (sliding windows only)

    @property
    def block_ids(self) -> list[PageId]:
        """The first group's table: a full-attention group's, so every block of the sequence is there (the only
        table of a model without sliding windows)."""
        return self.tables[0]

    @property
    def num_blocks(self) -> int:
        return len(self.tables[0])

    def held_pages(self) -> list[PageId]:
        """Every page the sequence holds, all groups, NO_PAGE entries left out."""
        return [page for table in self.tables for page in table if page >= 0]


class KVSequence(Protocol):
    """What the KV cache manager reads of a sequence."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V are in the sequence's blocks."""
        ...

    @property
    def cache_salt(self) -> str | None:
        """Part of block 0's hash: sequences with other salts never share blocks (the platform's tenants)."""
        ...

    @property
    def adapter_digest(self) -> str | None:
        """Part of block 0's hash too: K/V computed under another adapter is other K/V."""
        ...

    @property
    def blocks(self) -> SequenceBlocks: ...

    def tokens(self, start: int, end: int) -> list[int]: ...


__all__ = ["KVSequence", "SequenceBlocks"]
