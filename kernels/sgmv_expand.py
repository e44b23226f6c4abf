"""The SGMV expand, y += h @ B^T per segment: its input checks, torch path, Triton kernel and launcher.

kernels/sgmv.py states the semantics (the reference loop), the pool layout and the segment rules, and its
`sgmv_expand` picks the path; the helpers shared with the shrink live in kernels/sgmv_common.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.sgmv_common import (
    _SUPPORTED_DTYPES,
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

__all__ = ["sgmv_expand_torch", "sgmv_expand_triton"]


# ---------------------------------------------------------------------------------------------------------------------
# Input checks (shapes, dtypes, devices; values are not read: on CUDA that would synchronize)
# ---------------------------------------------------------------------------------------------------------------------


def _check_expand(
    h: torch.Tensor,
    weights: torch.Tensor,
    page_table: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    y: torch.Tensor,
    page_elems: int,
    h_col_offsets: torch.Tensor | None,
) -> None:
    if h.dim() != 2:
        raise ValueError(f"h must be [num_tokens, >= max rank], got shape {tuple(h.shape)}")
    if h.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"h dtype must be one of {_SUPPORTED_DTYPES}, got {h.dtype}")
    if y.dim() != 2 or y.shape[0] != h.shape[0]:
        raise ValueError(f"y must be [num_tokens={h.shape[0]}, out_features], got shape {tuple(y.shape)}")
    if y.dtype != weights.dtype:
        raise ValueError(f"y ({y.dtype}) and weights ({weights.dtype}) must share a dtype")
    if y.device != h.device:
        raise ValueError(f"y is on {y.device}, h is on {h.device}")
    _check_pool_and_segments(
        h.device, weights, page_table, b_offsets, "b_offsets", ranks, seg_starts, seg_slots, page_elems
    )
    if h_col_offsets is not None:
        if h_col_offsets.shape != ranks.shape or h_col_offsets.dtype != torch.int32:
            raise ValueError(
                f"h_col_offsets must be [num_slots={ranks.shape[0]}] int32, "
                f"got {tuple(h_col_offsets.shape)} {h_col_offsets.dtype}"
            )
        if h_col_offsets.device != h.device:
            raise ValueError(f"h_col_offsets is on {h_col_offsets.device}, h is on {h.device}")


# ---------------------------------------------------------------------------------------------------------------------
# Torch path (CPU serving)
# ---------------------------------------------------------------------------------------------------------------------


def sgmv_expand_torch(
    h: torch.Tensor,  # [num_tokens, >= max rank]
    weights: torch.Tensor,  # [num_pages * page_elems], y's dtype
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    b_offsets: torch.Tensor,  # [num_slots] int64
    ranks: torch.Tensor,  # [num_slots] int32
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    *,
    page_elems: int,
    h_col_offsets: torch.Tensor | None = None,  # [num_slots] int32: first column of h per slot; None = 0
    segments: HostSegments | None = None,
    slot_bases: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """The torch path: for float32 h and y, one in-place addmm_ per segment into y's rows (a column-slice view of
    a wider tensor works without a copy); otherwise the product goes through one float32 scratch buffer and is
    added once. Reads its metadata on the host. Raises ValueError when a slot's columns run past h's.
    """
    _check_expand(h, weights, page_table, b_offsets, ranks, seg_starts, seg_slots, y, page_elems, h_col_offsets)
    num_tokens, out_features = y.shape
    segments = _host_segments(seg_starts, seg_slots, segments, num_tokens, page_table.shape[0])
    if slot_bases is not None and len(slot_bases) != page_table.shape[0]:
        raise ValueError(f"slot_bases has {len(slot_bases)} entries, page_table {page_table.shape[0]} slots")
    rank_of: list[int] = ranks.tolist()
    offset_of: list[int] = b_offsets.tolist()
    col_of: list[int] = [0] * len(rank_of) if h_col_offsets is None else h_col_offsets.tolist()
    in_place = y.dtype == torch.float32
    if in_place and h.dtype != torch.float32:
        h = h.float()
    work: list[tuple[int, int, int, int, int]] = []  # (start, end, slot, rank, first column of h) to add
    for start, end, slot in segments:
        if slot < 0:
            continue
        rank, col = rank_of[slot], col_of[slot]
        if col < 0 or col + rank > h.shape[1]:
            raise ValueError(f"slot {slot}: columns [{col}, {col + rank}) of h, which has {h.shape[1]}")
        if end > start and rank > 0:
            _check_span(slot, offset_of[slot], rank * out_features, page_table, page_elems, weights, slot_bases)
            work.append((start, end, slot, rank, col))
    scratch: torch.Tensor | None = None  # [longest segment, out_features] float32 when y is half precision
    matrices: dict[int, torch.Tensor] = {}  # slot -> its B^T [rank, out_features], float32
    for start, end, slot, rank, col in work:
        bt = matrices.get(slot)
        if bt is None:
            bt = _slot_matrix(weights, page_table, slot, offset_of[slot], rank, out_features, page_elems, slot_bases)
            matrices[slot] = bt = bt.float()
        if in_place:
            y[start:end].addmm_(h[start:end, col : col + rank], bt)
            continue
        if scratch is None:
            longest = max(e - s for s, e, _ in segments)
            scratch = torch.empty(longest, out_features, dtype=torch.float32, device=y.device)
        product = torch.mm(h[start:end, col : col + rank].float(), bt, out=scratch[: end - start])
        y[start:end].add_(product)
    return y


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernel and launcher (CUDA; CPU under TRITON_INTERPRET=1 for tests)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _sgmv_expand_kernel(  # type: ignore[no-untyped-def]  # Triton reads parameter annotations itself
        # Pointers
        h_ptr,  # [num_tokens, >= max rank]
        weights_ptr,  # [num_pages * page_elems]
        page_table_ptr,  # [num_slots, max_pages] int32
        b_offsets_ptr,  # [num_slots] int64
        ranks_ptr,  # [num_slots] int32
        h_col_offsets_ptr,  # [num_slots] int32 (read only when HAS_H_COL_OFFSETS)
        seg_starts_ptr,  # [num_segments + 1] int32
        seg_slots_ptr,  # [num_segments] int32, -1 = no adapter
        y_ptr,  # [num_tokens, out_features], read and written
        # Sizes
        out_features,
        h_cols,  # columns of h: no rank reads past them
        # Strides
        stride_h_token,
        stride_h_rank,
        stride_pt_slot,
        stride_pt_page,
        stride_y_token,
        stride_y_feature,
        # Meta-parameters
        PAGE_ELEMS: tl.constexpr,  # elements per pool page
        BLOCK_T: tl.constexpr,  # tokens per program
        BLOCK_N: tl.constexpr,  # output features per program, <= PAGE_ELEMS
        BLOCK_R: tl.constexpr,  # rank rows per step of the reduction
        HAS_H_COL_OFFSETS: tl.constexpr,  # else every slot's columns start at h's column 0
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 weights, "tf32" for half ones (exact in tf32)
    ):
        """Program (segment, output tile, token tile): y[tokens, cols] += h[tokens, :rank] @ Bt[:rank, cols]."""
        seg = tl.program_id(0)
        n_tile = tl.program_id(1)
        t_tile = tl.program_id(2)
        seg_start = tl.load(seg_starts_ptr + seg)
        seg_end = tl.load(seg_starts_ptr + seg + 1)
        t_start = seg_start + t_tile * BLOCK_T
        slot = tl.load(seg_slots_ptr + seg)
        if (t_start >= seg_end) | (slot < 0):
            return
        h_col = 0
        if HAS_H_COL_OFFSETS:
            h_col = tl.load(h_col_offsets_ptr + slot)
        rank = tl.minimum(tl.load(ranks_ptr + slot), h_cols - h_col)
        if rank <= 0:
            return
        b_offset = tl.load(b_offsets_ptr + slot)
        pt_row_ptr = page_table_ptr + slot.to(tl.int64) * stride_pt_slot
        offs_t = t_start + tl.arange(0, BLOCK_T)
        t_valid = offs_t < seg_end
        n_start = n_tile * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < out_features
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for r_start in range(0, rank, BLOCK_R):
            offs_r = r_start + tl.arange(0, BLOCK_R)
            r_valid = offs_r < rank
            hv = tl.load(
                h_ptr + offs_t[:, None].to(tl.int64) * stride_h_token + (h_col + offs_r)[None, :] * stride_h_rank,
                mask=t_valid[:, None] & r_valid[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_T, BLOCK_R]
            bt = _load_pool_tile(
                weights_ptr,
                pt_row_ptr,
                stride_pt_page,
                b_offset,
                out_features,
                offs_r,
                r_valid,
                n_start,
                BLOCK_N,
                PAGE_ELEMS,
            ).to(tl.float32)  # [BLOCK_R, BLOCK_N]
            acc += tl.dot(hv, bt, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_y_token + offs_n[None, :] * stride_y_feature
        mask = t_valid[:, None] & n_valid[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def sgmv_expand_triton(
    h: torch.Tensor,  # [num_tokens, >= max rank]
    weights: torch.Tensor,  # [num_pages * page_elems], y's dtype
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    b_offsets: torch.Tensor,  # [num_slots] int64
    ranks: torch.Tensor,  # [num_slots] int32
    seg_starts: torch.Tensor,  # [num_segments + 1] int32
    seg_slots: torch.Tensor,  # [num_segments] int32, -1 = no adapter
    y: torch.Tensor,  # [num_tokens, out_features], updated in place
    *,
    page_elems: int,
    h_col_offsets: torch.Tensor | None = None,  # [num_slots] int32: first column of h per slot; None = 0
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """Launch the expand kernel: check, launch; returns y. CPU tensors work under TRITON_INTERPRET=1.

    Reads no tensor values. Ranks running past h's columns are clamped to them (the torch path raises instead).
    """
    _require_triton("sgmv_expand_triton")
    _check_expand(h, weights, page_table, b_offsets, ranks, seg_starts, seg_slots, y, page_elems, h_col_offsets)
    num_tokens, out_features = y.shape
    num_segments = seg_slots.shape[0]
    if num_tokens == 0 or num_segments == 0 or out_features == 0 or h.shape[1] == 0:
        return y
    block_t, num_t_tiles = _block_t(num_tokens, max_segment_len)
    block_n = _block_cols(page_elems, 128)
    interpret = h.device.type == "cpu"
    grid = (num_segments, triton.cdiv(out_features, block_n), num_t_tiles)
    _sgmv_expand_kernel[grid](
        h,
        weights,
        page_table,
        b_offsets,
        ranks,
        ranks if h_col_offsets is None else h_col_offsets,
        seg_starts,
        seg_slots,
        y,
        out_features,
        h.shape[1],
        *h.stride(),
        *page_table.stride(),
        *y.stride(),
        PAGE_ELEMS=page_elems,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_R=max(16, min(64, triton.next_power_of_2(h.shape[1]))),
        HAS_H_COL_OFFSETS=h_col_offsets is not None,
        DOT_PRECISION="ieee" if interpret or weights.dtype == torch.float32 else "tf32",
    )
    return y
