"""Draft counterparts of adapters: the LoRA a draft model runs for the rows of a request whose adapter has one.

Convention: an adapter's folder (or s3:// prefix) may hold a `draft/` folder (prefix) with a PEFT LoRA adapter of the
draft model, its two files as for any adapter. A request's rows then propose with the draft under that LoRA, which
proposes what the adapted target would say far more often than the bare draft does. Without one, or while it is not
resident, or when it does not fit the draft (its shapes are another model's), the rows propose with the bare draft:
never worse than having no counterpart, and a counterpart still loading never holds a row's speculation back.

Counterparts are adapters like any other, of a second AdapterManager built for the draft's ModelConfig over the
target's page pool (its own slot table and eviction key): loaded on worker threads (looking for `draft/` is too),
never stalling a step; placed in pool pages only when the pool has them now (free or evictable), pinned only while a
proposal runs, and otherwise idle in the pool's one LRU with cached KV blocks, idle target adapters and draft K/V.
So they never cost the target a request: any allocation of the target takes an idle counterpart's pages back.

Not thread-safe: the engine's thread calls it, through the DraftModelProposer.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engine.core.request import Request
from loraplex.engine.lora import DRAFT_FOLDER, AdapterError, adapter_digest
from loraplex.engine.lora.batch import LoraCompute
from loraplex.engine.lora.manager import AdapterEntry, AdapterManager, AdapterState
from loraplex.engine.lora.ref import S3_SCHEME, AdapterRef
from loraplex.engine.model.config import ModelConfig

logger = logging.getLogger(__name__)


def draft_source(source: str) -> str:
    """Where the draft counterpart of the adapter at `source` (a folder or an s3:// prefix) would be."""
    if source.startswith(S3_SCHEME):
        return f"{source.rstrip('/')}/{DRAFT_FOLDER}"
    return str(Path(source) / DRAFT_FOLDER)


@dataclass(slots=True, eq=False)
class _Counterpart:
    """What this proposer knows of one target adapter's (by digest) draft counterpart."""

    target: AdapterRef
    probe: Future[AdapterRef | None] | None  # looking for draft/ and hashing it, on a worker thread
    ref: AdapterRef | None = None  # the counterpart, once found (None: none, or unreadable)
    num_requests: int = 0  # requests of this target adapter the proposer has seen and not yet released


class DraftAdapters:
    """The draft counterparts of the target's adapters, for one DraftModelProposer."""

    def __init__(self, target: AdapterManager, draft_config: ModelConfig, device: torch.device) -> None:
        self.target = target
        self.manager = AdapterManager(
            target.pool, draft_config, target.config, reserved_pages=target.reserved_pages, pool_key="draft_adapter"
        )
        self.compute = LoraCompute(self.manager, device)
        self._probes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-lora-probe")
        self._counterparts: dict[str, _Counterpart] = {}  # by the target adapter's digest
        self._of_request: dict[Request, _Counterpart] = {}  # every request counted in a _Counterpart's num_requests
        self._named: dict[Request, AdapterEntry] = {}  # the counterpart each request named (request_started)
        self._pinned: list[AdapterEntry] = []  # one acquire per pin, until unpin_all

    @property
    def num_pages(self) -> int:
        """Pool pages the resident counterparts hold (idle ones evictable)."""
        return sum(len(entry.pages) for entry in self.manager.resident())

    def poll(self) -> None:
        """Collect finished loads; a counterpart that failed (unreadable, or shapes not the draft's) is only logged:
        its requests' rows propose with the bare draft."""
        for entry in self.manager.poll():
            logger.warning(
                "the draft counterpart %s could not be used (%s): its requests' rows propose with the bare draft",
                entry.ref,
                entry.error,
            )

    def pin(self, request: Request) -> AdapterEntry | None:
        """The counterpart to run the request's draft rows with now, resident and pinned until `unpin_all`; None for
        the bare draft (no adapter, no counterpart, not found yet, failed, or no room in the pool now). Places a loaded
        counterpart in pages the pool has now, evicting only what is evictable."""
        entry = self._named.get(request)
        if entry is None:
            ref = self._counterpart_ref(request)
            if ref is None:
                return None
            entry = self.manager.request(ref)
            self.manager.request_started(entry)  # kept while the request lives, so `entry` stays the manager's
            self._named[request] = entry
        if entry.state is AdapterState.FAILED or not self.manager.try_place(entry):
            return None
        self.manager.acquire(entry)
        self._pinned.append(entry)
        return entry

    def unpin_all(self) -> None:
        """The proposal is over: every counterpart `pin` gave goes back to the pool's eviction list (once idle)."""
        for entry in self._pinned:
            self.manager.release(entry)
        self._pinned.clear()

    def release(self, request: Request) -> None:
        """A request left the engine: it no longer names its counterpart, and what no request needs is forgotten."""
        entry = self._named.pop(request, None)
        if entry is not None:
            self.manager.request_finished(entry)
        counterpart = self._of_request.pop(request, None)
        if counterpart is not None:
            counterpart.num_requests -= 1
        if len(self._counterparts) > len(self.target.entries):
            self._forget_stale()

    def _counterpart_ref(self, request: Request) -> AdapterRef | None:
        """The request's counterpart, if it has one and looking for it has finished (started on first sight)."""
        if request.adapter is None:
            return None
        target = request.adapter.ref
        counterpart = self._counterparts.get(target.digest)
        if counterpart is None:
            counterpart = _Counterpart(target=target, probe=self._probes.submit(self._look_for, target))
            self._counterparts[target.digest] = counterpart
        if request not in self._of_request:
            self._of_request[request] = counterpart
            counterpart.num_requests += 1
        if counterpart.probe is not None:
            if not counterpart.probe.done():
                return None
            probe, counterpart.probe = counterpart.probe, None
            try:
                counterpart.ref = probe.result()
            except Exception as exc:  # the worker's error concerns this counterpart only
                logger.warning(
                    "the draft counterpart of adapter %s could not be read (%s): its requests' rows propose with the "
                    "bare draft",
                    target,
                    exc,
                )
        return counterpart.ref

    def _look_for(self, target: AdapterRef) -> AdapterRef | None:
        """Worker thread: the counterpart's name, source and digest, or None when the adapter has none. Raises
        AdapterError for a local draft/ folder that cannot be read."""
        source = draft_source(target.source)
        if not target.is_s3:
            if not Path(source).is_dir():
                return None
            files = self.manager.read_files(source)
        else:
            try:
                files = self.manager.read_files(source)
            except AdapterError as exc:  # S3 tells a missing prefix only by a failed read
                logger.info("adapter %s has no readable draft counterpart at %s: %s", target, source, exc)
                return None
        return AdapterRef(name=f"{target.name}/{DRAFT_FOLDER}", source=source, digest=adapter_digest(*files))

    def _forget_stale(self) -> None:
        """Forget the counterparts of target adapters that no request uses and the target manager has forgotten (in
        neither of its tiers): the table does not grow with every adapter ever served, and a later request looks
        for draft/ again."""
        for digest, counterpart in list(self._counterparts.items()):
            if counterpart.num_requests or digest in self.target.entries:
                continue
            del self._counterparts[digest]
            if counterpart.probe is not None:
                counterpart.probe.cancel()
            if counterpart.ref is not None:
                self.manager.unload(counterpart.ref.digest)  # refused while another request runs it
