"""Adapters across three tiers: pool pages <- host memory (LRU, bytes budget) <- source (a folder or s3://).

Loads run on worker threads (read, validate, pack) and never stall a step; the engine thread only polls for
finished loads and copies a loaded adapter into pool pages when a waiting request needs it. An adapter that
running requests use is pinned; once idle, its pages are offered to the pool's eviction list, so KV blocks and
idle adapters are evicted by one least-recently-used policy. A failed load fails only its own requests.

Each resident adapter holds a slot: the row of the page table the LoRA kernels read.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from loraplex.engine.lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterFormatError,
    LoraAdapter,
    adapter_digest,
    parse_adapter,
    read_adapter_dir,
)
from loraplex.engine.lora.layout import AdapterLayout, group_columns, layout_adapter, pack_layer
from loraplex.engine.lora.ref import S3_SCHEME, AdapterRef
from loraplex.engine.lora.sharding import shard_adapter
from loraplex.engine.memory.page_pool import PageId, PageKind, PagePool
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.tensor_parallel import ShardPlan

logger = logging.getLogger(__name__)


class AdapterState(enum.Enum):
    LOADING = "loading"  # a worker is reading and validating it
    LOADED = "loaded"  # packed in host memory, not in the pool
    RESIDENT = "resident"  # in pool pages (the host copy may or may not be kept)
    ABSENT = "absent"  # evicted from both tiers: the next request reloads it
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Packed:
    """A loaded adapter as it goes into pages: its layout and, per layer, the flat region of each rank (rank 0's
    alone without tensor parallelism; every rank's shard has the same layout)."""

    layout: AdapterLayout
    ranks: list[list[torch.Tensor]]  # [rank][layer]


class AdapterMirror(Protocol):
    """Told of every change of the slot table, so that other ranks' pools follow it (tensor parallelism)."""

    def placed(self, slot: int, pages: list[PageId], layout: AdapterLayout, ranks: list[list[torch.Tensor]]) -> None:
        """The adapter of `layout` now occupies `pages` under `slot`; `ranks[r]` is rank r's packed layers."""
        ...

    def evicted(self, slot: int) -> None: ...


@dataclass(eq=False)
class AdapterEntry:
    ref: AdapterRef
    state: AdapterState
    future: Future[Packed] | None = None
    error: Exception | None = None
    layout: AdapterLayout | None = None
    host: list[torch.Tensor] | None = None  # per layer, packed (rank 0's shard under tensor parallelism)
    others: list[list[torch.Tensor]] | None = None  # the other ranks' packed layers, kept and dropped with `host`
    pages: list[PageId] = field(default_factory=list)
    slot: int | None = None
    base: int | None = None  # element offset of the region when its pages are one run (views in place)
    num_running: int = 0  # running requests using it: while > 0 it is never evicted
    num_requests: int = 0  # unfinished requests (waiting or running) that name it: while > 0 it is never forgotten
    max_rank: int = 0
    last_used: int = 0  # the manager's clock at the last acquire or release
    placement: int = 0  # counts placements in the pool: anything derived from `pages` is keyed by it

    @property
    def host_bytes(self) -> int:
        tensors = [*(self.host or []), *(t for rank in self.others or [] for t in rank)]
        return sum(t.numel() * t.element_size() for t in tensors)


def write_pages(
    pool: PagePool, layer: int, pages: list[PageId], packed: torch.Tensor, layout: AdapterLayout | None = None
) -> None:
    """Copy an adapter's packed region of `layer` into its pages (in the slot and chunk its layout gives the layer),
    page by page."""
    slot = layout.slot(layer) if layout is not None else layer
    first = layout.base(layer, pool.page_elems) // pool.page_elems if layout is not None else 0
    flat = pool.storage[slot].view(-1)
    page_elems = pool.page_elems
    for i, start in enumerate(range(0, packed.numel(), page_elems)):
        chunk = packed[start : start + page_elems]
        base = pages[first + i] * page_elems
        flat[base : base + chunk.numel()].copy_(chunk)


def run_base(pages: list[PageId], page_elems: int) -> int | None:
    """The element offset of an adapter's region when its pages are one ascending run (the compute then reads it in
    place), else None."""
    contiguous = all(b == a + 1 for a, b in itertools.pairwise(pages))
    return pages[0] * page_elems if contiguous else None


def kernel_slot(entry: AdapterEntry | None) -> int:
    """An adapter's slot as the LoRA kernels' metadata names it: -1 for none (or one not resident)."""
    return -1 if entry is None or entry.slot is None else entry.slot


class S3Reader:
    """Reads adapter files from S3 with boto3 (endpoint configurable for MinIO/SeaweedFS)."""

    def __init__(
        self,
        endpoint_url: str | None,
        region: str | None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ) -> None:
        import boto3

        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
        )

    def read(self, uri: str, name: str, max_bytes: int) -> bytes:
        bucket, _, prefix = uri.removeprefix(S3_SCHEME).partition("/")
        key = f"{prefix.rstrip('/')}/{name}" if prefix else name
        try:
            head = self._client.head_object(Bucket=bucket, Key=key)
            if int(head["ContentLength"]) > max_bytes:
                raise AdapterFormatError(f"{name} is larger than {max_bytes} bytes", field=name)
            body: bytes = self._client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except AdapterError:
            raise
        except Exception as exc:  # botocore raises many types; the message is what the user needs
            raise AdapterFormatError(f"could not read {S3_SCHEME}{bucket}/{key}: {exc}", field=name) from None
        return body


