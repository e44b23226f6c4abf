"""ForwardBatch: everything one model forward needs, built once per forward by `build_forward_batch` (the runner's
step of the target; the draft model's forwards).

Tensors are flat over the step's tokens (sequences concatenated in scheduling order); the per-sequence tensors
describe where each sequence's keys live in the paged cache. Adapters reach the layers through `lora`, a
`LoraDelta` the caller binds for the forward, so layers never look at requests or at the LoRA machinery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from loraplex.engine.model.layers.moe import ExpertLora

# (block ids, offsets in their blocks) of each token -> (K rows, V rows) of the KVLayer.rows views the forward writes:
# [num_tokens] int64 each in, [num_tokens * num_kv_heads] int64 each out, token-major. The caller's page layout.
KVRows = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LoraDelta(Protocol):
    """A step's adapters, as the model's layers see them (engine.lora's `LoraStep` is one)."""

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += the delta of each row's adapter on (layer, group) for input x (rows without one: nothing).

        group: the fused projection (qkv, o, gate_up, down); x: [num_tokens, in_features] its input;
        y: [num_tokens, fused out] its base output, added to in place.
        """
        ...

    def experts(self, layer: int) -> ExpertLora | None:
        """The step's adapters on a sparse layer's experts, or None when none of them adapts them."""
        ...


@dataclass(frozen=True, slots=True)
class GroupKV:
    """Where one KV group's layers (engine/memory/kv_groups.py) read and write this step's keys and values."""

    k_rows: torch.Tensor  # [num_tokens * num_kv_heads] int64: rows of KVLayer.rows taking token i's K, head h
    v_rows: torch.Tensor  # [num_tokens * num_kv_heads] int64: the same for V
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: the group's page ids of sequence s (0 where released)


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64: token ids of this step
    positions: torch.Tensor  # [num_tokens] int64: position of token i in its sequence
    k_rows: torch.Tensor  # [num_tokens * num_kv_heads] int64: rows of KVLayer.rows taking token i's K, head h
    v_rows: torch.Tensor  # [num_tokens * num_kv_heads] int64: the same for V
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: page ids of sequence s, in order; padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens of sequence s in the cache after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: sequence s's tokens are [qsl[s], qsl[s+1])
    logits_indices: torch.Tensor  # [num_logits] int64: token rows whose logits are computed
    max_query_len: int
    max_seq_len: int
    lora: LoraDelta | None = None  # the step's adapters; None when no row has one
    # [num_tokens] int64: the row of the RoPE table token i rotates by, where it is not its position: LongRoPE's
    # long-factor sequences look up position + max_positions (RotaryEmbedding); None: every token its position.
    rope_positions: torch.Tensor | None = None
    # KV groups 1.. of a model whose layers share pages in several groups (sliding windows); the fields above are
    # group 0's. Empty for a model of one group.
    other_groups: tuple[GroupKV, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def group(self, group: int) -> GroupKV:
        """Group `group`'s rows and block tables."""
        if group == 0:
            return GroupKV(self.k_rows, self.v_rows, self.block_tables)
        return self.other_groups[group - 1]


def build_forward_batch(
    input_ids: list[int],
    starts: np.ndarray,
    query_lens: np.ndarray,
    block_ids: Sequence[Sequence[int]],
    logits_widths: np.ndarray,
    *,
    block_size: int,
    kv_rows: KVRows,
    device: torch.device,
    lora: LoraDelta | None = None,
    long_rope: np.ndarray | None = None,
    max_positions: int = 0,
    other_groups: Sequence[Sequence[Sequence[int]]] = (),
) -> ForwardBatch:
    """The ForwardBatch of sequences that each compute query_lens[s] new tokens after the starts[s] their cache holds.

    input_ids: [sum(query_lens)] the new tokens, sequence after sequence; starts, query_lens: [num_seqs] int64;
    block_ids[s]: sequence s's pages, in order, covering its tokens after this forward; logits_widths: [num_seqs]
    int64, how many of sequence s's last token rows get logits (0: none), in sequence order; long_rope: [num_seqs]
    bool, the sequences that take LongRoPE's long factors (their tokens look up position + max_positions);
    other_groups[g - 1][s]: sequence s's pages in KV group g (NO_PAGE, -1, where released). Host metadata is
    computed with numpy over whole sequences (never token by token) and moved to the device once.
    """
    num_seqs = len(block_ids)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    block_tables = _block_table(block_ids)

    # positions[t] = starts[seq] + (t - query_start_loc[seq]) for every token t, without a Python loop.
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[seq_of_token] + starts[seq_of_token]
    token_blocks = positions // block_size
    slot_block_ids = block_tables[seq_of_token, token_blocks]
    slot_offsets = positions % block_size
    # Sequence s's logits rows are its last logits_widths[s] tokens, in order.
    first_token = np.repeat(query_start_loc[1:] - logits_widths, logits_widths)  # of its sequence's logits rows
    first_row = np.repeat(np.cumsum(logits_widths) - logits_widths, logits_widths)
    logits_indices = first_token + np.arange(int(logits_widths.sum())) - first_row

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

    rope_positions = None
    if long_rope is not None and long_rope.any():
        rope_positions = to_device(positions + long_rope[seq_of_token] * max_positions, torch.int64)
    offsets = to_device(slot_offsets, torch.int64)
    k_rows, v_rows = kv_rows(to_device(slot_block_ids, torch.int64), offsets)
    groups: list[GroupKV] = []
    for tables in other_groups:
        table = _block_table(tables)
        group_k, group_v = kv_rows(to_device(table[seq_of_token, token_blocks], torch.int64), offsets)
        groups.append(GroupKV(group_k, group_v, to_device(table, torch.int32)))
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=to_device(positions, torch.int64),
        k_rows=k_rows,
        v_rows=v_rows,
        block_tables=to_device(block_tables, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
        logits_indices=to_device(logits_indices, torch.int64),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        lora=lora,
        rope_positions=rope_positions,
        other_groups=tuple(groups),
    )


def _block_table(block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """[num_seqs, max_blocks] int64 of the sequences' pages, padded with 0; released entries (NO_PAGE) read page 0,
    which attention never looks at (they lie wholly behind the window)."""
    table = np.zeros((len(block_ids), max((len(ids) for ids in block_ids), default=0)), dtype=np.int64)
    for s, ids in enumerate(block_ids):
        table[s, : len(ids)] = ids
    np.maximum(table, 0, out=table)
    return table
