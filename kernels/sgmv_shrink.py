"""The SGMV shrink, out = x @ A^T per segment: its input checks, torch path, Triton kernel and launcher.

kernels/sgmv.py states the semantics (the reference loop), the pool layout and the segment rules, and its
`sgmv_shrink` picks the path; the helpers shared with the expand live in kernels/sgmv_common.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.sgmv_common import (
    HAS_TRITON,
    HostSegments,
    _block_cols,
    _block_t,
    _check_pool_and_segments,
    _check_span,
    _host_segments,
    _require_triton,
    _slot_matrix,
)

if HAS_TRITON:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]

    from loraplex.kernels.sgmv_common import _load_pool_tile

__all__ = ["sgmv_shrink_torch", "sgmv_shrink_triton"]


# ---------------------------------------------------------------------------------------------------------------------
# Input checks (shapes, dtypes, devices; values are not read: on CUDA that would synchronize)
# ---------------------------------------------------------------------------------------------------------------------


def _check_shrink(
    x: torch.Tensor,
    weights: torch.Tensor,
    page_table: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    page_elems: int,
    max_rank: int,
    out: torch.Tensor | None,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, in_features], got shape {tuple(x.shape)}")
    if x.dtype != weights.dtype:
        raise ValueError(f"x ({x.dtype}) and weights ({weights.dtype}) must share a dtype")
    _check_pool_and_segments(
        x.device, weights, page_table, a_offsets, "a_offsets", ranks, seg_starts, seg_slots, page_elems
    )
    if max_rank < 0:
        raise ValueError(f"max_rank must be >= 0, got {max_rank}")
    if out is not None:
        expected = (x.shape[0], max_rank)
        if out.shape != expected or out.dtype != torch.float32 or out.device != x.device:
            raise ValueError(
                f"out must be {expected} float32 on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Torch path (CPU serving)
# ---------------------------------------------------------------------------------------------------------------------


def sgmv_shrink_torch(
    x: torch.Tensor,  # [num_tokens, in_features]
    weights: torch.Tensor,  # [num_pages * page_elems], x's dtype
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    a_offsets: torch.Tensor,  # [num_slots] int64
    ranks: torch.Tensor,  # [num_slots] int32
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    *,
    page_elems: int,
    max_rank: int,
    out: torch.Tensor | None = None,  # [num_tokens, max_rank] float32
    segments: HostSegments | None = None,
    slot_bases: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """The torch path: one matmul per segment, written straight into its block of `out` (no temporaries for
    float32), on a view of the pool when the slot's pages are contiguous. Half-precision inputs are computed in
    float32 (x converted once per call, A once per slot). Reads its metadata on the host: CUDA callers want
    the Triton kernel. Raises ValueError when a rank exceeds max_rank or a matrix runs past its page table row.
    """
    _check_shrink(x, weights, page_table, a_offsets, ranks, seg_starts, seg_slots, page_elems, max_rank, out)
    num_tokens, in_features = x.shape
    segments = _host_segments(seg_starts, seg_slots, segments, num_tokens, page_table.shape[0])
    if slot_bases is not None and len(slot_bases) != page_table.shape[0]:
        raise ValueError(f"slot_bases has {len(slot_bases)} entries, page_table {page_table.shape[0]} slots")
    rank_of: list[int] = ranks.tolist()
    offset_of: list[int] = a_offsets.tolist()
    work: list[tuple[int, int, int, int]] = []  # (start, end, slot, rank) of the segments with a matmul
    for start, end, slot in segments:
        rank = 0 if slot < 0 else rank_of[slot]
        if rank > max_rank:
            raise ValueError(f"slot {slot} has rank {rank} > max_rank={max_rank}")
        if end > start and rank > 0:
            _check_span(slot, offset_of[slot], rank * in_features, page_table, page_elems, weights, slot_bases)
            work.append((start, end, slot, rank))
    if out is None:
        out = torch.empty(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    # One fill when any block of `out` is not covered by a matmul: cheaper than a fill per ragged segment.
    if sum((end - start) * rank for start, end, _, rank in work) != num_tokens * max_rank:
        out.zero_()
    if x.dtype != torch.float32:
        x = x.float()
    matrices: dict[int, torch.Tensor] = {}  # slot -> its A [rank, in_features], float32
    for start, end, slot, rank in work:
        a = matrices.get(slot)
        if a is None:
            a = _slot_matrix(weights, page_table, slot, offset_of[slot], rank, in_features, page_elems, slot_bases)
            matrices[slot] = a = a.float()
        torch.mm(x[start:end], a.t(), out=out[start:end, :rank])
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernel and launcher (CUDA; CPU under TRITON_INTERPRET=1 for tests)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _sgmv_shrink_kernel(  # type: ignore[no-untyped-def]  # Triton reads parameter annotations itself
        # Pointers
        x_ptr,  # [num_tokens, in_features]
        weights_ptr,  # [num_pages * page_elems]
        page_table_ptr,  # [num_slots, max_pages] int32
        a_offsets_ptr,  # [num_slots] int64
        ranks_ptr,  # [num_slots] int32
        seg_starts_ptr,  # [num_segments + 1] int32
        seg_slots_ptr,  # [num_segments] int32, -1 = no adapter
        out_ptr,  # [num_tokens, max_rank] float32
        # Sizes
        in_features,
        max_rank,
        # Strides
        stride_x_token,
        stride_x_feature,
        stride_pt_slot,
        stride_pt_page,
        stride_o_token,
        stride_o_rank,
        # Meta-parameters
        PAGE_ELEMS: tl.constexpr,  # elements per pool page
        BLOCK_T: tl.constexpr,  # tokens per program
        BLOCK_R: tl.constexpr,  # rank columns per program
        BLOCK_K: tl.constexpr,  # input features per step of the reduction, <= PAGE_ELEMS
        DOT_FP32: tl.constexpr,  # upcast tl.dot operands: the interpreter gets half-type dots wrong
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 operands: TF32 would drop their low mantissa bits
    ):
        """Program (segment, rank tile, token tile): out[tokens, ranks] = x[tokens, :] @ A[ranks, :]^T."""
        seg = tl.program_id(0)
        r_tile = tl.program_id(1)
        t_tile = tl.program_id(2)
        seg_start = tl.load(seg_starts_ptr + seg)
        seg_end = tl.load(seg_starts_ptr + seg + 1)
        t_start = seg_start + t_tile * BLOCK_T
        if t_start >= seg_end:
            return
        slot = tl.load(seg_slots_ptr + seg)
        has_slot = slot >= 0
        slot = tl.maximum(slot, 0)  # -1: no metadata is read, the rank is 0 and only zeros are stored
        rank = tl.minimum(tl.load(ranks_ptr + slot, mask=has_slot, other=0), max_rank)
        offs_t = t_start + tl.arange(0, BLOCK_T)
        t_valid = offs_t < seg_end
        offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
        r_valid = offs_r < rank
        acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        # Tiles past the rank (and -1 segments) skip the reduction and only store their zeros.
        k_end = tl.where(r_tile * BLOCK_R < rank, in_features, 0)
        a_offset = tl.load(a_offsets_ptr + slot, mask=has_slot, other=0)
        pt_row_ptr = page_table_ptr + slot.to(tl.int64) * stride_pt_slot
        offs_k = tl.arange(0, BLOCK_K)
        for k_start in range(0, k_end, BLOCK_K):
            k = k_start + offs_k
            x = tl.load(
                x_ptr + offs_t[:, None].to(tl.int64) * stride_x_token + k[None, :] * stride_x_feature,
                mask=t_valid[:, None] & (k < in_features)[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_K]
            a = _load_pool_tile(
                weights_ptr,
                pt_row_ptr,
                stride_pt_page,
                a_offset,
                in_features,
                offs_r,
                r_valid,
                k_start,
                BLOCK_K,
                PAGE_ELEMS,
            )  # [BLOCK_R, BLOCK_K]
            if DOT_FP32:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += tl.dot(x, tl.trans(a), input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + offs_t[:, None].to(tl.int64) * stride_o_token + offs_r[None, :] * stride_o_rank,
            acc,
            mask=t_valid[:, None] & (offs_r < max_rank)[None, :],
        )


def sgmv_shrink_triton(
    x: torch.Tensor,  # [num_tokens, in_features]
    weights: torch.Tensor,  # [num_pages * page_elems], x's dtype
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    a_offsets: torch.Tensor,  # [num_slots] int64
    ranks: torch.Tensor,  # [num_slots] int32
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    *,
    page_elems: int,
    max_rank: int,
    out: torch.Tensor | None = None,  # [num_tokens, max_rank] float32
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """Launch the shrink kernel: check, allocate, launch. CPU tensors work under TRITON_INTERPRET=1.

    Reads no tensor values. Ranks above max_rank are clamped to it (the torch path raises instead).
    """
    _require_triton("sgmv_shrink_triton")
    _check_shrink(x, weights, page_table, a_offsets, ranks, seg_starts, seg_slots, page_elems, max_rank, out)
    num_tokens, in_features = x.shape
    if out is None:
        out = torch.empty(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    num_segments = seg_slots.shape[0]
    if num_tokens == 0 or num_segments == 0 or max_rank == 0:
        return out
    block_t, num_t_tiles = _block_t(num_tokens, max_segment_len)
    # One tile for all of a rank up to 128, so x is read once; shrink ranks are small.
    block_r = max(16, min(128, triton.next_power_of_2(max_rank)))
    interpret = x.device.type == "cpu"  # only the interpreter runs on CPU tensors
    grid = (num_segments, triton.cdiv(max_rank, block_r), num_t_tiles)
    _sgmv_shrink_kernel[grid](
        x,
        weights,
        page_table,
        a_offsets,
        ranks,
        seg_starts,
        seg_slots,
        out,
        in_features,
        max_rank,
        *x.stride(),
        *page_table.stride(),
        *out.stride(),
        PAGE_ELEMS=page_elems,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        BLOCK_K=_block_cols(page_elems, 64),
        DOT_FP32=interpret,
        DOT_PRECISION="ieee" if interpret or x.dtype == torch.float32 else "tf32",
    )
    return out
