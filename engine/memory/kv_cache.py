"""KV cache bookkeeping: which pages hold each sequence's keys and values, and which of them the prefix cache
shares between sequences.

The manager knows a sequence through `KVSequence`, what it reads of one (the engine's `Request` is one), and keeps
its own state of each in the sequence's `SequenceBlocks`, which nothing else writes. Admission comes in two halves
so that a caller holding other memory too (an adapter) can decide all of it before anything changes:
`find_prefix` and `admission_pages` only read; `take_prefix` and `grow` then change the pool, and cannot fail once
`admission_pages` said the pages are there.

Each block of a sequence takes one page in every KV group (kv_groups.py): one page for a model without sliding windows.
After each step, the blocks a sliding-window group no longer reads (wholly behind the window of every query still to
come) go back: to the pool, or, where the prefix cache holds them, to its eviction list. The scheduler never sees
groups: it asks for room in tokens, and the counts here are pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.memory.kv_groups import NO_PAGE, KVGroups
from loraplex.engine.memory.page_pool import PageId, PageKind, PagePool
from loraplex.engine.memory.prefix_cache import PrefixCache
from loraplex.engine.memory.sequence import KVSequence, SequenceBlocks


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached blocks a sequence's tokens start with, found but not yet taken."""

    tables: list[list[PageId]] = field(default_factory=list)  # per KV group; NO_PAGE where a window needs none
    num_tokens: int = 0  # tokens they hold: the sequence's computed tokens once they are taken
    num_idle: int = 0  # of the pages, those only the cache holds: taking them takes them off the eviction list

    @property
    def num_blocks(self) -> int:
        return len(self.tables[0]) if self.tables else 0

    @property
    def pages(self) -> list[PageId]:
        """Every page of the hit, all groups."""
        return [page for table in self.tables for page in table if page >= 0]


NO_HIT = PrefixHit()


