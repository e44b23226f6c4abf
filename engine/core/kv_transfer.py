"""KV blocks between engines: the cached blocks a list of chained hashes names (export), blocks another engine
computed checked and adopted into this one's prefix cache (import), and a finished prompt's blocks held for a while
under a transfer id (pins), so a decode engine can fetch what a prefill engine computed.

Everything here runs on the engine thread (AsyncEngine.call), between steps: it reads and writes the page pool.

A block is named by the prefix cache's chained hash, which covers the tenant's cache salt, the adapter's content
digest and every token before it. The importing engine computes the hashes of its own request and adopts a fetched
block only where the block's hash and tokens are the ones it computed, from the first block on; at the first that
differs it stops, and the request computes the rest itself. So a block computed for another tenant, another adapter
or other tokens can never be served, whatever the peer sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.engine.memory.page_pool import PageId, PageKind
from loraplex.engine.memory.prefix_cache import PrefixCache, chain_hashes

if TYPE_CHECKING:
    from loraplex.engine.core.engine_core import EngineCore


class TransferRefused(ValueError):
    """Blocks that cannot be adopted here at all (another model's or layout's, or no prefix cache)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What two engines must share for one's pages to be the other's: the model's KV shape, block size and dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_groups: int = 1  # KV groups (sliding windows): a block has a page in each, of num_slots layer slots
    num_slots: int = 0  # 0: one slot per layer

    @classmethod
    def of(cls, core: EngineCore) -> KVLayout:
        c = core.model.config
        groups = core.kv_groups
        return cls(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            core.config.block_size,
            str(core.dtype).removeprefix("torch."),
            groups.num_groups,
            groups.num_slots if groups.num_groups > 1 else 0,
        )


@dataclass(slots=True)
class KVBlocks:
    """Full KV blocks as they travel: each block's chained hash and tokens, and its pages' contents in every layer."""

    layout: KVLayout
    hashes: list[bytes]
    tokens: list[tuple[int, ...]]
    data: torch.Tensor  # [num_blocks, num_groups * num_slots, page_elems] in the layout's dtype, on the CPU

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


def _cache(core: EngineCore) -> PrefixCache:
    cache = core.kv.prefix_cache
    if cache is None:
        raise TransferRefused("this engine runs without a prefix cache, which KV transfer goes through")
    if core.workers is not None:
        raise TransferRefused("KV transfer needs tensor_parallel_size 1")
    return cache


def request_hashes(
    core: EngineCore, token_ids: list[int], cache_salt: str | None, adapter_digest: str | None
) -> list[bytes]:
    """The hashes of the blocks a request of these tokens could take from the prefix cache (all full blocks but a
    last token's: prefix_cache.find's count)."""
    block_size = core.config.block_size
    return chain_hashes(token_ids, cache_salt, adapter_digest, block_size, (len(token_ids) - 1) // block_size)


def export_blocks(core: EngineCore, hashes: list[bytes]) -> KVBlocks:
    """The cached blocks of the longest leading run of `hashes` (maybe none), copied off the pool."""
    cache = _cache(core)
    found = cache.lookup(hashes)
    num_groups, storage = core.kv_groups.num_groups, core.pool.storage
    pages = torch.tensor([page for group_pages, _ in found for page in group_pages], dtype=torch.int64)
    pages = pages.to(core.pool.device)
    # Per slot [num_blocks * num_groups, page_elems], block-major: block b's group g is row b * num_groups + g.
    slots = [slot.index_select(0, pages) for slot in storage]
    if found:
        data = torch.stack(slots, dim=1).reshape(len(found), num_groups * len(storage), core.pool.page_elems)
    else:
        data = torch.empty(0, num_groups * len(storage), core.pool.page_elems)
    return KVBlocks(
        KVLayout.of(core), hashes[: len(found)], [tokens for _, tokens in found], data.to("cpu", core.dtype)
    )


def import_blocks(
    core: EngineCore, token_ids: list[int], cache_salt: str | None, adapter_digest: str | None, blocks: KVBlocks
) -> int:
    """Adopt the leading fetched blocks that are this request's (hash and tokens as it computes them) into the
    prefix cache; returns how many of the request's tokens they hold (0: it computes them all). Blocks cached here
    already count without being written again; the first block that is not the request's, and all after it, are
    refused, as are blocks beyond what the pool can free."""
    cache = _cache(core)
    layout = KVLayout.of(core)
    if blocks.layout != layout:
        raise TransferRefused(f"the blocks are of another model or layout ({blocks.layout}, here {layout})")
    expected = request_hashes(core, token_ids, cache_salt, adapter_digest)
    size = layout.block_size
    accepted = 0
    for index, (digest, tokens) in enumerate(zip(blocks.hashes, blocks.tokens, strict=True)):
        if index >= len(expected) or digest != expected[index]:
            break
        if tokens != tuple(token_ids[index * size : (index + 1) * size]):
            break
        if not cache.lookup([digest]):
            num_groups, num_slots = core.kv_groups.num_groups, len(core.pool.storage)
            if not core.pool.can_allocate(num_groups):
                break
            pages = core.pool.allocate(num_groups, PageKind.KV)
            source = blocks.data[index].to(core.pool.device).view(num_groups, num_slots, -1)
            for group, page in enumerate(pages):
                for slot, storage in enumerate(core.pool.storage):
                    storage[page].copy_(source[group, slot])
            if not cache.adopt(digest, tokens, pages):
                core.pool.release(pages)
        accepted += 1
    return accepted * size


@dataclass(slots=True)
class _Pin:
    pages: list[PageId]
    expires_at: float


@dataclass(slots=True)
class TransferPins:
    """Blocks held for a peer to fetch, by transfer id, each until released or its time to live runs out."""

    pins: dict[str, _Pin] = field(default_factory=dict)

    def pin(
        self,
        core: EngineCore,
        transfer_id: str,
        token_ids: list[int],
        cache_salt: str | None,
        adapter_digest: str | None,
        ttl_s: float,
    ) -> list[bytes]:
        """Hold the cached blocks a request of these tokens computed (its leading run in the cache) under
        `transfer_id`; returns their hashes, the ones a peer asks for."""
        cache = _cache(core)
        self.sweep(core)
        hashes = request_hashes(core, token_ids, cache_salt, adapter_digest)
        found = cache.lookup(hashes)
        pages = [page for group_pages, _ in found for page in group_pages]
        self.release(core, transfer_id)
        cache.take(pages)
        self.pins[transfer_id] = _Pin(pages, time.monotonic() + ttl_s)
        return hashes[: len(found)]

    def release(self, core: EngineCore, transfer_id: str) -> bool:
        """Let go of a transfer's blocks (they stay cached, evictable); False for an unknown or expired id."""
        pin = self.pins.pop(transfer_id, None)
        if pin is None:
            return False
        cache = _cache(core)
        core.pool.release(pin.pages)
        cache.released(pin.pages[::-1])
        return True

    def sweep(self, core: EngineCore, now: float | None = None) -> int:
        """Release every pin past its time to live; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [transfer_id for transfer_id, pin in self.pins.items() if pin.expires_at <= now]
        for transfer_id in expired:
            self.release(core, transfer_id)
        return len(expired)

    @property
    def num_pinned_pages(self) -> int:
        return sum(len(pin.pages) for pin in self.pins.values())
