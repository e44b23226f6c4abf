"""A decoder layer's attention over the paged cache, with its family's variants: a sliding window (Mistral, Gemma's
local layers, Phi-3, Qwen's sliding layers), soft-capped scores (Gemma 2) and the softmax scale."""

from __future__ import annotations

from typing import Any

import torch

from loraplex.engine.memory.page_pool import KVLayer
from loraplex.engine.model.forward_batch import ForwardBatch
from loraplex.kernels.paged_attention import paged_attention


def attend(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
    cache: KVLayer,  # the layer's pages, this step's K/V already written
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32: the layer's KV group's tables
    batch: ForwardBatch,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim]: each query over its sequence's keys (those within its window)."""
    variants: dict[str, Any] = {}
    if sliding_window is not None:
        variants["sliding_window"] = sliding_window
    if softcap is not None:
        variants["softcap"] = softcap
    return paged_attention(
        q,
        cache.k,
        cache.v,
        block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale=scale,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        **variants,
    )
