"""The scheduler's one interface to memory (`RequestMemory`): an admission either succeeds whole (adapter placed and
pinned, cached prefix taken, blocks allocated) or leaves the pool exactly as it was, at whichever stage it fails.

Driven on a real engine (the tiny checkpoint, a pool of a few dozen pages) with its adapter manager and prefix cache;
the pool is filled to the exact page by holding KV pages directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _support.adapters import make_peft_adapter

from loraplex.engine import LoRARequest, SamplingParams
from loraplex.engine.core.config import EngineConfig
from loraplex.engine.core.engine_core import EngineCore
from loraplex.engine.core.request import Request
from loraplex.engine.core.request_memory import Admission, Refusal, RequestMemory
from loraplex.engine.lora.manager import AdapterEntry, AdapterManager, AdapterState
from loraplex.engine.memory.page_pool import PageId, PageKind
from loraplex.engine.model.config import ModelConfig

pytestmark = pytest.mark.unit

BLOCK = 16
NUM_PAGES = 48


@pytest.fixture(scope="module")
def base(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama-gqa")


@pytest.fixture(scope="module")
def adapter_dir(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(base, tmp_path_factory.mktemp("memory-adapter"), seed=3, r=8, target_modules="all-linear")


@pytest.fixture
def core(base: Path) -> Iterator[EngineCore]:
    c = ModelConfig.from_dir(base)
    budget = NUM_PAGES * c.num_layers * 2 * c.num_kv_heads * BLOCK * c.head_dim * 4
    config = EngineConfig(model=base, dtype="float32", device="cpu", kv_budget=budget, max_model_len=256, max_loras=1)
    engine = EngineCore(config)
    assert engine.pool.num_pages == NUM_PAGES
    yield engine
    engine.adapters.shutdown()


def _memory(core: EngineCore) -> RequestMemory:
    return core.scheduler.memory


def _request(name: str, tokens: list[int], adapter: AdapterEntry | None = None) -> Request:
    return Request(name, tokens, SamplingParams(max_tokens=4), max_tokens=4, adapter=adapter)


def _loaded(core: EngineCore, adapter_dir: Path) -> AdapterEntry:
    entry = core.adapters.request(core.resolve_lora(LoRARequest("a", adapter_dir)))
    while entry.state is AdapterState.LOADING:
        core.adapters.wait_for_loads(timeout=1)
        core.adapters.poll()
    assert entry.state is AdapterState.LOADED and entry.layout is not None
    return entry


def _snapshot(core: EngineCore) -> tuple[Any, ...]:
    """Everything an admission could change: the pool's pages, references and eviction list, the adapters'
    placement and pins, and the prefix cache's blocks."""
    pool = core.pool
    cache = core.kv.prefix_cache
    adapters = [(e.ref.digest, e.state, e.slot, tuple(e.pages), e.num_running) for e in core.adapters.entries.values()]
    return (
        pool.num_free,
        pool.num_evictable,
        tuple(pool.ref_cnt(PageId(p)) for p in range(pool.num_pages)),
        tuple(pool._evictable),
        tuple(adapters),
        cache.num_blocks if cache is not None else 0,
    )


def _hold(core: EngineCore, leave: int) -> list[PageId]:
    """Take free KV pages until only `leave` are free (evictable ones stay evictable)."""
    return core.pool.allocate(core.pool.num_free - leave, PageKind.KV)


def _cache_prefix(core: EngineCore, tokens: list[int]) -> None:
    """Run a request over `tokens` through the memory interface and finish it: its full blocks stay cached, idle."""
    memory = _memory(core)
    warm = _request("warm", tokens)
    admission = memory.admit(warm, budget=len(tokens))
    assert isinstance(admission, Admission)
    warm.num_computed_tokens = len(tokens)
    memory.computed(warm)
    memory.release(warm, running=True)


