"""Paged attention for a continuous-batching step that mixes chunked-prefill and decode sequences.

The keys and values of every sequence live in a paged KV cache: fixed-size blocks of `block_size` tokens, found
through the sequence's row of `block_tables`. This step's keys and values are already written to the cache
before attention runs, so a query sees the cached context and this step's tokens alike.

Semantics (the reference loop; `paged_attention_torch` and the Triton kernel both compute this):

    group = num_heads // num_kv_heads
    for i in range(num_seqs):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        L = seq_lens[i]                                   # includes this step's q_len tokens
        for j in range(q_len):
            p = L - q_len + j                             # absolute position of query j
            first = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(num_heads):
                kv_h = h // group
                seen = range(first, p + 1)
                keys = [k_cache[block_tables[i, t // block_size], kv_h, t % block_size] for t in seen]
                values = [v_cache[block_tables[i, t // block_size], kv_h, t % block_size] for t in seen]
                s = [scale * dot(q[query_start_loc[i] + j, h], k) for k in keys]  # in float32
                if softcap is not None:
                    s = [softcap * tanh(s_t / softcap) for s_t in s]
                w = softmax(s)
                out[query_start_loc[i] + j, h] = sum(w_t * v_t for w_t, v_t in zip(w, values))  # cast to q.dtype

Slots past a sequence's length and padding entries of `block_tables` may hold anything, NaN included (pool
pages are not cleared), without changing the result. With a sliding window, the entries of blocks that lie wholly
before the window of the sequence's first query of the step may be NO_PAGE (-1): their pages went back to the pool
(engine/memory/kv_groups.py), and no path reads them.

`paged_attention` dispatches: the Triton kernel for CUDA tensors, the torch path otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from loraplex.kernels import native
from loraplex.kernels.paged_attention_checks import check_inputs
from loraplex.kernels.paged_attention_triton import HAS_TRITON, paged_attention_triton

if HAS_TRITON:  # the tests check Triton runs it interpreted on CPU tensors
    from loraplex.kernels.paged_attention_triton import _paged_attention_kernel  # noqa: F401

__all__ = ["HAS_TRITON", "paged_attention", "paged_attention_torch", "paged_attention_triton"]

# The torch path pads the prefill sequences of one SDPA call to the longest query and context among them; a
# sequence joins a call only while the call's useful work (sum of q_len * seq_len) stays at least this share of
# its padded work. On a CPU SDPA's time follows the padded work, while one call per length pays per-call overhead
# (decision 0019 has the measured range).
_MIN_BUCKET_EFFICIENCY = 0.9


def paged_attention(
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
    sliding_window: int | None = None,  # keys a query sees, itself included; None: its whole context
    softcap: float | None = None,  # scores become softcap * tanh(score / softcap) (Gemma 2)
) -> torch.Tensor:
    """Attention of this step's queries over their sequences' paged KV cache; see the module docstring.

    `max_query_len` and `max_seq_len` are host ints (upper bounds are fine) so that no path has to read a
    device tensor to size its work. Returns `out` (allocated when not given), dtype of `q`.
    """
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    path = paged_attention_triton if q.is_cuda else partial(paged_attention_torch, native=native.load())
    return path(
        *args,
        scale=scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        out=out,
        sliding_window=sliding_window,
        softcap=softcap,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Torch path (CPU serving)
# ---------------------------------------------------------------------------------------------------------------------


def paged_attention_torch(
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
    native: bool = False,
) -> torch.Tensor:
    """The vectorized torch path that CPU serving runs; same semantics as the module docstring.

    native: decode rows of float32 go to the native operator (kernels/native.py; the caller checked it is loaded),
    which reads K and V in place in one pass instead of gathering them; everything else stays in torch.

    Decode sequences (q_len == 1) run together in one ragged pass over only the blocks they use (with a window,
    only the blocks inside it). The other sequences run in a few padded scaled_dot_product_attention calls, each
    over sequences of similar query and context length (a soft-capped model's in a matmul-softmax-matmul of its
    own: SDPA has no soft cap). benchmarks/attention_cpu.py times it (decision 0019 lists the alternatives it
    beat). It reads the small metadata tensors on the host, which on CUDA would synchronize: CUDA callers want the
    Triton kernel.
    """
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
    if block_tables.shape[0] == 0 or q.shape[0] == 0:
        return out
    variant = _Variant(sliding_window, softcap)
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    ctx_lens = seq_lens.long()
    max_blocks = min(block_tables.shape[1], math.ceil(max_seq_len / k_cache.shape[2]))
    decode = _decode_native if native and _native_fits(q, k_cache, v_cache, out) else _decode
    if max_query_len == 1:
        decode(q, k_cache, v_cache, block_tables, ctx_lens, starts, scale, max_blocks, variant, out)
        return out
    is_decode = q_lens == 1
    decode_ids = torch.nonzero(is_decode).squeeze(1)
    if decode_ids.numel() > 0:
        decode(
            q,
            k_cache,
            v_cache,
            block_tables.index_select(0, decode_ids),
            ctx_lens.index_select(0, decode_ids),
            starts.index_select(0, decode_ids),
            scale,
            max_blocks,
            variant,
            out,
        )
    prefill_ids = torch.nonzero(~is_decode).squeeze(1)
    if prefill_ids.numel() == 0:
        return out
    # Longest context first, so that each bucket's first sequence fixes its padded context length. With a window a
    # sequence's keys start at its first query's window, so its span, not its length, is its context.
    first_keys = _first_key_blocks(ctx_lens - q_lens, k_cache.shape[2], sliding_window) * k_cache.shape[2]
    spans = ctx_lens - first_keys
    prefill_ids = prefill_ids[torch.argsort(spans.index_select(0, prefill_ids), descending=True, stable=True)]
    span_list = spans.index_select(0, prefill_ids).tolist()
    rows_list = q_lens.index_select(0, prefill_ids).tolist()
    ctx_list = ctx_lens.index_select(0, prefill_ids).tolist()
    for members in _plan_buckets(span_list, rows_list):
        ids = prefill_ids[members]
        _prefill_bucket(
            q,
            k_cache,
            v_cache,
            block_tables.index_select(0, ids),
            starts.index_select(0, ids),
            q_lens.index_select(0, ids),
            ctx_lens.index_select(0, ids),
            first_keys.index_select(0, ids),
            scale,
            max(rows_list[m] for m in members),
            span_list[members[0]],
            all(rows_list[m] == ctx_list[m] for m in members),
            variant,
            out,
        )
    return out


@dataclass(frozen=True, slots=True)
class _Variant:
    """What a layer's attention adds to plain causal softmax attention."""

    window: int | None  # keys a query sees, itself included
    softcap: float | None

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Soft-cap float32 scores in place (a no-op without a cap)."""
        if self.softcap is not None:
            scores.div_(self.softcap).tanh_().mul_(self.softcap)
        return scores


def _first_key_blocks(first_positions: torch.Tensor, block_size: int, window: int | None) -> torch.Tensor:
    """[n] int64: the first block a query at `first_positions` (or later) of each sequence reads."""
    if window is None:
        return torch.zeros_like(first_positions)
    return (first_positions - window + 1).clamp(min=0) // block_size


def _plan_buckets(ctx_lens: list[int], q_lens: list[int]) -> list[list[int]]:
    """Group prefill sequences (sorted by context length, longest first) into padded attention calls.

    First fit: a sequence joins the first bucket whose useful work stays >= _MIN_BUCKET_EFFICIENCY of its
    padded work (members * max q_len * first member's context). A loop over sequences, on host ints.
    """
    buckets: list[list[int]] = []
    stats: list[tuple[int, int, int]] = []  # per bucket: padded context length, max q_len, useful work
    for i, (ctx, rows) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        for b, (width, max_rows, useful) in enumerate(stats):
            new_rows = max(max_rows, rows)
            new_useful = useful + rows * ctx
            if new_useful >= _MIN_BUCKET_EFFICIENCY * (len(buckets[b]) + 1) * new_rows * width:
                buckets[b].append(i)
                stats[b] = (width, new_rows, new_useful)
                break
        else:
            buckets.append([i])
            stats.append((ctx, rows, rows * ctx))
    return buckets


def _decode(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [n, max_blocks_per_seq] int32: the decode sequences' rows
    ctx_lens: torch.Tensor,  # [n] int64
    tokens: torch.Tensor,  # [n] int64: each sequence's single query row in q
    scale: float,
    max_blocks: int,  # upper bound on blocks per sequence
    variant: _Variant,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """One query per sequence, over exactly the blocks each sequence uses (no padding to the longest).

    Scores come per (block, kv head) from one batched matmul on the gathered blocks, each a contiguous
    [block_size, head_dim] matrix, so K and V are copied once and never permuted; the softmax is then
    reduced across each sequence's blocks. GQA: the `group` query heads of a kv head are the rows of one
    matmul instead of repeated keys.
    """
    n = ctx_lens.shape[0]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    device = q.device
    num_blocks = (ctx_lens + block_size - 1) // block_size  # [n]
    grid = torch.arange(max_blocks, device=device)
    used = grid < num_blocks[:, None]  # [n, max_blocks]
    first_key = torch.zeros_like(ctx_lens)
    if variant.window is not None:
        first_key = (ctx_lens - variant.window).clamp(min=0)  # the query sits at ctx_len - 1
        used &= grid >= (first_key // block_size)[:, None]
    flat = torch.nonzero(used.view(-1)).squeeze(1)  # [nb]: index into the [n * max_blocks] grid
    owner = flat // max_blocks  # [nb]: sequence of each gathered block
    block_ids = block_tables[:, :max_blocks].reshape(-1).index_select(0, flat).long()
    keys = k_cache.index_select(0, block_ids).float()  # [nb, kv_heads, block_size, head_dim]
    values = v_cache.index_select(0, block_ids).float()
    queries = q.index_select(0, tokens).float().view(n, num_kv_heads, group, head_dim).index_select(0, owner)

    scores = torch.matmul(queries, keys.transpose(-1, -2))  # [nb, kv_heads, group, block_size]
    variant.cap(scores.mul_(scale))
    positions = (flat % max_blocks)[:, None] * block_size + torch.arange(block_size, device=device)
    valid = positions < ctx_lens.index_select(0, owner)[:, None]  # [nb, block_size]
    if variant.window is not None:
        valid &= positions >= first_key.index_select(0, owner)[:, None]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    # Per-sequence max over its blocks: scatter the per-block maxima into the padded grid, reduce there.
    block_max = torch.full((n * max_blocks, num_kv_heads, group), float("-inf"), device=device)
    block_max[flat] = scores.amax(-1)
    seq_max = block_max.view(n, max_blocks, num_kv_heads, group).amax(1)  # [n, kv_heads, group]
    probs = torch.exp(scores - seq_max.index_select(0, owner)[..., None])
    denom = torch.zeros(n, num_kv_heads, group, device=device).index_add_(0, owner, probs.sum(-1))
    # Unused slots of a last block may hold NaN (pages are not cleared), and 0 * NaN is NaN.
    bad_blocks, bad_slots = torch.nonzero(~valid, as_tuple=True)
    values[bad_blocks, :, bad_slots] = 0.0
    partial = torch.matmul(probs, values)  # [nb, kv_heads, group, head_dim]
    acc = torch.zeros(n, num_kv_heads, group, head_dim, device=device).index_add_(0, owner, partial)
    acc.div_(denom[..., None])
    out.index_copy_(0, tokens, acc.view(n, -1, head_dim).to(out.dtype))


def _native_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the native decode operator takes these tensors: float32, `out` contiguous, each page's
    [kv_heads, block_size, head_dim] contiguous (the pool's K and V views are)."""
    if any(t.dtype != torch.float32 for t in (q, k_cache, v_cache, out)) or not out.is_contiguous():
        return False
    _, _, block_size, head_dim = k_cache.shape
    inner = (block_size * head_dim, head_dim, 1)
    return k_cache.stride()[1:] == inner and v_cache.stride()[1:] == inner


def _decode_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    tokens: torch.Tensor,
    scale: float,
    max_blocks: int,
    variant: _Variant,
    out: torch.Tensor,
) -> None:
    """_decode's arguments, computed by the native operator (torch.ops.loraplex_cpu.decode_attention)."""
    del max_blocks  # the operator reads each sequence's own block count
    torch.ops.loraplex_cpu.decode_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        block_tables.contiguous(),
        ctx_lens,
        tokens,
        scale,
        variant.window or 0,
        variant.softcap or 0.0,
        out,
    )


