"""Segmented gather matrix-vector products (SGMV): the LoRA shrink (x @ A^T) and expand (h @ B) of a step whose
tokens are grouped by adapter, with every adapter's weights read from the engine's page pool.

Pool layout. One layer's adapter storage is the flat tensor `weights` of `num_pages * page_elems` elements. An
adapter slot owns the pages `page_table[slot]` (any order, not necessarily contiguous). Element e of the slot's
logical region lives at

    weights[page_table[slot, e // page_elems] * page_elems + e % page_elems]

Each targeted module stores A row-major as [rank, in_features] at logical element `a_offset`, and B transposed
and already scaled (B^T * alpha / r) as [rank, out_features] at `b_offset`. Rows may straddle page boundaries.
Modules that share an input (q, k, v; gate, up) store their A rows back to back, so one shrink over the group's
total rank computes them all; the caller then runs one expand per module, passing in `h_col_offsets` where that
module's columns of the shrink output start for each slot (with mixed ranks they start at different columns).

Segments. Tokens [seg_starts[s], seg_starts[s + 1]) form segment s and use slot seg_slots[s]; -1 means no
adapter (the one sentinel of kernel metadata). Segments tile [0, num_tokens) in order: seg_starts[0] == 0,
non-decreasing, seg_starts[-1] == num_tokens. Empty segments are fine, and so is one slot in several segments.

Semantics (the reference loops; the torch paths and the Triton kernels both compute these, in float32):

    def A(slot, j, k):  # row j, column k of the slot's A
        return pool(slot, a_offsets[slot] + j * in_features + k)

    def Bt(slot, j, n):  # row j, column n of the slot's B^T
        return pool(slot, b_offsets[slot] + j * out_features + n)

    # sgmv_shrink: out [num_tokens, max_rank] float32
    for s in range(num_segments):
        slot = seg_slots[s]
        rank = 0 if slot == -1 else ranks[slot]
        for t in range(seg_starts[s], seg_starts[s + 1]):
            for j in range(max_rank):
                out[t, j] = sum(x[t, k] * A(slot, j, k) for k in range(in_features)) if j < rank else 0.0

    # sgmv_expand: y [num_tokens, out_features] is updated in place; -1 segments leave their rows untouched
    for s in range(num_segments):
        slot = seg_slots[s]
        if slot == -1:
            continue
        for t in range(seg_starts[s], seg_starts[s + 1]):
            for n in range(out_features):
                c = 0 if h_col_offsets is None else h_col_offsets[slot]
                y[t, n] += sum(h[t, c + j] * Bt(slot, j, n) for j in range(ranks[slot]))  # rounded once to y.dtype

Pool pages are not cleared: nothing outside the rows a call uses is read, so stale values (NaN included) past a
slot's last row never reach a result.

`sgmv_shrink` and `sgmv_expand` dispatch: the Triton kernels for CUDA tensors, the torch paths otherwise. The
torch paths are what CPU serving runs; benchmarks/sgmv_cpu.py times them. No decode-specific (BGMV) kernel: a
decode segment is one token tile of the same kernel, and without a GPU here there is no measurement to justify a
second kernel.

Layout: this module is the entry point (the semantics above, the dispatch, and the names callers import). Each
op keeps its Triton kernel, launcher and torch path in one module, kernels/sgmv_shrink.py and
kernels/sgmv_expand.py; what both use (input checks, host segments, slot matrices, the page-table tile load,
the guarded Triton import) is in kernels/sgmv_common.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.sgmv_common import HAS_TRITON, HostSegments
from loraplex.kernels.sgmv_common import _slot_matrix as _slot_matrix  # re-exported for tests
from loraplex.kernels.sgmv_expand import sgmv_expand_torch, sgmv_expand_triton
from loraplex.kernels.sgmv_shrink import sgmv_shrink_torch, sgmv_shrink_triton

if HAS_TRITON:
    # Re-exported for tests, which check that it runs under Triton's interpreter on CPU.
    from loraplex.kernels.sgmv_shrink import _sgmv_shrink_kernel as _sgmv_shrink_kernel

__all__ = [
    "HAS_TRITON",
    "HostSegments",
    "sgmv_expand",
    "sgmv_expand_torch",
    "sgmv_expand_triton",
    "sgmv_shrink",
    "sgmv_shrink_torch",
    "sgmv_shrink_triton",
]


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    weights: torch.Tensor,  # [num_pages * page_elems], x's dtype
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    a_offsets: torch.Tensor,  # [num_slots] int64: logical element offset of each slot's A
    ranks: torch.Tensor,  # [num_slots] int32
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    *,
    page_elems: int,
    max_rank: int,
    out: torch.Tensor | None = None,  # [num_tokens, max_rank] float32
    segments: HostSegments | None = None,
    slot_bases: Sequence[int | None] | None = None,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """x @ A^T per segment into `out` [num_tokens, max_rank] float32 (allocated when not given); zero past each
    segment's rank and on -1 segments. See the module docstring.

    Host hints, all optional and never needed for correctness: `segments` (a host copy of seg_starts/seg_slots)
    and `slot_bases` (per slot, the element offset in `weights` of its logical element 0 when its pages are one
    ascending run, else None) spare the torch path reading seg_starts, seg_slots and page_table; it still reads
    `ranks` and `a_offsets` (num_slots values each). `max_segment_len` (an upper bound on the longest segment,
    derived from `segments` when absent) sizes the Triton grid; without either the grid assumes num_tokens.
    """
    if x.is_cuda:
        if max_segment_len is None and segments is not None:
            max_segment_len = max((end - start for start, end, _ in segments), default=0)
        return sgmv_shrink_triton(
            x,
            weights,
            page_table,
            a_offsets,
            ranks,
            seg_starts,
            seg_slots,
            page_elems=page_elems,
            max_rank=max_rank,
            out=out,
            max_segment_len=max_segment_len,
        )
    return sgmv_shrink_torch(
        x,
        weights,
        page_table,
        a_offsets,
        ranks,
        seg_starts,
        seg_slots,
        page_elems=page_elems,
        max_rank=max_rank,
        out=out,
        segments=segments,
        slot_bases=slot_bases,
    )


def sgmv_expand(
    h: torch.Tensor,  # [num_tokens, >= max rank]: this module's columns of the shrink output
    weights: torch.Tensor,  # [num_pages * page_elems], y's dtype
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    b_offsets: torch.Tensor,  # [num_slots] int64: logical element offset of each slot's B^T
    ranks: torch.Tensor,  # [num_slots] int32
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    y: torch.Tensor,  # [num_tokens, out_features], updated in place; may be a column slice of a wider tensor
    *,
    page_elems: int,
    h_col_offsets: torch.Tensor | None = None,  # [num_slots] int32: first column of h per slot; None = 0
    segments: HostSegments | None = None,
    slot_bases: Sequence[int | None] | None = None,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """y += h[:, c : c + rank] @ B^T per segment, c = h_col_offsets[slot] (in float32, rounded once to y's
    dtype); -1 segments untouched. Returns `y`.

    For a module group, call it once per module with that module's b_offsets and ranks, the group's shrink output
    as h, and in h_col_offsets the number of the group's A rows stored before this module's, per slot. The host
    hints are those of `sgmv_shrink`.
    """
    if h.is_cuda:
        if max_segment_len is None and segments is not None:
            max_segment_len = max((end - start for start, end, _ in segments), default=0)
        return sgmv_expand_triton(
            h,
            weights,
            page_table,
            b_offsets,
            ranks,
            seg_starts,
            seg_slots,
            y,
            page_elems=page_elems,
            h_col_offsets=h_col_offsets,
            max_segment_len=max_segment_len,
        )
    return sgmv_expand_torch(
        h,
        weights,
        page_table,
        b_offsets,
        ranks,
        seg_starts,
        seg_slots,
        y,
        page_elems=page_elems,
        h_col_offsets=h_col_offsets,
        segments=segments,
        slot_bases=slot_bases,
    )
