"""KV cache bookkeeping: which pages hold each request's keys and values, and which of them the prefix cache
shares between requests."""

from __future__ import annotations

from loraplex.engine.core.request import Request
from loraplex.engine.memory.page_pool import PageKind, PagePool
from loraplex.engine.memory.prefix_cache import PrefixCache


class KVCacheManager:
    """Grows and frees requests' block tables in the shared page pool. Block i of a request holds the K/V of
    its tokens [i * block_size, (i + 1) * block_size). With a prefix cache, a request's leading full blocks may
    be pages another request computed; they are never written again (only blocks past the match are)."""

    def __init__(self, pool: PagePool, block_size: int, *, prefix_caching: bool = False) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache = PrefixCache(pool, block_size) if prefix_caching else None

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int, *, reserve: int = 0) -> bool:
        """Whether the request's next `num_new_tokens` fit, leaving `reserve` pages free for others."""
        return self.pool.can_allocate(self.blocks_needed(request, num_new_tokens) + reserve)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.blocks_needed(request, num_new_tokens)
        if needed:
            request.block_ids.extend(self.pool.allocate(needed, PageKind.KV))

    def match_prefix(self, request: Request) -> int:
        """Give a request that holds no blocks the cached blocks its tokens start with; returns the tokens they
        cover (now counted as computed). Undo with `free` (and num_computed_tokens = 0) if it cannot start."""
        if self.prefix_cache is None or request.block_ids or request.num_computed_tokens:
            return 0
        pages = self.prefix_cache.match(request)
        request.block_ids = pages
        request.num_computed_tokens = len(pages) * self.block_size
        return request.num_computed_tokens

    def admitted(self, request: Request) -> None:
        """A request started: at its first start, what the prefix cache gave it is its `num_cached_tokens`. One
        recomputed after preemption finds its own blocks again, which is no cache hit for its user (nor a loss)."""
        if self.prefix_cache is None or request.num_preemptions:
            return
        request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        self.prefix_cache.stats.queried_tokens += request.num_prompt_tokens
        self.prefix_cache.stats.hit_tokens += request.num_cached_tokens

    def cache_computed(self, request: Request) -> None:
        """After a step: offer the request's newly completed full blocks to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(request)

    def free(self, request: Request) -> None:
        """Give back every block of the request (finish, abort or preemption); cached ones stay, evictable."""
        if request.block_ids:
            pages = request.block_ids
            self.pool.release(pages)
            request.block_ids = []
            request.num_offered_blocks = 0  # a restart (after preemption) offers its blocks again
            if self.prefix_cache is not None:
                self.prefix_cache.released(pages[::-1])