def test_an_adapter_still_loading_is_refused_and_changes_nothing(
    core: EngineCore, adapter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = AdapterManager._load
    monkeypatch.setattr(AdapterManager, "_load", lambda self, ref: release.wait(30) and original(self, ref))
    entry = core.adapters.request(core.resolve_lora(LoRARequest("a", adapter_dir)))
    before = _snapshot(core)
    assert _memory(core).admit(_request("r", list(range(20)), entry), budget=64) is Refusal.ADAPTER_NOT_READY
    assert _snapshot(core) == before
    release.set()


def test_no_room_for_a_loaded_adapter_leaves_it_unplaced(core: EngineCore, adapter_dir: Path) -> None:
    entry = _loaded(core, adapter_dir)
    assert entry.layout is not None
    _hold(core, leave=entry.layout.num_pages - 1)
    before = _snapshot(core)
    assert _memory(core).admit(_request("r", list(range(5)), entry), budget=64) is Refusal.NO_ROOM
    assert _snapshot(core) == before
    assert entry.state is AdapterState.LOADED and entry.slot is None


def test_room_for_the_adapter_but_not_its_blocks_places_nothing(core: EngineCore, adapter_dir: Path) -> None:
    """The adapter alone would fit; with the request's blocks it does not: the adapter is not placed either (a
    placement undone later would have evicted others' cached blocks or adapters for nothing)."""
    entry = _loaded(core, adapter_dir)
    assert entry.layout is not None
    tokens = list(range(3 * BLOCK))  # 3 blocks
    _hold(core, leave=entry.layout.num_pages + 2)
    before = _snapshot(core)
    assert _memory(core).admit(_request("r", tokens, entry), budget=64) is Refusal.NO_ROOM
    assert _snapshot(core) == before
    assert entry.slot is None


def test_a_prefix_hit_without_room_for_the_rest_stays_in_the_cache(core: EngineCore) -> None:
    shared = list(range(100, 100 + 2 * BLOCK))
    _cache_prefix(core, [*shared, 1])
    assert core.pool.num_evictable == 2  # the two full blocks, idle in the cache
    # The request needs its 2 cached blocks (taken off the eviction list) and 2 new ones: 4 of the free and
    # evictable pages. One free page and the two cached ones are 3.
    held = _hold(core, leave=1)
    request = _request("r", [*shared, *range(2 * BLOCK)])  # 4 blocks, 2 of them cached
    before = _snapshot(core)
    assert _memory(core).admit(request, budget=256) is Refusal.NO_ROOM
    assert _snapshot(core) == before
    assert request.blocks.block_ids == []
    # One more page is the room it needs: then it takes both cached blocks and two new ones.
    core.pool.release(held[:1])
    admission = _memory(core).admit(request, budget=256)
    assert admission == Admission(num_new_tokens=2 * BLOCK, num_cached_tokens=2 * BLOCK)
    assert len(request.blocks.block_ids) == 4
    assert core.pool.num_evictable == 0


def test_the_reserve_is_kept_to_the_page(core: EngineCore) -> None:
    tokens = list(range(2 * BLOCK + 1))  # 3 blocks
    _hold(core, leave=4)
    memory = _memory(core)
    before = _snapshot(core)
    assert memory.admit(_request("r", tokens), budget=64, reserve=2) is Refusal.NO_ROOM
    assert _snapshot(core) == before
    assert isinstance(memory.admit(_request("r", tokens), budget=64, reserve=1), Admission)
    assert core.pool.num_free == 1


def test_an_idle_resident_adapter_counts_the_pages_its_pin_takes_off_the_eviction_list(
    core: EngineCore, adapter_dir: Path
) -> None:
    entry = _loaded(core, adapter_dir)
    memory = _memory(core)
    first = _request("first", list(range(5)), entry)
    assert isinstance(memory.admit(first, budget=64), Admission)
    memory.release(first, running=True)  # resident and idle: its pages are evictable now
    adapter_pages = len(entry.pages)
    assert core.pool.num_evictable == adapter_pages
    _hold(core, leave=0)
    # Free: none. Evictable: the adapter's own pages, which pinning it takes away: a block more does not fit.
    before = _snapshot(core)
    assert memory.admit(_request("second", list(range(5)), entry), budget=64) is Refusal.NO_ROOM
    assert _snapshot(core) == before


def test_a_whole_admission_takes_everything_and_release_gives_it_back(core: EngineCore, adapter_dir: Path) -> None:
    entry = _loaded(core, adapter_dir)
    memory = _memory(core)
    empty = _snapshot(core)
    request = _request("r", list(range(40)), entry)
    admission = memory.admit(request, budget=16)  # a first chunk of the prompt
    assert admission == Admission(num_new_tokens=16, num_cached_tokens=0)
    assert entry.state is AdapterState.RESIDENT and entry.num_running == 1
    assert len(request.blocks.block_ids) == 1
    assert core.pool.num_evictable == 0  # a pinned adapter is not evictable
    memory.release(request, running=True)
    assert entry.num_running == 0 and core.pool.num_evictable == len(entry.pages)  # idle, resident, evictable
    assert core.pool.num_free == empty[0] - len(entry.pages)
