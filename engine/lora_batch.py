"""LoRA for one step: which token ranges run which adapter, and adding their deltas to the base projections.

The runner sorts a step's requests by adapter, so each adapter's tokens form one segment; base-model rows
belong to no segment. Built once per step; every layer reads the same segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplex.engine.adapter_manager import AdapterEntry
from loraplex.engine.page_pool import PagePool


@dataclass(slots=True)
class LoraSegment:
    start: int  # first token row
    end: int  # one past the last
    adapter: AdapterEntry


@dataclass(slots=True)
class LoraBatch:
    segments: list[LoraSegment] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.segments)


class LoraCompute:
    """Adds adapters' deltas to the outputs of the base model's fused projections, reading weights in the pool."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        # Scattered adapters (pages not one run): element indices of each matrix, built once per placement.
        self._gathers: dict[tuple[int, int, int, int], torch.Tensor] = {}  # (entry, placement, layer, offset)

    def add(self, batch: LoraBatch, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of each segment] += x[rows] @ A.T @ B.T for the segment's adapter on (layer, group).

        x: [num_tokens, in_features] is the group's input; y: [num_tokens, fused out] is the base output.
        """
        for segment in batch.segments:
            entry = segment.adapter
            assert entry.layout is not None
            placement = entry.layout.layers[layer].groups.get(group)
            if placement is None:
                continue
            rows = slice(segment.start, segment.end)
            a = self._matrix(entry, layer, placement.a_offset, placement.rank, placement.in_features)
            h = F.linear(x[rows], a)  # [tokens, group rank]
            for module in placement.modules:
                b_t = self._matrix(entry, layer, module.b_offset, module.rank, module.out_end - module.out_start)
                out = y[rows, module.out_start : module.out_end]
                out.addmm_(h[:, module.h_offset : module.h_offset + module.rank], b_t)

    def _matrix(self, entry: AdapterEntry, layer: int, offset: int, rows: int, cols: int) -> torch.Tensor:
        flat = self.pool.storage[layer].view(-1)
        if entry.base is not None:  # one run of pages: a view, no copy
            start = entry.base + offset
            return flat[start : start + rows * cols].view(rows, cols)
        key = (id(entry), entry.placement, layer, offset)
        index = self._gathers.get(key)
        if index is None:
            if len(self._gathers) > 100_000:  # stale placements accumulate; rebuilding is cheap
                self._gathers.clear()
            page_elems = self.pool.page_elems
            logical = torch.arange(offset, offset + rows * cols)
            pages = torch.tensor(entry.pages, dtype=torch.int64)
            index = pages[logical // page_elems] * page_elems + logical % page_elems
            self._gathers[key] = index
        return flat.index_select(0, index).view(rows, cols)
