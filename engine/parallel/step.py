"""What rank 0 sends the other ranks: for each forward the step's host batch (`HostBatch`) and the changes to the
adapter slot table since the last one (`StepMessage`), and the start-up handshake's control messages.

On the wire nothing is pickled: a step is a JSON header (the batch's integers, each event's slot, pages and layout)
followed by a safetensors body of the placed adapters' packed layers (`encode_step` / `decode_step`); a control
message is one JSON array `[kind, value]` (`send_control` / `receive_control`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, save

from loraplex.engine.lora.batch import LoraBatch, LoraCompute, LoraStep
from loraplex.engine.lora.layout import AdapterLayout, GroupPlacement, LayerLayout, ModulePlacement
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
    long_rope: list[bool] = field(default_factory=list)  # [num_seqs] takes LongRoPE's long factors; empty: none does
    # [groups - 1][num_seqs][blocks]: each sequence's pages in KV groups 1.. (sliding windows); empty for one group
    other_groups: Sequence[Sequence[Sequence[int]]] = field(default_factory=list)

    def forward_batch(
        self,
        *,
        num_kv_heads: int,
        block_size: int,
        device: torch.device,
        lora: LoraCompute | None,
        max_positions: int = 0,
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
            long_rope=np.asarray(self.long_rope, dtype=np.int64) if any(self.long_rope) else None,
            max_positions=max_positions,
            other_groups=self.other_groups,
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


_HEADER_BYTES = 8


def encode_step(message: StepMessage) -> bytes:
    batch = message.batch
    tensors: dict[str, torch.Tensor] = {}
    events: list[dict[str, Any]] = []
    for index, event in enumerate(message.adapter_events):
        if isinstance(event, AdapterPlaced):
            events.append(
                {"placed": event.slot, "pages": list(event.pages), "layout": dataclasses.asdict(event.layout)}
            )
            tensors |= {f"{index}.{layer}": packed.contiguous() for layer, packed in enumerate(event.layers)}
        else:
            events.append({"evicted": event.slot})
    header = {
        "input_ids": batch.input_ids,
        "starts": batch.starts.tolist(),
        "query_lens": batch.query_lens.tolist(),
        "block_ids": [list(ids) for ids in batch.block_ids],
        "logits_widths": batch.logits_widths.tolist(),
        "adapter_slots": batch.adapter_slots,
        "long_rope": batch.long_rope,
        "other_groups": batch.other_groups,
        "events": events,
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    return len(raw).to_bytes(_HEADER_BYTES, "little") + raw + (save(tensors) if tensors else b"")


def decode_step(data: bytes) -> StepMessage:
    length = int.from_bytes(data[:_HEADER_BYTES], "little")
    header = json.loads(data[_HEADER_BYTES : _HEADER_BYTES + length])
    body = data[_HEADER_BYTES + length :]
    tensors = load(body) if body else {}
    events: list[AdapterEvent] = []
    for index, event in enumerate(header["events"]):
        if "evicted" in event:
            events.append(AdapterEvicted(event["evicted"]))
            continue
        layout = _layout(event["layout"])
        layers = [tensors[f"{index}.{layer}"] for layer in range(len(layout.layers))]
        events.append(AdapterPlaced(event["placed"], [PageId(p) for p in event["pages"]], layout, layers))

    def array(name: str) -> np.ndarray:
        return np.asarray(header[name], dtype=np.int64)

    batch = HostBatch(
        header["input_ids"],
        array("starts"),
        array("query_lens"),
        header["block_ids"],
        array("logits_widths"),
        header["adapter_slots"],
        header["long_rope"],
        header["other_groups"],
    )
    return StepMessage(batch, events)


def _layout(raw: dict[str, Any]) -> AdapterLayout:
    """An AdapterLayout from its `dataclasses.asdict` form."""

    def group(g: dict[str, Any]) -> GroupPlacement:
        modules = tuple(ModulePlacement(**m) for m in g["modules"])
        return GroupPlacement(g["group"], g["a_offset"], g["rank"], g["in_features"], modules)

    layers = tuple(
        LayerLayout({name: group(g) for name, g in layer["groups"].items()}, layer["num_elems"])
        for layer in raw["layers"]
    )
    return AdapterLayout(layers, raw["num_pages"], raw["region_pages"], raw["num_slots"])


def send_control(conn: Connection, kind: str, value: int | str | None = None) -> None:
    conn.send_bytes(json.dumps([kind, value]).encode())


def receive_control(conn: Connection) -> tuple[str, Any]:
    kind, value = json.loads(conn.recv_bytes())
    return str(kind), value
