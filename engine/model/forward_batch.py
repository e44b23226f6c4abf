"""ForwardBatch: everything one model forward needs, built once per step by the runner.

Tensors are flat over the step's tokens (sequences concatenated in scheduling order); the per-sequence tensors
describe where each sequence's keys live in the paged cache. The LoRA metadata (adapter segments) will join
here, so layers never look at requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.engine.lora.batch import LoraBatch


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
    lora: LoraBatch = field(default_factory=LoraBatch)  # adapter segments over the token rows

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
