"""KV cache bookkeeping: which pages hold each request's keys and values."""

from __future__ import annotations

from loraplex.engine.page_pool import PageKind, PagePool
from loraplex.engine.request import Request


class KVCacheManager:
    """Grows and frees requests' block tables in the shared page pool. Block i of a request holds the K/V of
    its tokens [i * block_size, (i + 1) * block_size)."""

    def __init__(self, pool: PagePool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

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

    def free(self, request: Request) -> None:
        """Give back every block of the request (finish, abort or preemption)."""
        if request.block_ids:
            self.pool.release(request.block_ids)
            request.block_ids = []
