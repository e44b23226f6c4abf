"""What rank 0 sends the other ranks for each forward: the step's host batch (`HostBatch`) and the changes to the
adapter slot table since the last one. Plain data, pickled once per step and sent to every worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from loraplex.engine.lora.batch import LoraBatch, LoraCompute, LoraStep
from loraplex.engine.lora.layout import AdapterLayout
from loraplex.engine.memory.page_pool import PageId, kv_rows
from loraplex.engine.model.forward_batch import ForwardBatch, build_forward_batch


@dataclass(slots=True)
class HostBatch:
    """One forward's inputs as host data: `build_forward_batch`'s arguments and each sequence's adapter slot."""

    input_ids: list[int]  # [sum(query_lens)] the new tokens, sequence after sequence
    starts: np.ndarray  # [num_seqs] int64: tokens each sequence's cache holds before the forward
    query_lens: np.ndarray  # [num_seqs] int64: tokens each computes
    block_ids: Sequence[Sequence[int]]  # [num_seqs][blocks] its pages after the forward
    logits_widths: np.ndarray  # [num_seqs] int64: how many of its last rows get logits
    adapter_slots: list[int]  # [num_seqs] its adapter's slot, -1 for none; sequences of one slot are adjacent

    def forward_batch(
        self, *, num_kv_heads: int, block_size: int, device: torch.device, lora: LoraCompute | None
    ) -> ForwardBatch:
        """The ForwardBatch of these inputs on one rank (its KV heads, its adapter pages)."""
        segments = LoraBatch.tile(self.adapter_slots, self.query_lens.tolist(), device) if lora is not None else None
        return build_forward_batch(
            self.input_ids,
            self.starts,
            self.query_lens,
            self.block_ids,
            self.logits_widths,
            block_size=block_size,
            kv_rows=partial(kv_rows, num_kv_heads=num_kv_heads, block_size=block_size),
            device=device,
            lora=LoraStep(lora, segments) if lora is not None and segments else None,
        )


@dataclass(frozen=True, slots=True)
class AdapterPlaced:
    slot: int
    pages: list[PageId]
    layout: AdapterLayout
    layers: list[torch.Tensor]  # the receiving rank's packed region of each layer


@dataclass(frozen=True, slots=True)
class AdapterEvicted:
    slot: int


AdapterEvent = AdapterPlaced | AdapterEvicted


@dataclass(slots=True)
class StepMessage:
    """One forward for a worker: the slot-table changes to apply first, then the batch."""

    batch: HostBatch
    adapter_events: list[AdapterEvent] = field(default_factory=list)
