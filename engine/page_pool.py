"""One preallocated pool of fixed-size pages per device, shared by KV blocks and (from the multi-LoRA work on)
adapter weights, as in S-LoRA's unified paging.

Physically there is one tensor per layer, `[num_pages, page_elems]`; a page id names the same row in every
layer, so one allocation serves all layers. A KV block is one page: its row holds K and V of `block_size`
tokens for that layer. Pages carry reference counts; the free pages are a stack, so allocate and free are O(1)
per page.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import NewType

import numpy as np
import torch

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
    by_kind: dict[str, int]  # pages in use, per PageKind

    @property
    def used_fraction(self) -> float:
        return 0.0 if self.num_pages == 0 else 1 - self.num_free / self.num_pages


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
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids go out first
        self._ref_cnt = [0] * num_pages
        self._kind: list[PageKind | None] = [None] * num_pages
        self._in_use: Counter[PageKind] = Counter()

    @property
    def page_bytes(self) -> int:
        return len(self.storage) * self.page_elems * self.storage[0].element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int, kind: PageKind) -> list[PageId]:
        """Take `num_pages` free pages with reference count 1."""
        if num_pages > len(self._free):
            raise PoolExhausted(f"asked for {num_pages} pages, {len(self._free)} free")
        pages: list[PageId] = []
        for _ in range(num_pages):
            page = self._free.pop()
            self._ref_cnt[page] = 1
            self._kind[page] = kind
            pages.append(PageId(page))
        self._in_use[kind] += num_pages
        return pages

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
                self._free.append(page)

    def ref_cnt(self, page: PageId) -> int:
        return self._ref_cnt[page]

    def usage(self) -> PoolUsage:
        return PoolUsage(
            num_pages=self.num_pages,
            num_free=len(self._free),
            page_bytes=self.page_bytes,
            by_kind={kind.value: self._in_use[kind] for kind in PageKind},
        )

    def kv_layer(self, layer: int, num_kv_heads: int, block_size: int, head_dim: int) -> KVLayer:
        """Views of `layer`'s pages as a KV cache (a KV block fills exactly one page)."""
        if 2 * num_kv_heads * block_size * head_dim != self.page_elems:
            raise ValueError("a KV block must fill exactly one page")
        kv = self.storage[layer].view(self.num_pages, 2, num_kv_heads, block_size, head_dim)
        return KVLayer(k=kv[:, 0], v=kv[:, 1], rows=self.storage[layer].view(-1, head_dim))


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's KV cache inside the pool. Page p holds K then V, each [num_kv_heads, block_size, head_dim]."""

    k: torch.Tensor  # [num_pages, num_kv_heads, block_size, head_dim] (strided view)
    v: torch.Tensor  # [num_pages, num_kv_heads, block_size, head_dim] (strided view)
    rows: torch.Tensor  # [num_pages * 2 * num_kv_heads * block_size, head_dim]: every head_dim vector, for writes


def kv_rows(
    block_ids: torch.Tensor, offsets: torch.Tensor, *, num_kv_heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices into KVLayer.rows where token i's K (and V) of head h go: [num_tokens * num_kv_heads] each,
    token-major. Computed once per step and used by every layer."""
    heads = torch.arange(num_kv_heads, device=block_ids.device, dtype=torch.int64)
    k_rows = ((block_ids * 2).unsqueeze(1) * num_kv_heads + heads) * block_size + offsets.unsqueeze(1)
    return k_rows.reshape(-1), (k_rows + num_kv_heads * block_size).reshape(-1)
