"""What the paged-attention paths share: the input checks (kernels/paged_attention.py states the semantics)."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Raise ValueError on any shape, dtype or device mismatch; values are not read (that would sync)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, num_kv_heads, block_size, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the cache ({k_cache.shape[3]}) differ")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks_per_seq], got shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got shape {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1={num_seqs + 1}], got shape {tuple(query_start_loc.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    named = [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)]
    named.append(("query_start_loc", query_start_loc))
    if out is not None:
        named.append(("out", out))
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
    for name, t in named:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if num_seqs > 0 and (max_query_len < 1 or max_seq_len < max_query_len):
        raise ValueError(f"need 1 <= max_query_len <= max_seq_len, got {max_query_len} and {max_seq_len}")
