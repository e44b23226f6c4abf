"""LoRA for one step: which token ranges run which adapter, and adding their deltas to the base projections.

Whoever builds a forward (the runner; the draft model's proposer) sorts its sequences by adapter slot, so each
adapter's tokens form one segment (base-model rows form segments of slot -1). Built once per forward; every layer
reads the same segments. The deltas are computed by the SGMV kernels (kernels/sgmv.py: Triton on CUDA, the torch
path on a CPU), which read each adapter's matrices from its pool pages through the adapter manager's page table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraplex.engine.lora.layout import EXPERT_GROUPS, AdapterLayout, groups
from loraplex.engine.memory.page_pool import PageId, PagePool
from loraplex.engine.model.config import ModelConfig
from loraplex.kernels import native
from loraplex.kernels.sgmv import sgmv_expand, sgmv_shrink


def _lora_add(*args: torch.Tensor) -> None:
    """The native operator (kernels/csrc/cpu_ops.cpp); a module function, so a test can count its calls."""
    torch.ops.loraplex_cpu.lora_add(*args)


EXPERT_GROUP_NAMES = frozenset(name for name, _ in EXPERT_GROUPS)

# Steps whose adapter segments are all at most this long run LoRA on one thread (see LoraCompute.add).
SINGLE_THREAD_MAX_ROWS = 64


class PlacedAdapter(Protocol):
    """An adapter in pool pages, as the compute reads it (the manager's AdapterEntry; a tensor-parallel worker's
    mirror of one)."""

    @property
    def pages(self) -> list[PageId]: ...

    @property
    def base(self) -> int | None: ...

    @property
    def layout(self) -> AdapterLayout | None: ...


class AdapterSlots(Protocol):
    """The slot table the compute reads: the AdapterManager, or a tensor-parallel worker's mirror of rank 0's."""

    @property
    def version(self) -> int: ...  # changes whenever a slot does

    @property
    def slots(self) -> Sequence[PlacedAdapter | None]: ...

    @property
    def pool(self) -> PagePool: ...

    @property
    def model_config(self) -> ModelConfig: ...

    def group_columns(self, group: str) -> list[tuple[int, int]]: ...


@dataclass(slots=True)
class LoraSegment:
    start: int  # first token row
    end: int  # one past the last
    slot: int  # the adapter's slot; -1: base-model rows


@dataclass(slots=True)
class LoraBatch:
    segments: list[LoraSegment] = field(default_factory=list)  # tile the step's token rows, in order
    host: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, slot) per segment
    seg_starts: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int32))  # [segments + 1]
    seg_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # [segments]
    longest: int = 0  # rows of the longest adapter segment
    # The adapter segments as the native operator reads them, (start, end, slot) rows of an int64 [k, 3] tensor, or
    # None when a slot's pages are not one run: worked out at the first layer that asks, shared by the step's others.
    _native_segments: torch.Tensor | None = None
    _native_checked: bool = False

    def native_segments(self, bases: Sequence[int | None]) -> torch.Tensor | None:
        if not self._native_checked:
            rows = [segment for segment in self.host if segment[2] >= 0]
            if all(bases[slot] is not None for _, _, slot in rows):
                self._native_segments = torch.tensor(rows, dtype=torch.int64).view(-1, 3)
            self._native_checked = True
        return self._native_segments

    def __bool__(self) -> bool:
        return any(segment.slot >= 0 for segment in self.segments)

    @classmethod
    def tile(cls, slots: Sequence[int], query_lens: Sequence[int], device: torch.device) -> LoraBatch:
        """Segments tiling a forward's token rows, sequence i's query_lens[i] rows running the adapter in slots[i]
        (-1: none): one segment per run of consecutive sequences with the same slot. Empty when no sequence has one."""
        if all(slot < 0 for slot in slots):
            return cls()
        segments: list[LoraSegment] = []
        end = 0
        for slot, num_rows in zip(slots, query_lens, strict=True):
            start, end = end, end + int(num_rows)
            if segments and segments[-1].slot == slot:
                segments[-1].end = end
            else:
                segments.append(LoraSegment(start, end, slot))
        return cls.of(segments, device)

    @classmethod
    def of(cls, segments: list[LoraSegment], device: torch.device) -> LoraBatch:
        host = [(s.start, s.end, s.slot) for s in segments]
        starts = [0] + [end for _, end, _ in host]
        return cls(
            segments=segments,
            host=host,
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_slots=torch.tensor([slot for _, _, slot in host], dtype=torch.int32, device=device),
            longest=max((s.end - s.start for s in segments if s.slot >= 0), default=0),
        )


@dataclass(frozen=True, slots=True)
class _ModuleTable:
    out_start: int  # the module's columns in the group's fused output
    out_end: int
    b_offsets: torch.Tensor  # [num_slots] int64
    ranks: torch.Tensor  # [num_slots] int32
    h_cols: torch.Tensor  # [num_slots] int32: first column of the module's rows in the shrink output
    max_rank: int


@dataclass(frozen=True, slots=True)
class _GroupTable:
    a_offsets: torch.Tensor  # [num_slots] int64
    ranks: torch.Tensor  # [num_slots] int32: the group's total rank per slot (0: untouched)
    max_rank: int
    modules: tuple[_ModuleTable, ...]
    # The same tables as the native operator reads them (host int64): ranks [num_slots], each module's output
    # columns [modules, 2], and per module and slot (b_offset, rank, first column of h) [modules, num_slots, 3].
    native_ranks: torch.Tensor
    native_outputs: torch.Tensor
    native_modules: torch.Tensor
    # An expert group's tables are indexed by (adapter slot, expert) pairs, slot * experts + expert, each its own
    # slot to the kernels; so are its page table and slot bases (each adapter's repeated per expert).
    page_table: torch.Tensor | None = None
    bases: list[int | None] | None = None
    native_bases: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LoraStep:
    """One step's segments bound to the compute: the model's `LoraDelta` for that step."""

    compute: LoraCompute
    batch: LoraBatch
    _token_slots: torch.Tensor | None = None  # built by the first sparse layer that asks

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.compute.add(self.batch, layer, group, x, y)

    def experts(self, layer: int) -> ExpertStep | None:
        """The step's adapters on layer `layer`'s experts, or None when no adapter of the step adapts them."""
        if not self.compute.adapts_experts(layer, self.batch):
            return None
        if self._token_slots is None:
            num_tokens = self.batch.host[-1][1] if self.batch.host else 0
            slots = torch.full((num_tokens,), -1, dtype=torch.int64)
            for start, end, slot in self.batch.host:
                slots[start:end] = slot
            object.__setattr__(self, "_token_slots", slots.to(self.compute.device))
        assert self._token_slots is not None
        return ExpertStep(self.compute, layer, self._token_slots)


@dataclass(slots=True)
class ExpertStep:
    """One step's adapters on one sparse layer's experts: engine/model/layers/moe.py's `ExpertLora`.

    Its rows are the layer's (token, expert) pairs sorted by expert, then adapter slot; each run of one (slot, expert)
    is a segment of kernel slot slot * experts + expert (LoraCompute's expert tables). The segments are worked out
    once for the layer's two projections, which see the same rows."""

    compute: LoraCompute
    layer: int
    token_slots: torch.Tensor  # [num_tokens] int64: each token row's adapter slot, -1 for base rows
    _segments: tuple[torch.Tensor, LoraBatch] | None = None  # (the slots they were made for, the segments)

    def add(self, group: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor) -> None:
        """y[i] += x[i]'s delta under adapter slots[i] on expert experts[i], for rows sorted by expert, then slot."""
        if self._segments is None or self._segments[0] is not slots:
            pairs = torch.where(slots >= 0, slots * self.compute.num_experts + experts, -1)
            values, counts = torch.unique_consecutive(pairs, return_counts=True)
            segments, start = [], 0
            for value, count in zip(values.tolist(), counts.tolist(), strict=True):
                segments.append(LoraSegment(start, start + count, value))
                start += count
            self._segments = (slots, LoraBatch.of(segments, x.device))
        self.compute.add(self._segments[1], self.layer, group, x, y)


class LoraCompute:
    """Adds adapters' deltas to the outputs of the base model's fused projections, reading weights in the pool.

    Per-slot tables (offsets and ranks of every layer and group) are rebuilt only when the resident adapters
    change (the manager's version), not per step.
    """

    def __init__(self, adapters: AdapterSlots, device: torch.device) -> None:
        self.adapters = adapters
        self.device = device
        self._version = -1
        self._tables: dict[tuple[int, str], _GroupTable] = {}
        self._expert_slots: dict[int, frozenset[int]] = {}  # layer -> slots adapting its experts (_refresh)
        self._page_table = torch.zeros(0, 0, dtype=torch.int32)
        self._bases: list[int | None] = []
        self._native = device.type == "cpu" and adapters.pool.storage[0].dtype == torch.float32 and native.load()
        self._native_bases = torch.zeros(0, dtype=torch.int64)  # self._bases as int64, -1 for None

    def add(self, batch: LoraBatch, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of each segment] += x[rows] @ A.T @ B.T for the segment's adapter on (layer, group).

        x: [num_tokens, in_features] is the group's input; y: [num_tokens, fused out] is the base output.
        """
        self._refresh()
        table = self._tables.get((layer, group))
        if table is None or table.max_rank == 0:
            return
        bases = self._bases if table.bases is None else table.bases
        segments = self._native_segments(batch, x, y, bases) if batch.longest <= SINGLE_THREAD_MAX_ROWS else None
        if segments is not None:
            # Decode-sized segments of float32 adapters in contiguous slots: one native call for the whole
            # projection instead of a shrink and expands per segment (kernels/csrc/cpu_ops.cpp, lora_add).
            _lora_add(
                x,
                y,
                self.adapters.pool.storage[self._slot(layer)].view(-1),
                segments,
                self._native_bases if table.native_bases is None else table.native_bases,
                table.a_offsets,
                table.native_ranks,
                table.native_outputs,
                table.native_modules,
            )
        elif x.device.type == "cpu" and batch.longest <= SINGLE_THREAD_MAX_ROWS:
            # Small per-segment matmuls (decode): a thread team's fork and join costs more than the matmul itself
            # (decision 0019).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._add(batch, layer, table, x, y)
            finally:
                torch.set_num_threads(threads)
        else:
            self._add(batch, layer, table, x, y)

    def _slot(self, layer: int) -> int:
        """The pool storage slot layer `layer`'s adapter regions are in (AdapterLayout.slot)."""
        num_slots = len(self.adapters.pool.storage)
        return layer % num_slots if num_slots < self.adapters.model_config.num_layers else layer

    @property
    def num_experts(self) -> int:
        moe = self.adapters.model_config.moe
        return moe.num_experts if moe is not None else 1

    def adapts_experts(self, layer: int, batch: LoraBatch) -> bool:
        """Whether an adapter of the step (its batch) adapts layer `layer`'s experts."""
        self._refresh()
        adapting = self._expert_slots.get(layer, frozenset())
        return any(slot in adapting for _, _, slot in batch.host)

    def _native_segments(
        self, batch: LoraBatch, x: torch.Tensor, y: torch.Tensor, bases: Sequence[int | None]
    ) -> torch.Tensor | None:
        """The step's segments for the native operator, or None when it does not compute this call: not built or
        loaded, not float32, rows not contiguous, or an adapter slot of the step not in one ascending run of pages."""
        if not self._native or x.dtype != torch.float32 or y.dtype != torch.float32:
            return None
        if x.stride(1) != 1 or y.stride(1) != 1:
            return None
        return batch.native_segments(bases)

    def _add(self, batch: LoraBatch, layer: int, table: _GroupTable, x: torch.Tensor, y: torch.Tensor) -> None:
        pool = self.adapters.pool
        weights = pool.storage[self._slot(layer)].view(-1)
        page_table = self._page_table if table.page_table is None else table.page_table
        bases = self._bases if table.bases is None else table.bases
        h = sgmv_shrink(
            x,
            weights,
            page_table,
            table.a_offsets,
            table.ranks,
            batch.seg_starts,
            batch.seg_slots,
            page_elems=pool.page_elems,
            max_rank=table.max_rank,
            segments=batch.host,
            slot_bases=bases,
        )
        for module in table.modules:
            if module.max_rank == 0:
                continue
            sgmv_expand(
                h,
                weights,
                page_table,
                module.b_offsets,
                module.ranks,
                batch.seg_starts,
                batch.seg_slots,
                y[:, module.out_start : module.out_end],
                page_elems=pool.page_elems,
                h_col_offsets=module.h_cols,
                segments=batch.host,
                slot_bases=bases,
            )

    def _refresh(self) -> None:
        if self._version == self.adapters.version:
            return
        slots = self.adapters.slots
        max_pages = max((len(e.pages) for e in slots if e is not None), default=1)
        page_table = torch.zeros(len(slots), max_pages, dtype=torch.int32)
        for i, entry in enumerate(slots):
            if entry is not None:
                page_table[i, : len(entry.pages)] = torch.tensor(entry.pages, dtype=torch.int32)
        self._page_table = page_table.to(self.device)
        self._bases = [entry.base if entry is not None else None for entry in slots]
        self._native_bases = torch.tensor([-1 if b is None else b for b in self._bases], dtype=torch.int64)
        self._tables = {}
        # The model's layers, not the pool's: a draft model's adapters share a pool sized for its target's layers.
        for layer in range(self.adapters.model_config.num_layers):
            for group, modules in groups(self.adapters.model_config):
                self._tables[(layer, group)] = self._group_table(slots, layer, group, modules)
        # Per layer, the slots whose adapter adapts its experts (one table entry per expert: read the first).
        experts = self.num_experts
        self._expert_slots = {
            layer: frozenset(
                slot
                for slot in range(len(slots))
                for group in EXPERT_GROUP_NAMES
                if (table := self._tables.get((layer, group))) is not None and int(table.native_ranks[slot * experts])
            )
            for layer in range(self.adapters.model_config.num_layers)
        }
        self._version = self.adapters.version

    def _group_table(
        self, slots: Sequence[PlacedAdapter | None], layer: int, group: str, modules: tuple[str, ...]
    ) -> _GroupTable:
        """The kernels' tables of (layer, group): one entry per adapter slot, or for an expert group one per (slot,
        expert), slot * experts + expert, whose A and B^T are that expert's rows of the adapter's (layout.py)."""
        experts = self.num_experts if group in EXPERT_GROUP_NAMES else 1
        placements = [
            None if e is None or e.layout is None else e.layout.layers[layer].groups.get(group) for e in slots
        ]
        # The layer's region's offset within each adapter's pages (its chunk of pages, when a page's slots are fewer
        # than the layers).
        page_elems = self.adapters.pool.page_elems
        bases = [0 if e is None or e.layout is None else e.layout.base(layer, page_elems) for e in slots]
        # Per kernel slot: (the group's placement, its region's base, the expert).
        entries = [(p, base, e) for p, base in zip(placements, bases, strict=True) for e in range(experts)]

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        tables: list[_ModuleTable] = []
        shapes = self.adapters.group_columns(group)
        for module, (out_start, out_end) in zip(modules, shapes, strict=True):
            found = [
                None if p is None else next((m for m in p.modules if m.module == module), None) for p, _, _ in entries
            ]
            ranks = [0 if m is None else m.rank for m in found]
            b_offsets = [
                0 if m is None else m.b_offset + base + e * m.rank * (out_end - out_start)
                for m, (_, base, e) in zip(found, entries, strict=True)
            ]
            tables.append(
                _ModuleTable(
                    out_start=out_start,
                    out_end=out_end,
                    b_offsets=tensor(b_offsets, torch.int64),
                    ranks=tensor(ranks, torch.int32),
                    h_cols=tensor([0 if m is None else m.h_offset for m in found], torch.int32),
                    max_rank=max(ranks, default=0),
                )
            )
        group_ranks = [0 if p is None else p.rank for p, _, _ in entries]
        native_modules = (
            torch.stack(
                [torch.stack([m.b_offsets.cpu(), m.ranks.cpu().long(), m.h_cols.cpu().long()], dim=1) for m in tables]
            )
            if tables
            else torch.zeros(0, len(entries), 3, dtype=torch.int64)
        )
        a_offsets = [0 if p is None else p.a_offset + base + e * p.rank * p.in_features for p, base, e in entries]
        return _GroupTable(
            a_offsets=tensor(a_offsets, torch.int64),
            ranks=tensor(group_ranks, torch.int32),
            max_rank=max(group_ranks, default=0),
            modules=tuple(tables),
            native_ranks=torch.tensor(group_ranks, dtype=torch.int64),
            native_outputs=torch.tensor([[m.out_start, m.out_end] for m in tables], dtype=torch.int64).view(-1, 2),
            native_modules=native_modules.contiguous(),
            page_table=None if experts == 1 else self._page_table.repeat_interleave(experts, dim=0),
            bases=None if experts == 1 else [b for b in self._bases for _ in range(experts)],
            native_bases=None if experts == 1 else self._native_bases.repeat_interleave(experts),
        )
