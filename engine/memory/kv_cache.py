"""KV cache bookkeeping: which pages hold each sequence's keys and values, and which of them the prefix cache
shares between sequences.

The manager knows a sequence through `KVSequence`, what it reads of one (the engine's `Request` is one), and keeps
its own state of each in the sequence's `SequenceBlocks`, which nothing else writes. Admission comes in two halves
so that a caller holding other memory too (an adapter) can decide all of it before anything changes:
`find_prefix` and `admission_pages` only read; `take_prefix` and `grow` then change the pool, and cannot fail once
`admission_pages` said the pages are there.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.memory.page_pool import PageId, PageKind, PagePool
from loraplex.engine.memory.prefix_cache import PrefixCache
from loraplex.engine.memory.sequence import KVSequence, SequenceBlocks


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached blocks a sequence's tokens start with, found but not yet taken."""

    pages: list[PageId]
    num_tokens: int  # tokens they hold: the sequence's computed tokens once they are taken
    num_idle: int  # of the pages, those only the cache holds: taking them takes them off the eviction list


NO_HIT = PrefixHit(pages=[], num_tokens=0, num_idle=0)


class KVCacheManager:
    """Grows and frees sequences' block tables in the shared page pool. With a prefix cache, a sequence's leading
    full blocks may be pages another sequence computed; they are never written again (only blocks past the match
    are)."""

    def __init__(self, pool: PagePool, block_size: int, *, prefix_caching: bool = False) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache = PrefixCache(pool, block_size) if prefix_caching else None

    def blocks_needed(self, seq: KVSequence, num_new_tokens: int, *, num_computed: int | None = None) -> int:
        """Blocks to add so that `num_new_tokens` more tokens (after `num_computed`, default the sequence's
        computed tokens) have room."""
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.blocks.block_ids))

    # --- admission -------------------------------------------------------------------------------------------------

    def find_prefix(self, seq: KVSequence) -> PrefixHit:
        """The cached blocks a sequence that holds none starts with (changes nothing)."""
        if self.prefix_cache is None or seq.blocks.block_ids or seq.num_computed_tokens:
            return NO_HIT
        pages = self.prefix_cache.find(seq)
        num_idle = sum(1 for page in pages if self.pool.ref_cnt(page) == 1)
        return PrefixHit(pages=pages, num_tokens=len(pages) * self.block_size, num_idle=num_idle)

    def admission_pages(self, seq: KVSequence, hit: PrefixHit, num_new_tokens: int) -> int:
        """How many of the pool's free and evictable pages admitting `seq` with `hit` and room for `num_new_tokens`
        past it uses: the blocks to allocate, and the hit's idle pages, which stop being evictable."""
        needed = -(-(hit.num_tokens + num_new_tokens) // self.block_size) - len(hit.pages)
        return max(0, needed) + hit.num_idle

    def take_prefix(self, seq: KVSequence, hit: PrefixHit) -> None:
        """Give a sequence that holds no blocks the hit's pages, each with a reference (off the eviction list)."""
        if not hit.pages:
            return
        assert self.prefix_cache is not None, "a hit comes from the prefix cache"
        assert not seq.blocks.block_ids, "only a sequence that holds no blocks takes a prefix"
        self.prefix_cache.take(hit.pages)
        seq.blocks.block_ids = list(hit.pages)

    def record_hit(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count a first admission in the prefix cache's statistics (a restart after preemption is not one)."""
        if self.prefix_cache is not None:
            self.prefix_cache.stats.queried_tokens += num_prompt_tokens
            self.prefix_cache.stats.hit_tokens += num_cached_tokens

    # --- a running sequence --------------------------------------------------------------------------------------

    def can_grow(self, seq: KVSequence, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self.blocks_needed(seq, num_new_tokens))

    def grow(self, seq: KVSequence, num_new_tokens: int, *, num_computed: int | None = None) -> None:
        """Allocate the blocks `num_new_tokens` more tokens need (raises PoolExhausted if they are not there)."""
        needed = self.blocks_needed(seq, num_new_tokens, num_computed=num_computed)
        if needed:
            seq.blocks.block_ids.extend(self.pool.allocate(needed, PageKind.KV))

    def shrink(self, seq: KVSequence, num_tokens: int) -> None:
        """Give back the blocks past the sequence's first `num_tokens` tokens: a step that verified speculative
        tokens grew the sequence for all of them, and the K/V of those it refused is garbage. The block holding the
        boundary stays (its later slots are written again by the next step). Blocks offered to the prefix cache are
        never among those given back: only computed tokens' full blocks are offered, and a refused token is never
        counted computed."""
        blocks = seq.blocks
        keep = -(-num_tokens // self.block_size)
        if keep < blocks.num_offered_blocks:
            raise ValueError(
                f"cannot shrink below the {blocks.num_offered_blocks} blocks offered to the prefix cache "
                f"(asked to keep {num_tokens} tokens)"
            )
        if len(blocks.block_ids) > keep:
            surplus = blocks.block_ids[keep:]
            del blocks.block_ids[keep:]
            self.pool.release(surplus)

    def cache_computed(self, seq: KVSequence) -> None:
        """After a step: offer the sequence's newly completed full blocks to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq)

    def release(self, seq: KVSequence) -> None:
        """Give back every block of the sequence (finish, abort or preemption); cached ones stay, evictable."""
        blocks = seq.blocks
        if blocks.block_ids:
            pages = blocks.block_ids
            self.pool.release(pages)
            blocks.block_ids = []
            blocks.num_offered_blocks = 0  # a restart (after preemption) offers its blocks again
            if self.prefix_cache is not None:
                self.prefix_cache.released(pages[::-1])


__all__ = ["NO_HIT", "KVCacheManager", "KVSequence", "PrefixHit", "SequenceBlocks"]
