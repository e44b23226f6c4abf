"""The KV cache manager's rollback: refused speculative tokens give their blocks back, and nothing the prefix cache
was offered is ever given back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.page_pool import PagePool
from loraplex.engine.memory.sequence import SequenceBlocks

pytestmark = pytest.mark.unit

BLOCK = 4


@dataclass
class Sequence:
    """A KVSequence: tokens 0..n and a count of the computed ones."""

    token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    adapter_digest: str | None = None
    blocks: SequenceBlocks = field(default_factory=SequenceBlocks)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


def manager(num_pages: int = 16) -> KVCacheManager:
    pool = PagePool(num_pages=num_pages, num_layers=1, page_elems=8, dtype=torch.float32, device=torch.device("cpu"))
    return KVCacheManager(pool, BLOCK, prefix_caching=True)


def test_refused_tokens_give_their_blocks_back() -> None:
    kv = manager()
    seq = Sequence(token_ids=list(range(10)), num_computed_tokens=6)
    kv.grow(seq, 0)
    assert len(seq.blocks.block_ids) == 2  # 6 computed tokens
    kv.grow(seq, 1 + 5)  # a decode token and 5 proposals: room for 12 tokens
    assert len(seq.blocks.block_ids) == 3
    free_before = kv.pool.num_free
    kv.shrink(seq, 7)  # the decode token and none of the proposals kept: 7 tokens
    assert len(seq.blocks.block_ids) == 2
    assert kv.pool.num_free == free_before + 1
    kv.shrink(seq, 8)  # nothing past the kept tokens' blocks: no change
    assert len(seq.blocks.block_ids) == 2


def test_blocks_offered_to_the_prefix_cache_are_never_given_back() -> None:
    kv = manager()
    seq = Sequence(token_ids=list(range(12)), num_computed_tokens=8)
    kv.grow(seq, 0)
    kv.cache_computed(seq)  # two full blocks offered
    assert seq.blocks.num_offered_blocks == 2
    kv.grow(seq, 4)
    kv.shrink(seq, 9)
    assert len(seq.blocks.block_ids) == 3
    kv.shrink(seq, 7)  # keeps the two offered blocks, gives back the third
    assert len(seq.blocks.block_ids) == 2
    with pytest.raises(ValueError, match="offered to the prefix cache"):
        kv.shrink(seq, 4)
    assert len(seq.blocks.block_ids) == 2