def read_source(source: str, s3: S3Reader | None, max_bytes: int) -> tuple[bytes, bytes]:
    """The two files of an adapter, from a local folder or an s3:// prefix (through `s3`)."""
    if source.startswith(S3_SCHEME):
        assert s3 is not None, "s3:// sources need an S3Reader"
        return s3.read(source, CONFIG_FILE, max_bytes), s3.read(source, WEIGHTS_FILE, max_bytes)
    return read_adapter_dir(Path(source), max_weights_bytes=max_bytes)


@dataclass(frozen=True, slots=True)
class AdapterManagerConfig:
    max_loras: int = 64  # adapters resident in the pool at once (page-table rows)
    max_rank: int = 128
    host_budget_bytes: int = 2 * 2**30
    max_adapter_bytes: int = 1 * 2**30
    load_workers: int = 2
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None  # None: boto3's credential chain
    s3_secret_access_key: str | None = field(default=None, repr=False)


class AdapterManager:
    def __init__(
        self,
        pool: PagePool,
        model_config: ModelConfig,
        config: AdapterManagerConfig,
        *,
        reserved_pages: int = 0,
        pool_key: str = "adapter",
        shards: Sequence[ShardPlan] = (),
        mirror: AdapterMirror | None = None,
    ) -> None:
        """`model_config` is the model the adapters are for; it may have fewer layers than the pool (a draft model's
        adapters): each adapter uses its layers' share of its pages. `pool_key` tags this manager's entries on the
        pool's eviction list: managers sharing a pool need distinct ones, since the same adapter (digest) may be
        resident in both.

        Under tensor parallelism `shards` are every rank's plans (this pool is rank 0's): adapters are validated
        whole, then split (engine/lora/sharding.py), and `mirror` hears of each placement with the other ranks'
        shards and of each eviction, so their pools hold the same adapters at the same pages."""
        self.pool = pool
        self.reserved_pages = reserved_pages  # KV pages one request of the longest context may need
        self.pool_key = pool_key
        self.checkpoint_config = model_config  # what adapters are validated against
        self.shards = tuple(shards)
        self.mirror = mirror
        # What the pages hold and the compute reads: rank 0's local shapes under tensor parallelism.
        self.model_config = self.shards[0].local if len(self.shards) > 1 else model_config
        self.config = config
        self.entries: dict[str, AdapterEntry] = {}  # by digest
        self.slots: list[AdapterEntry | None] = [None] * config.max_loras
        self._host_lru: OrderedDict[str, None] = OrderedDict()
        self._host_bytes = 0
        self._executor = ThreadPoolExecutor(max_workers=config.load_workers, thread_name_prefix="lora-load")
        self._s3_reader: S3Reader | None = None
        self._s3_lock = threading.Lock()
        self.version = 0  # bumped whenever slots change, so per-slot tables can be cached
        self._failed: list[AdapterEntry] = []  # failed outside a load (too large for the pool), for poll()
        self._clock = 0

    # --- naming ------------------------------------------------------------------------------------------------

    def resolve(self, name: str, source: str | Path, digest: str | None = None) -> AdapterRef:
        """An AdapterRef for a name and a source; without a digest, the files are read and hashed now."""
        source = str(source)
        if digest is None:
            digest = adapter_digest(*self.read_files(source))
        return AdapterRef(name=name, source=source, digest=digest)

    def read_files(self, source: str) -> tuple[bytes, bytes]:
        """An adapter's two files from a folder or an s3:// prefix (any thread)."""
        return read_source(source, self._s3(source), self.config.max_adapter_bytes)

    def _s3(self, source: str) -> S3Reader | None:
        """The S3 client, made on first use by an s3:// source (boto3's endpoint and credentials by default)."""
        with self._s3_lock:
            if source.startswith(S3_SCHEME) and self._s3_reader is None:
                self._s3_reader = S3Reader(
                    self.config.s3_endpoint_url,
                    self.config.s3_region,
                    self.config.s3_access_key_id,
                    self.config.s3_secret_access_key,
                )
            return self._s3_reader

    # --- loading -------------------------------------------------------------------------------------------------

    def request(self, ref: AdapterRef) -> AdapterEntry:
        """The entry for `ref`, starting a load if it is in neither tier."""
        entry = self.entries.get(ref.digest)
        if entry is None:
            entry = AdapterEntry(ref=ref, state=AdapterState.ABSENT)
            self.entries[ref.digest] = entry
        if entry.state is AdapterState.ABSENT:
            entry.state = AdapterState.LOADING
            entry.future = self._executor.submit(self._load, ref)
        return entry

    def _load(self, ref: AdapterRef) -> Packed:
        """Worker thread: read, verify the digest, validate, split over the ranks, pack. Touches no engine state."""
        config_bytes, weights_bytes = self.read_files(ref.source)
        digest = adapter_digest(config_bytes, weights_bytes)
        if digest != ref.digest:
            raise AdapterFormatError(
                f"adapter {ref.name} changed: its files hash to {digest}, not {ref.digest}", field="digest"
            )
        adapter: LoraAdapter = parse_adapter(
            config_bytes, weights_bytes, self.checkpoint_config, max_rank=self.config.max_rank, dtype=self.pool.dtype
        )
        parts = [shard_adapter(adapter, plan) for plan in self.shards] if len(self.shards) > 1 else [adapter]
        layout = layout_adapter(parts[0], self.model_config, self.pool.page_elems, len(self.pool.storage))
        layers = range(self.model_config.num_layers)
        return Packed(layout, [[pack_layer(part, layout, i, self.pool.dtype) for i in layers] for part in parts])

    def poll(self) -> list[AdapterEntry]:
        """Collect finished loads (engine thread, non-blocking); returns the entries that failed just now."""
        failed, self._failed = self._failed, []
        for entry in self.entries.values():
            if entry.state is not AdapterState.LOADING or entry.future is None or not entry.future.done():
                continue
            future, entry.future = entry.future, None
            try:
                packed = future.result()
            except Exception as exc:  # the worker's error belongs to this adapter's requests only
                entry.state, entry.error = AdapterState.FAILED, exc
                logger.warning("adapter %s failed to load: %s", entry.ref, exc)
                failed.append(entry)
                continue
            entry.layout, entry.host, entry.others = packed.layout, packed.ranks[0], packed.ranks[1:]
            entry.state = AdapterState.LOADED
            entry.max_rank = max((g.rank for layer in entry.layout.layers for g in layer.groups.values()), default=0)
            self._remember_host(entry)
            logger.info("adapter %s loaded (%d pages)", entry.ref, entry.layout.num_pages)
        return failed

    # --- the pool tier -------------------------------------------------------------------------------------------

    def try_place(self, entry: AdapterEntry) -> bool:
        """Make a loaded adapter resident; False while it loads or the pool (or the slot table) has no room."""
        if entry.state is AdapterState.RESIDENT:
            return True
        if entry.state is AdapterState.ABSENT:  # dropped from both tiers since it was asked for: load it again
            self.request(entry.ref)
            return False
        if entry.state is not AdapterState.LOADED or entry.layout is None or entry.host is None:
            return False
        slot = next((i for i, s in enumerate(self.slots) if s is None), None)
        if slot is None:
            slot = self._free_a_slot()
            if slot is None:
                return False
        need = entry.layout.num_pages
        if need + self.reserved_pages > self.pool.num_pages:
            self._fail_too_large(entry, need)
            return False
        if not self.pool.can_allocate(need):
            return False
        # One run if there is one already; scattered pages rather than evicting for a run; a run by eviction last.
        pages = self.pool.allocate_run(need, PageKind.ADAPTER, evict=False)
        if pages is None and self.pool.num_free >= need:
            pages = self.pool.allocate(need, PageKind.ADAPTER)
        if pages is None:
            pages = self.pool.allocate_run(need, PageKind.ADAPTER, evict=True)
        if pages is None:
            pages = self.pool.allocate(need, PageKind.ADAPTER)
        entry.pages = pages
        entry.placement += 1
        entry.base = run_base(pages, self.pool.page_elems)
        for layer, packed in enumerate(entry.host):
            write_pages(self.pool, layer, pages, packed, entry.layout)
        if self.mirror is not None:
            self.mirror.placed(slot, pages, entry.layout, entry.others or [])
        entry.slot = slot
        self.slots[slot] = entry
        entry.state = AdapterState.RESIDENT
        self.version += 1
        self._maybe_idle(entry)
        self._trim_host()
        return True

    def _fail_too_large(self, entry: AdapterEntry, need: int) -> None:
        entry.state = AdapterState.FAILED
        entry.error = AdapterError(
            f"adapter {entry.ref.name} needs {need} pages and one request up to {self.reserved_pages}, "
            f"but the pool has {self.pool.num_pages}: raise the engine's KV budget"
        )
        self._failed.append(entry)

    def _free_a_slot(self) -> int | None:
        """All slots taken: evict the least recently used idle adapter to free one."""
        idle = [e for e in self.slots if e is not None and e.num_running == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda e: e.last_used)
        self.pool.unmark_evictable((self.pool_key, victim.ref.digest))
        self._evict(victim)
        return next(i for i, s in enumerate(self.slots) if s is None)

    def _evict(self, entry: AdapterEntry) -> None:
        """Give the adapter's pages and slot back (it must be idle)."""
        assert entry.num_running == 0, "an adapter in use is never evicted"
        self.pool.release(entry.pages)
        entry.pages, entry.base = [], None
        if entry.slot is not None:
            self.slots[entry.slot] = None
            if self.mirror is not None:
                self.mirror.evicted(entry.slot)
            entry.slot = None
        entry.state = AdapterState.LOADED if entry.host is not None else AdapterState.ABSENT
        self.version += 1
        logger.info("adapter %s evicted from the pool", entry.ref)
        self._drop_if_absent(entry)
        self._trim_host()

    # --- use by requests -----------------------------------------------------------------------------------------

    def request_started(self, entry: AdapterEntry) -> None:
        """A request that names this adapter has been queued: the entry is kept until it finishes."""
        entry.num_requests += 1

    def admission_pages(self, entry: AdapterEntry) -> int | None:
        """How many of the pool's free and evictable pages starting a request with this adapter uses, deciding
        nothing in the pool: 0 when it is resident and pinned already, its pages when resident and idle (pinning
        takes them off the eviction list), its layout's when loaded (placing allocates them). None when it cannot
        be placed now: still loading (an adapter dropped from both tiers is asked for again), loaded without a slot
        free or freeable, or too large for this pool (it fails, and `poll` reports it)."""
        if entry.state is AdapterState.RESIDENT:
            return len(entry.pages) if entry.num_running == 0 else 0
        if entry.state is AdapterState.ABSENT:
            self.request(entry.ref)
            return None
        if entry.state is not AdapterState.LOADED or entry.layout is None or entry.host is None:
            return None
        if all(s is not None for s in self.slots) and not any(e.num_running == 0 for e in self.resident()):
            return None
        need = entry.layout.num_pages
        if need + self.reserved_pages > self.pool.num_pages:
            self._fail_too_large(entry, need)
            return None
        return need

    def place_and_pin(self, entry: AdapterEntry) -> None:
        """Make the adapter resident (if it is not) and pin it for a request that starts running; only after
        `admission_pages` said it fits, and the pool has that room."""
        placed = self.try_place(entry)
        assert placed, f"adapter {entry.ref.name} did not fit where admission found room"
        self.acquire(entry)

    def acquire(self, entry: AdapterEntry) -> None:
        """A request starts running with this (resident) adapter: pin it."""
        if entry.num_running == 0:
            self.pool.unmark_evictable((self.pool_key, entry.ref.digest))
        entry.num_running += 1
        entry.last_used = self._tick()

    def release(self, entry: AdapterEntry) -> None:
        entry.num_running -= 1
        entry.last_used = self._tick()
        self._maybe_idle(entry)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _maybe_idle(self, entry: AdapterEntry) -> None:
        if entry.num_running == 0 and entry.state is AdapterState.RESIDENT:
            self.pool.mark_evictable((self.pool_key, entry.ref.digest), len(entry.pages), lambda: self._evict(entry))

    def unload(self, digest: str) -> bool:
        """Drop an adapter from every tier once no request (running or waiting) names it."""
        entry = self.entries.get(digest)
        if entry is None or entry.num_requests or entry.num_running:
            return False
        if entry.state is AdapterState.RESIDENT:
            self.pool.unmark_evictable((self.pool_key, digest))
            self._evict(entry)
        self._forget_host(entry)
        self.entries.pop(digest, None)
        return True

    # --- the host tier -------------------------------------------------------------------------------------------

    def _remember_host(self, entry: AdapterEntry) -> None:
        digest = entry.ref.digest
        self._host_lru[digest] = None
        self._host_lru.move_to_end(digest)
        self._host_bytes += entry.host_bytes
        self._trim_host(keep=digest)

    def _trim_host(self, keep: str | None = None) -> None:
        # Over budget: drop the oldest host copies that no waiting request is about to need: those of adapters
        # the pool holds, and those no unfinished request names (a later request reloads them from the source).
        for old in list(self._host_lru):
            if self._host_bytes <= self.config.host_budget_bytes:
                break
            entry_old = self.entries[old]
            if old != keep and (entry_old.state is AdapterState.RESIDENT or entry_old.num_requests == 0):
                self._forget_host(entry_old)

    def _forget_host(self, entry: AdapterEntry) -> None:
        if entry.ref.digest in self._host_lru:
            del self._host_lru[entry.ref.digest]
            self._host_bytes -= entry.host_bytes
        entry.host = entry.others = None
        if entry.state is AdapterState.LOADED:
            entry.state = AdapterState.ABSENT
            self._drop_if_absent(entry)

    def request_finished(self, entry: AdapterEntry) -> None:
        """A request that named this adapter has finished (or failed, or was aborted)."""
        entry.num_requests -= 1
        self._drop_if_absent(entry)

    def _drop_if_absent(self, entry: AdapterEntry) -> None:
        """An adapter in neither tier that no request names is only a name: forget it (the next request makes a new
        entry and loads it), so that the table, which every step's poll walks, does not grow with every adapter
        an engine has ever served."""
        idle = entry.num_requests == 0 and entry.num_running == 0
        if entry.state is AdapterState.ABSENT and idle and self.entries.get(entry.ref.digest) is entry:
            del self.entries[entry.ref.digest]

    def forget(self, entry: AdapterEntry) -> None:
        """Drop a failed entry so that the next request for it loads it again."""
        if entry.state is AdapterState.FAILED:
            self.entries.pop(entry.ref.digest, None)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` seconds for any running load to finish (when nothing else can run)."""
        pending = [e.future for e in self.entries.values() if e.future is not None and not e.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def group_columns(self, group: str) -> list[tuple[int, int]]:
        """Each module's column range in the base model's fused output of `group`, in the group's order."""
        return group_columns(self.model_config, group)

    def resident(self) -> list[AdapterEntry]:
        return [e for e in self.slots if e is not None]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