class KVCacheManager:
    """Grows and frees sequences' block tables in the shared page pool. With a prefix cache, a sequence's leading
    full blocks may be pages another sequence computed; they are never written again (only blocks past the match
    are)."""

    def __init__(
        self, pool: PagePool, block_size: int, *, prefix_caching: bool = False, groups: KVGroups | None = None
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.groups = groups if groups is not None else KVGroups(len(pool.storage), ())
        self.num_groups = max(1, self.groups.num_groups)
        self.prefix_cache = PrefixCache(pool, block_size, groups=self.groups) if prefix_caching else None

    def _new_tables(self) -> list[list[PageId]]:
        return [[] for _ in range(self.num_groups)]

    def blocks_needed(self, seq: KVSequence, num_new_tokens: int, *, num_computed: int | None = None) -> int:
        """Pages to add so that `num_new_tokens` more tokens (after `num_computed`, default the sequence's computed
        tokens) have room: one per new block in every KV group."""
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - seq.blocks.num_blocks) * self.num_groups

    # --- admission -------------------------------------------------------------------------------------------------

    def find_prefix(self, seq: KVSequence) -> PrefixHit:
        """The cached blocks a sequence that holds none starts with (changes nothing)."""
        if self.prefix_cache is None or seq.blocks.num_blocks or seq.num_computed_tokens:
            return NO_HIT
        tables = self.prefix_cache.find(seq)
        if not tables or not tables[0]:
            return NO_HIT
        pages = [page for table in tables for page in table if page >= 0]
        num_idle = sum(1 for page in pages if self.pool.ref_cnt(page) == 1)
        return PrefixHit(tables=tables, num_tokens=len(tables[0]) * self.block_size, num_idle=num_idle)

    def admission_pages(self, seq: KVSequence, hit: PrefixHit, num_new_tokens: int) -> int:
        """How many of the pool's free and evictable pages admitting `seq` with `hit` and room for `num_new_tokens`
        past it uses: the blocks to allocate, and the hit's idle pages, which stop being evictable."""
        needed = -(-(hit.num_tokens + num_new_tokens) // self.block_size) - hit.num_blocks
        return max(0, needed) * self.num_groups + hit.num_idle

    def take_prefix(self, seq: KVSequence, hit: PrefixHit) -> None:
        """Give a sequence that holds no blocks the hit's pages, each with a reference (off the eviction list)."""
        if not hit.num_blocks:
            return
        assert self.prefix_cache is not None, "a hit comes from the prefix cache"
        assert not seq.blocks.num_blocks, "only a sequence that holds no blocks takes a prefix"
        self.prefix_cache.take(hit.pages)
        seq.blocks.tables = [list(table) for table in hit.tables]
        seq.blocks.num_released_blocks = 0
        if self.groups.has_windows:  # the hit's tables leave out what its windows no longer read
            seq.blocks.num_released_blocks = min(
                self.groups.first_needed_block(g, hit.num_tokens, self.block_size)
                for g in range(self.num_groups)
                if self.groups.groups[g].window is not None
            )

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
        if not needed:
            return
        pages = self.pool.allocate(needed, PageKind.KV)
        per_group = needed // self.num_groups
        if len(seq.blocks.tables) != self.num_groups:  # a sequence that holds nothing yet, made with one table
            seq.blocks.tables = self._new_tables()
        for g, table in enumerate(seq.blocks.tables):
            table.extend(pages[g * per_group : (g + 1) * per_group])

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
        if blocks.num_blocks > keep:
            surplus: list[PageId] = []
            for table in blocks.tables:
                surplus.extend(page for page in table[keep:] if page >= 0)
                del table[keep:]
            self.pool.release(surplus)

    def cache_computed(self, seq: KVSequence) -> None:
        """After a step: offer the sequence's newly completed full blocks to the prefix cache, then give back what
        its windows no longer read."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq)
        if self.groups.has_windows:
            self._slide(seq)

    def _slide(self, seq: KVSequence) -> None:
        """Release each window group's blocks wholly behind the window of the sequence's next token (the earliest
        query any later step computes)."""
        blocks = seq.blocks
        freed: list[PageId] = []
        first_kept = blocks.num_blocks
        for g, group in enumerate(self.groups.groups):
            if group.window is None:
                continue
            first = min(self.groups.first_needed_block(g, seq.num_computed_tokens, self.block_size), blocks.num_blocks)
            first_kept = min(first_kept, first)
            table = blocks.tables[g]
            for index in range(blocks.num_released_blocks, first):
                if table[index] >= 0:
                    freed.append(table[index])
                    table[index] = PageId(NO_PAGE)
        if not freed:
            return
        blocks.num_released_blocks = max(blocks.num_released_blocks, first_kept)
        self.pool.release(freed)
        if self.prefix_cache is not None:
            self.prefix_cache.released(freed)

    def release(self, seq: KVSequence) -> None:
        """Give back every block of the sequence (finish, abort or preemption); cached ones stay, evictable."""
        blocks = seq.blocks
        if blocks.num_blocks:
            pages = blocks.held_pages()
            self.pool.release(pages)
            if self.prefix_cache is not None:
                # Tail first, so a sequence's head (what other requests share) is evicted last. A block's window pages
                # that went back earlier, while the sequence ran, join it again where the cache still has them: a hit
                # at the end of a shared prefix needs them beside the block's full-attention pages.
                behind = self.prefix_cache.cached_pages(seq, min(blocks.num_released_blocks, blocks.num_offered_blocks))
                tail_first: list[PageId] = []
                for index in reversed(range(blocks.num_blocks)):
                    for g, table in enumerate(blocks.tables):
                        page = table[index] if table[index] >= 0 or index >= len(behind) else behind[index][g]
                        if page is not None and page >= 0:
                            tail_first.append(page)
                self.prefix_cache.released(tail_first)
            blocks.tables = self._new_tables()
            blocks.num_offered_blocks = 0  # a restart (after preemption) offers its blocks again
            blocks.num_released_blocks = 0

    def new_blocks(self) -> SequenceBlocks:
        """Empty tables for a sequence of this manager's groups."""
        return SequenceBlocks(tables=self._new_tables())


__all__ = ["NO_HIT", "KVCacheManager", "KVSequence", "PrefixHit", "SequenceBlocks"]
