"""Paged attention's Triton kernel (CUDA; CPU under TRITON_INTERPRET=1 for tests): kernels/paged_attention.py states
the semantics and dispatches here for CUDA tensors."""

from __future__ import annotations

import torch

from loraplex.kernels.paged_attention_checks import check_inputs

try:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]
except ImportError:  # the CPU image ships without Triton; the torch path needs none
    HAS_TRITON = False
else:
    HAS_TRITON = True

__all__ = ["HAS_TRITON", "paged_attention_triton"]

# ---------------------------------------------------------------------------------------------------------------------
# Triton kernel (CUDA; CPU under TRITON_INTERPRET=1 for tests)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # Triton reads parameter annotations itself
        # Pointers
        q_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens_ptr,  # [num_seqs] int32
        query_start_loc_ptr,  # [num_seqs + 1] int32
        out_ptr,  # [num_tokens, num_heads, head_dim]
        # Sizes
        scale,  # softmax scale
        head_dim,
        window,  # keys a query sees, itself included (read when HAS_WINDOW)
        softcap,  # scores become softcap * tanh(score / softcap) (read when HAS_SOFTCAP)
        # Strides
        stride_q_token,
        stride_q_head,
        stride_q_dim,
        stride_k_block,
        stride_k_head,
        stride_k_slot,
        stride_k_dim,
        stride_v_block,
        stride_v_head,
        stride_v_slot,
        stride_v_dim,
        stride_bt_seq,
        stride_bt_block,
        stride_o_token,
        stride_o_head,
        stride_o_dim,
        # Meta-parameters
        GROUP_SIZE: tl.constexpr,  # query heads per kv head
        GROUP_PAD: tl.constexpr,  # GROUP_SIZE rounded up to a power of two
        BLOCK_Q: tl.constexpr,  # queries per program; the tile has BLOCK_Q * GROUP_PAD rows
        BLOCK_N: tl.constexpr,  # keys per tile
        BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
        BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
        DOT_FP32: tl.constexpr,  # upcast tl.dot operands: the interpreter gets half-type dots wrong
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 operands: TF32 would drop their low mantissa bits
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):
        """Program (seq, query block, kv head): BLOCK_Q queries x the GROUP_SIZE heads sharing one kv head."""
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len  # tokens cached before this step's first query

        # Row r of the tile: query q_block * BLOCK_Q + r // GROUP_PAD, head r % GROUP_PAD of the group.
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = q_block * BLOCK_Q + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        head = kv_head * GROUP_SIZE + head_in_group
        row_valid = (q_idx < q_len) & (head_in_group < GROUP_SIZE)
        # Padding rows take the last query's position: every row sees a key (itself), none is all -inf.
        q_pos = context_len + tl.minimum(q_idx, q_len - 1)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < head_dim
        q_offs = (q_start + q_idx)[:, None] * stride_q_token + head[:, None] * stride_q_head
        q_mask = row_valid[:, None] & d_valid[None, :]
        q = tl.load(q_ptr + q_offs + offs_d[None, :] * stride_q_dim, mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)

        # Causal: no row of this tile attends past its last query's position.
        kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
        # Windowed: none before its first query's window (those blocks' table entries may be NO_PAGE).
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        k_head = k_cache_ptr + kv_head * stride_k_head
        v_head = v_cache_ptr + kv_head * stride_v_head
        for start_n in range(kv_start, kv_end, BLOCK_N):
            pos = start_n + offs_n
            key_valid = pos < kv_end
            # Physical block of every key; masked loads never touch slots past the sequence's length.
            block = tl.load(
                block_tables_ptr + seq * stride_bt_seq + (pos // BLOCK_SIZE) * stride_bt_block, mask=key_valid
            ).to(tl.int64)  # int64: block * stride overflows int32 in large pools
            slot = pos % BLOCK_SIZE
            kv_mask = key_valid[:, None] & d_valid[None, :]
            k = tl.load(
                k_head
                + block[:, None] * stride_k_block
                + slot[:, None] * stride_k_slot
                + offs_d[None, :] * stride_k_dim,
                mask=kv_mask,
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            v = tl.load(
                v_head
                + block[:, None] * stride_v_block
                + slot[:, None] * stride_v_slot
                + offs_d[None, :] * stride_v_dim,
                mask=kv_mask,
                other=0.0,
            )
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [rows, BLOCK_N], float32
            if HAS_SOFTCAP:
                capped = qk * (scale / softcap)
                # tanh through exp2, which saturates to +-1 where exp2 overflows or vanishes
                qk = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(capped * 2.8853900817779268) + 1.0))
            else:
                qk = qk * qk_scale
            seen = (pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
            if HAS_WINDOW:
                seen = seen & (pos[None, :] > q_pos[:, None] - window)
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        o_offs = (q_start + q_idx)[:, None] * stride_o_token + head[:, None] * stride_o_head
        tl.store(
            out_ptr + o_offs + offs_d[None, :] * stride_o_dim,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    *,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], q's dtype
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel: check, allocate, launch. CPU tensors work under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_triton needs Triton (the `kernels` extra); use paged_attention_torch")
    check_inputs(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        out,
        sliding_window,
        softcap,
    )
    if out is None:
        out = torch.empty_like(q)
    num_seqs = block_tables.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # 16 rows (tl.dot's minimum) when queries are single tokens, else 64: decode wastes few rows.
    block_rows = max(16 if max_query_len * group_pad <= 16 else 64, group_pad)
    block_q = block_rows // group_pad
    block_n = max(64, triton.next_power_of_2(block_size))
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    dot_fp32 = q.device.type == "cpu"  # only the interpreter runs on CPU tensors
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale,
        head_dim,
        sliding_window or 0,
        softcap or 1.0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP_SIZE=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 or q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    return out
