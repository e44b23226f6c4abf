"""The page pool and the KV block tables built on it."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.core.request import Request
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.page_pool import PageId, PageKind, PagePool, PoolExhausted, kv_rows

pytestmark = pytest.mark.unit

HEADS, BLOCK, DIM = 2, 4, 8


def _pool(num_pages: int = 8, layers: int = 2) -> PagePool:
    return PagePool(
        num_pages=num_pages,
        num_layers=layers,
        page_elems=2 * HEADS * BLOCK * DIM,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def _request(num_prompt: int) -> Request:
    return Request("r", list(range(num_prompt)), SamplingParams(), max_tokens=16)


class TestPagePool:
    def test_allocate_release_and_usage(self) -> None:
        pool = _pool()
        pages = pool.allocate(3, PageKind.KV)
        assert pages == [0, 1, 2]  # lowest ids first
        assert pool.usage().by_kind == {"kv": 3, "adapter": 0}
        assert pool.num_free == 5
        pool.release(pages[:2])
        assert pool.num_free == 7
        assert pool.allocate(1, PageKind.ADAPTER) == [1]  # freed pages are reused first
        assert pool.usage().by_kind == {"kv": 1, "adapter": 1}

    def test_reference_counts(self) -> None:
        pool = _pool()
        (page,) = pool.allocate(1, PageKind.KV)
        pool.incref(page)
        pool.release([page])
        assert pool.ref_cnt(page) == 1
        assert pool.num_free == 7
        pool.release([page])
        assert pool.num_free == 8
        with pytest.raises(ValueError, match="released more often"):
            pool.release([page])
        with pytest.raises(ValueError, match="is free"):
            pool.incref(PageId(5))

    def test_exhaustion(self) -> None:
        pool = _pool(num_pages=2)
        assert pool.can_allocate(2)
        assert not pool.can_allocate(3)
        with pytest.raises(PoolExhausted):
            pool.allocate(3, PageKind.KV)
        assert pool.num_free == 2  # nothing taken by the failed call

    def test_page_bytes_and_zeroed_storage(self) -> None:
        pool = _pool(num_pages=4, layers=3)
        assert pool.page_bytes == 3 * 2 * HEADS * BLOCK * DIM * 4
        assert all(bool((layer == 0).all()) for layer in pool.storage)

    def test_kv_views_and_rows_address_the_same_memory(self) -> None:
        pool = _pool()
        layer = pool.kv_layer(1, HEADS, BLOCK, DIM)
        blocks = torch.tensor([5, 2])
        offsets = torch.tensor([3, 0])
        k_rows, v_rows = kv_rows(blocks, offsets, num_kv_heads=HEADS, block_size=BLOCK)
        k = torch.randn(2 * HEADS, DIM)
        v = torch.randn(2 * HEADS, DIM)
        layer.rows.index_copy_(0, k_rows, k)
        layer.rows.index_copy_(0, v_rows, v)
        torch.testing.assert_close(layer.k[5, :, 3], k[:HEADS])
        torch.testing.assert_close(layer.v[2, :, 0], v[HEADS:])
        assert bool((pool.storage[0] == 0).all())  # other layers untouched

    def test_kv_block_must_fill_a_page(self) -> None:
        with pytest.raises(ValueError, match="exactly one page"):
            _pool().kv_layer(0, HEADS, BLOCK * 2, DIM)


class TestKVCacheManager:
    def test_blocks_grow_with_tokens(self) -> None:
        kv = KVCacheManager(_pool(), BLOCK)
        request = _request(6)
        assert kv.blocks_needed(request, 6) == 2
        kv.grow(request, 6)
        request.num_computed_tokens = 6
        assert kv.blocks_needed(request, 2) == 0  # fills block 1
        assert kv.blocks_needed(request, 3) == 1
        kv.grow(request, 3)
        assert len(request.blocks.block_ids) == 3

    def test_free_gives_everything_back(self) -> None:
        pool = _pool()
        kv = KVCacheManager(pool, BLOCK)
        request = _request(12)
        kv.grow(request, 12)
        assert pool.num_free == 5
        kv.release(request)
        assert pool.num_free == 8
        assert request.blocks.block_ids == []

    def test_reserve(self) -> None:
        kv = KVCacheManager(_pool(num_pages=3), BLOCK)
        request = _request(8)
        assert kv.can_grow(request, 8)
        hit = kv.find_prefix(request)
        assert kv.admission_pages(request, hit, 8) == 2  # with 2 kept free for others, 4 pages would be needed
        assert not kv.pool.can_allocate(kv.admission_pages(request, hit, 8) + 2)
