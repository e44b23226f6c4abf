"""ForwardBatch: everything one model forward needs, built once per step by the runner.

Tensors are flat over the step's tokens (sequences concatenated in scheduling order); the per-sequence tensors
describe where each sequence's keys live in the paged cache. Adapters reach the layers through `lora`, a
`LoraDelta` the runner binds for the step, so layers never look at requests or at the LoRA machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class LoraDelta(Protocol):
    """A step's adapters, as the model's layers see them (engine.lora's `LoraStep` is one)."""

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += the delta of each row's adapter on (layer, group) for input x (rows without one: nothing).

        group: the fused projection (qkv, o, gate_up, down); x: [num_tokens, in_features] its input;
        y: [num_tokens, fused out] its base output, added to in place.
        """
        ...


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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