def _prefill_bucket(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [n, max_blocks_per_seq] int32: this bucket's rows
    starts: torch.Tensor,  # [n] int64: first query row of each sequence in q
    q_lens: torch.Tensor,  # [n] int64
    ctx_lens: torch.Tensor,  # [n] int64
    first_keys: torch.Tensor,  # [n] int64: position of each sequence's first gathered key (a block start)
    scale: float,
    max_rows: int,  # max of q_lens
    max_span: int,  # max of ctx_lens - first_keys
    fresh: bool,  # every sequence has q_len == seq_len: causal from position 0
    variant: _Variant,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """One SDPA call over sequences padded to [max_rows] queries and [max_span rounded to blocks] keys."""
    n = ctx_lens.shape[0]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    num_heads = q.shape[1]
    device = q.device
    num_blocks = math.ceil(max_span / block_size)
    width = num_blocks * block_size
    columns = (first_keys // block_size)[:, None] + torch.arange(num_blocks, device=device)
    columns.clamp_(max=block_tables.shape[1] - 1)  # past a sequence's end: any page, its keys are stale below
    block_ids = block_tables.gather(1, columns).view(-1).long()
    if variant.window is not None:
        block_ids.clamp_(min=0)  # a NO_PAGE column past the end of a short sequence's span reads page 0, zeroed
    # Kv-head-major, so that each (sequence, kv head) is a contiguous [width, head_dim] matrix: one copy.
    # (index_select on a transposed cache would first copy the whole pool; a slice per head does not.)
    keys = torch.empty(num_kv_heads, n * num_blocks, block_size, head_dim, dtype=k_cache.dtype, device=device)
    values = torch.empty_like(keys)
    for h in range(num_kv_heads):
        torch.index_select(k_cache[:, h], 0, block_ids, out=keys[h])
        torch.index_select(v_cache[:, h], 0, block_ids, out=values[h])
    # Positions past a sequence's length may hold NaN, which a -inf mask would not hide from SDPA.
    key_pos = first_keys[:, None] + torch.arange(width, device=device)  # [n, width]
    stale = torch.nonzero((key_pos >= ctx_lens[:, None]).view(-1)).squeeze(1)
    keys.view(num_kv_heads, n * width, head_dim).index_fill_(1, stale, 0.0)
    values.view(num_kv_heads, n * width, head_dim).index_fill_(1, stale, 0.0)

    row = torch.arange(max_rows, device=device)
    row_valid = row < q_lens[:, None]  # [n, max_rows]
    # Padding rows repeat the sequence's last query; their outputs are dropped.
    tokens = starts[:, None] + torch.minimum(row, q_lens[:, None] - 1)  # [n, max_rows]
    queries = q.index_select(0, tokens.view(-1)).view(n, max_rows, num_heads, head_dim).transpose(1, 2)
    keys_t = keys.view(num_kv_heads, n, width, head_dim).transpose(0, 1)  # [n, kv_heads, width, head_dim]
    values_t = values.view(num_kv_heads, n, width, head_dim).transpose(0, 1)
    if fresh and variant.window is None and variant.softcap is None:
        # Query j sits at position j: SDPA's top-left causal mask is exact, no mask tensor needed.
        result = F.scaled_dot_product_attention(queries, keys_t, values_t, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = (ctx_lens - q_lens)[:, None] + torch.minimum(row, q_lens[:, None] - 1)  # [n, max_rows]
        allowed = key_pos[:, None, :] <= query_pos[:, :, None]  # [n, max_rows, width]
        if variant.window is not None:
            allowed &= key_pos[:, None, :] > query_pos[:, :, None] - variant.window
        if variant.softcap is None:
            result = F.scaled_dot_product_attention(
                queries, keys_t, values_t, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
            )
        else:
            result = _capped_attention(queries, keys_t, values_t, allowed, scale, variant).to(q.dtype)
    result = result.transpose(1, 2)  # [n, max_rows, num_heads, head_dim]
    out.index_copy_(0, tokens[row_valid], result[row_valid].to(out.dtype))


def _capped_attention(
    queries: torch.Tensor,  # [n, num_heads, rows, head_dim]
    keys: torch.Tensor,  # [n, kv_heads, width, head_dim]
    values: torch.Tensor,  # [n, kv_heads, width, head_dim]
    allowed: torch.Tensor,  # [n, rows, width] bool
    scale: float,
    variant: _Variant,
) -> torch.Tensor:
    """[n, num_heads, rows, head_dim] float32: softmax attention with soft-capped scores, which SDPA cannot do.
    The group of query heads that share a kv head are the rows of one matmul."""
    n, num_heads, rows, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    grouped = queries.float().reshape(n, num_kv_heads, group * rows, head_dim)
    scores = torch.matmul(grouped, keys.float().transpose(-1, -2))  # [n, kv_heads, group * rows, width]
    scores = variant.cap(scores.mul_(scale)).view(n, num_kv_heads, group, rows, -1)
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = scores.softmax(-1).view(n, num_kv_heads, group * rows, -1)
    return torch.matmul(probs, values.float()).view(n, num_heads, rows, head_dim)
