"""The scheduler's one interface to device memory: a request's adapter, pinned in the pool while the request runs,
and its KV blocks, matched against the prefix cache when it starts, grown step by step, released when it stops.

`admit` decides the whole admission before it changes anything, in the spirit of vLLM v1's KV cache manager: the
adapter's pages, the cached prefix and the new blocks are counted against the pool's free and evictable pages
together, and only then taken, so an admission either succeeds whole or leaves the pool as it found it, and the
scheduler has nothing to roll back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from loraplex.engine.core.request import Request
from loraplex.engine.lora.manager import AdapterManager, AdapterState
from loraplex.engine.memory.kv_cache import NO_HIT, KVCacheManager, PrefixHit


class Refusal(enum.Enum):
    """Why a waiting request cannot start now."""

    ADAPTER_NOT_READY = "adapter_not_ready"  # still loading, or failed: requests behind it may start
    NO_ROOM = "no_room"  # the pool (or the adapter slot table) has no room now: nothing behind it starts either


@dataclass(frozen=True, slots=True)
class Admission:
    num_new_tokens: int  # tokens the request computes in this step
    num_cached_tokens: int  # leading tokens the prefix cache supplied (now computed)


class RequestMemory:
    """Adapters and KV blocks of requests, for the scheduler; owns no state of its own."""

    def __init__(self, kv: KVCacheManager, adapters: AdapterManager | None = None) -> None:
        self.kv = kv
        self.adapters = adapters

    def queued(self, request: Request) -> None:
        """A request joined the queue: its adapter's entry stays until it finishes."""
        if request.adapter is not None:
            self._adapters.request_started(request.adapter)

    def fits(self, request: Request, budget: int, *, reserve: int = 0) -> Refusal | None:
        """Would `admit` start the request now? None if so, else why not; changes nothing."""
        plan = self._plan(request, budget, reserve)
        return plan if isinstance(plan, Refusal) else None

    def _plan(self, request: Request, budget: int, reserve: int) -> tuple[PrefixHit, int] | Refusal:
        """The cached prefix and the new tokens of an admission that fits, or why it does not."""
        entry = request.adapter
        adapter_pages = 0
        if entry is not None:
            pages = self._adapters.admission_pages(entry)
            if pages is None:
                return Refusal.NO_ROOM if entry.state is AdapterState.LOADED else Refusal.ADAPTER_NOT_READY
            adapter_pages = pages
        hit = self.kv.find_prefix(request) if request.takes_prefix_hits else NO_HIT
        num_new = min(request.num_tokens - hit.num_tokens, budget)
        if not self.kv.pool.can_allocate(self.kv.admission_pages(request, hit, num_new) + adapter_pages + reserve):
            return Refusal.NO_ROOM
        return hit, num_new

    def admit(self, request: Request, budget: int, *, reserve: int = 0) -> Admission | Refusal:
        """Start a waiting request (which holds no blocks) with room for up to `budget` new tokens, keeping
        `reserve` pages free for running requests; or refuse it, leaving the pool exactly as it was."""
        plan = self._plan(request, budget, reserve)
        if isinstance(plan, Refusal):
            return plan
        hit, num_new = plan
        entry = request.adapter
        # In an order that keeps each allocation from evicting what a later step takes: the cached prefix first,
        # then the adapter (placed and pinned), then the new blocks.
        self.kv.take_prefix(request, hit)
        if entry is not None:
            self._adapters.place_and_pin(entry)
        self.kv.grow(request, num_new, num_computed=hit.num_tokens)
        return Admission(num_new_tokens=num_new, num_cached_tokens=hit.num_tokens)

    def record_first_start(self, request: Request) -> None:
        """Count a request's first start in the prefix cache's statistics (a restart after preemption finds its own
        blocks again, which is no hit for its user)."""
        self.kv.record_hit(request.num_prompt_tokens, request.num_cached_tokens)

    def can_grow(self, request: Request, num_new_tokens: int) -> bool:
        return self.kv.can_grow(request, num_new_tokens)

    def grow(self, request: Request, num_new_tokens: int) -> None:
        self.kv.grow(request, num_new_tokens)

    def computed(self, request: Request) -> None:
        """After a step advanced the request's computed tokens: its newly full blocks go to the prefix cache."""
        self.kv.cache_computed(request)

    def rollback(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (those of refused speculative tokens)."""
        self.kv.shrink(request, request.num_computed_tokens)

    def release(self, request: Request, *, running: bool) -> None:
        """Give back a request's blocks, and unpin its adapter if it was `running` (preempted or finished)."""
        self.kv.release(request)
        if running and request.adapter is not None:
            self._adapters.release(request.adapter)

    def finished(self, request: Request) -> None:
        """A request left the engine: its adapter's entry may be forgotten once no request names it."""
        if request.adapter is not None:
            self._adapters.request_finished(request.adapter)

    @property
    def _adapters(self) -> AdapterManager:
        assert self.adapters is not None, "a request with an adapter needs an adapter manager"
        return self.adapters


__all__ = ["Admission", "Refusal", "RequestMemory"]
