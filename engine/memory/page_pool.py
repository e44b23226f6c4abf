"""One preallocated pool of fixed-size pages per device, shared by KV blocks and (from the multi-LoRA work on)
adapter weights, as in S-LoRA's unified paging.

Physically there is one tensor per layer, `[num_pages, page_elems]`; a page id names the same row in every
layer, so one allocation serves all layers. A KV block is one page: its row holds K and V of `block_size`
tokens for that layer. Pages carry reference counts; the free pages are a stack, so allocate and free are O(1)
per page.

Pages that are held but not needed right now (an idle adapter; later, cached KV blocks nobody references) are
registered as evictable, least recently used first. An allocation that finds too few free pages evicts from
that one list, whatever the kind: one policy for all. KV blocks come from the low page ids, adapters take
contiguous runs from the high end, so an adapter's pages usually form one run that compute can view in place.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import NewType

import numpy as np
import torch

from loraplex.engine.memory.kv_groups import KVGroups

PageId = NewType("PageId", int)


class PageKind(enum.StrEnum):
    KV = "kv"
    ADAPTER = "adapter"


class PoolExhausted(RuntimeError):
    """Not enough free pages; callers check `can_allocate` first, so this means a bookkeeping bug."""


@dataclass(frozen=True, slots=True)
class PoolUsage:
    num_pages: int
    num_free: int
    page_bytes: int  # all layers together
    by_kind: dict[str, int]  # pages held, per PageKind (evictable ones included)
    num_evictable: int = 0  # held pages an allocation may take back

    @property
    def used_fraction(self) -> float:
        return 0.0 if self.num_pages == 0 else 1 - self.num_free / self.num_pages


@dataclass(slots=True)
class _Evictable:
    num_pages: int
    evict: Callable[[], None]  # gives the pages back (calls release)


def _zeros(num_elems: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(num_elems, dtype=dtype, device=device)
    # numpy's zeros comes from calloc: the OS hands out zero pages lazily, so a large pool costs nothing until
    # it is written (torch.zeros would memset, and so commit, every byte at start).
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(num_elems * item, dtype=np.uint8))
    return raw.view(dtype)


class PagePool:
    def __init__(
        self,
        *,
        num_pages: int,
        num_layers: int,
        page_elems: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1:
            raise ValueError("the page pool needs at least one page; raise the KV budget")
        self.num_pages = num_pages
        self.page_elems = page_elems
        self.dtype = dtype
        self.device = device
        # storage[layer][page] is one page of that layer.
        self.storage = [
            _zeros(num_pages * page_elems, dtype, device).view(num_pages, page_elems) for _ in range(num_layers)
        ]
        # A stack (lowest ids out first). Pages taken as runs stay in it, marked not free, and are skipped on pop.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = np.ones(num_pages, dtype=np.bool_)
        self._num_free = num_pages
        self._ref_cnt = [0] * num_pages
        self._kind: list[PageKind | None] = [None] * num_pages
        self._in_use: Counter[PageKind] = Counter()
        self._evictable: OrderedDict[Hashable, _Evictable] = OrderedDict()  # least recently used first
        self._num_evictable = 0

    @property
    def page_bytes(self) -> int:
        return len(self.storage) * self.page_elems * self.storage[0].element_size()

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `num_pages` can be had now, evicting what is evictable if need be."""
        return num_pages <= self._num_free + self._num_evictable

    def allocate(self, num_pages: int, kind: PageKind) -> list[PageId]:
        """Take `num_pages` pages with reference count 1, evicting least recently used evictables if needed."""
        while num_pages > self._num_free and self._evictable:
            self._evict_oldest()
        if num_pages > self._num_free:
            raise PoolExhausted(f"asked for {num_pages} pages, {self._num_free} free")
        pages: list[PageId] = []
        while len(pages) < num_pages:
            page = self._free.pop()
            if self._is_free[page]:
                self._take(page, kind)
                pages.append(PageId(page))
        return pages

    def allocate_run(self, num_pages: int, kind: PageKind, *, evict: bool = True) -> list[PageId] | None:
        """Take `num_pages` consecutive pages, the highest free run; with `evict`, evict least recently used
        evictables until one exists. None if there is none (the caller may take scattered pages)."""
        while True:
            start = self._highest_free_run(num_pages)
            if start is not None:
                pages = [PageId(p) for p in range(start, start + num_pages)]
                for page in pages:
                    self._take(page, kind)
                return pages
            if not evict or not self._evictable:
                return None
            self._evict_oldest()

    def _highest_free_run(self, length: int) -> int | None:
        if length > self._num_free:
            return None
        # Runs of free pages, found on the whole bitmap at once (numpy): allocating a run is rare.
        padded = np.concatenate(([False], self._is_free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        starts, ends = edges[0::2], edges[1::2]
        fitting = np.flatnonzero(ends - starts >= length)
        if fitting.size == 0:
            return None
        last = fitting[-1]
        return int(ends[last]) - length

    def _take(self, page: int, kind: PageKind) -> None:
        self._is_free[page] = False
        self._num_free -= 1
        self._ref_cnt[page] = 1
        self._kind[page] = kind
        self._in_use[kind] += 1

    def mark_evictable(self, key: Hashable, num_pages: int, evict: Callable[[], None]) -> None:
        """Register held pages that an allocation may take back by calling `evict` (most recently used last)."""
        if key in self._evictable:
            self._num_evictable -= self._evictable.pop(key).num_pages
        self._evictable[key] = _Evictable(num_pages, evict)
        self._num_evictable += num_pages

    def unmark_evictable(self, key: Hashable) -> None:
        """The owner needs its pages again: take them off the eviction list."""
        entry = self._evictable.pop(key, None)
        if entry is not None:
            self._num_evictable -= entry.num_pages

    def _evict_oldest(self) -> None:
        _, entry = self._evictable.popitem(last=False)
        self._num_evictable -= entry.num_pages
        entry.evict()

    def incref(self, page: PageId) -> None:
        if self._ref_cnt[page] == 0:
            raise ValueError(f"page {page} is free")
        self._ref_cnt[page] += 1

    def release(self, pages: list[PageId]) -> None:
        """Drop one reference to each page; a page whose count reaches zero is free again."""
        for page in pages:
            count = self._ref_cnt[page]
            if count == 0:
                raise ValueError(f"page {page} released more often than taken")
            self._ref_cnt[page] = count - 1
            if count == 1:
                kind = self._kind[page]
                assert kind is not None
                self._in_use[kind] -= 1
                self._kind[page] = None
                self._is_free[page] = True
                self._num_free += 1
                self._free.append(page)

    def ref_cnt(self, page: PageId) -> int:
        return self._ref_cnt[page]

    def usage(self) -> PoolUsage:
        return PoolUsage(
            num_pages=self.num_pages,
            num_free=self._num_free,
            page_bytes=self.page_bytes,
            by_kind={kind.value: self._in_use[kind] for kind in PageKind},
            num_evictable=self._num_evictable,
        )

    def kv_layers(
        self, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, groups: KVGroups | None = None
    ) -> list[KVLayer]:
        """kv_layer of each of the model's `num_layers` layers: layer i in storage slot i, or where `groups` places
        it (its group's slot)."""
        if groups is None or not groups.groups:
            return [self.kv_layer(i, num_kv_heads, block_size, head_dim) for i in range(num_layers)]
        layers = []
        for layer in range(num_layers):
            group, slot = groups.place(layer)
            layers.append(self.kv_layer(slot, num_kv_heads, block_size, head_dim, group=group))
        return layers

    def kv_layer(self, slot: int, num_kv_heads: int, block_size: int, head_dim: int, *, group: int = 0) -> KVLayer:
        """Views of storage slot `slot`'s pages as a KV cache (a KV block fills exactly one page), for a layer of KV
        group `group`."""
        if kv_page_elems(num_kv_heads, block_size, head_dim) != self.page_elems:
            raise ValueError("a KV block must fill exactly one page")
        kv = self.storage[slot].view(self.num_pages, 2, num_kv_heads, block_size, head_dim)
        return KVLayer(k=kv[:, 0], v=kv[:, 1], rows=self.storage[slot].view(-1, head_dim), group=group)


def kv_page_elems(num_kv_heads: int, block_size: int, head_dim: int) -> int:
    """Elements of one page: one layer's K and V of `block_size` tokens (a KV block)."""
    return 2 * num_kv_heads * block_size * head_dim


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's KV cache inside the pool. Page p holds K then V, each [num_kv_heads, block_size, head_dim]."""

    k: torch.Tensor  # [num_pages, num_kv_heads, block_size, head_dim] (strided view)
    v: torch.Tensor  # [num_pages, num_kv_heads, block_size, head_dim] (strided view)
    rows: torch.Tensor  # [num_pages * 2 * num_kv_heads * block_size, head_dim]: every head_dim vector, for writes
    group: int = 0  # its KV group (kv_groups.py): the block table of that group addresses its pages


def kv_rows(
    block_ids: torch.Tensor, offsets: torch.Tensor, *, num_kv_heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices into KVLayer.rows where token i's K (and V) of head h go: [num_tokens * num_kv_heads] each,
    token-major. Computed once per step and used by every layer."""
    heads = torch.arange(num_kv_heads, device=block_ids.device, dtype=torch.int64)
    k_rows = ((block_ids * 2).unsqueeze(1) * num_kv_heads + heads) * block_size + offsets.unsqueeze(1)
    return k_rows.reshape(-1), (k_rows + num_kv_heads * block_size).reshape(-1)
