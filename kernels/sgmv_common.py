"""What the SGMV shrink and expand share (kernels/sgmv.py states their semantics, the pool layout and the
segment rules): the guarded Triton import, the checks of the pool and segment tensors, the host-side segment
list and slot matrices of the torch paths, the kernels' tile load through the page table, and the launchers'
tiling helpers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch

try:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]
except ImportError:  # the CPU image ships without Triton; the torch paths need none
    HAS_TRITON = False
else:
    HAS_TRITON = True

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Host copy of (seg_starts, seg_slots): one (start, end, slot) per segment, slot -1 for no adapter.
HostSegments: TypeAlias = Sequence[tuple[int, int, int]]


# ---------------------------------------------------------------------------------------------------------------------
# Input checks (shapes, dtypes, devices; values are not read: on CUDA that would synchronize)
# ---------------------------------------------------------------------------------------------------------------------


def _check_pool_and_segments(
    device: torch.device,
    weights: torch.Tensor,
    page_table: torch.Tensor,
    offsets: torch.Tensor,
    offsets_name: str,
    ranks: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    page_elems: int,
) -> None:
    if page_elems < 1:
        raise ValueError(f"page_elems must be positive, got {page_elems}")
    if weights.dim() != 1 or not weights.is_contiguous():
        raise ValueError(f"weights must be the flat, contiguous pool storage, got shape {tuple(weights.shape)}")
    if weights.numel() % page_elems != 0:
        raise ValueError(f"weights has {weights.numel()} elements, not a multiple of page_elems={page_elems}")
    if weights.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"weights dtype must be one of {_SUPPORTED_DTYPES}, got {weights.dtype}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [num_slots, max_pages], got shape {tuple(page_table.shape)}")
    num_slots = page_table.shape[0]
    if offsets.shape != (num_slots,):
        raise ValueError(f"{offsets_name} must be [num_slots={num_slots}], got shape {tuple(offsets.shape)}")
    if ranks.shape != (num_slots,):
        raise ValueError(f"ranks must be [num_slots={num_slots}], got shape {tuple(ranks.shape)}")
    if seg_starts.dim() != 1 or seg_starts.shape[0] < 1:
        raise ValueError(f"seg_starts must be [num_segments + 1], got shape {tuple(seg_starts.shape)}")
    num_segments = seg_starts.shape[0] - 1
    if seg_slots.shape != (num_segments,):
        raise ValueError(f"seg_slots must be [num_segments={num_segments}], got shape {tuple(seg_slots.shape)}")
    int_args = [("page_table", page_table), ("ranks", ranks), ("seg_starts", seg_starts), ("seg_slots", seg_slots)]
    for name, t in int_args:
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if offsets.dtype != torch.int64:
        raise ValueError(f"{offsets_name} must be int64, got {offsets.dtype}")
    for name, t in [("weights", weights), (offsets_name, offsets), *int_args]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the activations are on {device}")


def _host_segments(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor, segments: HostSegments | None, num_tokens: int, num_slots: int
) -> HostSegments:
    """The (start, end, slot) list, read from the tensors unless given; checked to tile [0, num_tokens) and to name
    existing slots (or -1)."""
    if segments is None:
        starts: list[int] = seg_starts.tolist()
        segments = list(zip(starts[:-1], starts[1:], seg_slots.tolist(), strict=True))
    elif len(segments) != seg_slots.shape[0]:
        raise ValueError(f"segments has {len(segments)} entries, seg_slots {seg_slots.shape[0]}")
    expected_start = 0
    for start, end, slot in segments:
        if start != expected_start or end < start:
            raise ValueError(f"segments must tile [0, num_tokens={num_tokens}) in order, got {list(segments)}")
        if not -1 <= slot < num_slots:
            raise ValueError(f"segment slot {slot} is neither -1 nor one of the {num_slots} slots")
        expected_start = end
    if expected_start != num_tokens:
        raise ValueError(f"segments must tile [0, num_tokens={num_tokens}) in order, got {list(segments)}")
    return segments


# ---------------------------------------------------------------------------------------------------------------------
# Torch paths (CPU serving)
# ---------------------------------------------------------------------------------------------------------------------


def _check_span(
    slot: int,
    offset: int,
    size: int,
    page_table: torch.Tensor,
    page_elems: int,
    weights: torch.Tensor,
    slot_bases: Sequence[int | None] | None,
) -> None:
    """Raise ValueError unless the slot's elements [offset, offset + size) lie within its page-table row (and,
    for a slot with a base, within the pool). Page ids themselves are trusted."""
    if offset < 0 or offset + size > page_table.shape[1] * page_elems:
        raise ValueError(
            f"slot {slot}: elements [{offset}, {offset + size}) need "
            f"{-(-(offset + size) // page_elems)} pages, page_table has {page_table.shape[1]}"
        )
    base = None if slot_bases is None else slot_bases[slot]
    if base is not None and (base < 0 or base + offset + size > weights.numel()):
        raise ValueError(f"slot {slot}: base {base} + elements [{offset}, {offset + size}) run past the pool")


def _slot_matrix(
    weights: torch.Tensor,  # [num_pages * page_elems]
    page_table: torch.Tensor,  # [num_slots, max_pages] int32
    slot: int,
    offset: int,  # logical element offset of the matrix in the slot's region
    num_rows: int,
    num_cols: int,
    page_elems: int,
    slot_bases: Sequence[int | None] | None,
) -> torch.Tensor:
    """The slot's [num_rows, num_cols] row-major matrix at `offset`: a view when its pages are one ascending run,
    else a copy of just the pages it spans.

    The copy gathers whole pages (index_select on the page ids, a memcpy each) rather than elements: its index is
    the page table row itself, so nothing has to be precomputed or cached per adapter.
    """
    size = num_rows * num_cols
    if slot_bases is not None:
        base = slot_bases[slot]
        if base is not None:
            return weights.as_strided((num_rows, num_cols), (num_cols, 1), weights.storage_offset() + base + offset)
    first = offset // page_elems
    pages = page_table[slot, first : -(-(offset + size) // page_elems)]
    if slot_bases is None:
        ids: list[int] = pages.tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            start = ids[0] * page_elems + offset - first * page_elems
            return weights.as_strided((num_rows, num_cols), (num_cols, 1), weights.storage_offset() + start)
    gathered = weights.view(-1, page_elems).index_select(0, pages).view(-1)
    local = offset - first * page_elems
    return gathered[local : local + size].view(num_rows, num_cols)


# ---------------------------------------------------------------------------------------------------------------------
# Triton (CUDA; CPU under TRITON_INTERPRET=1 for tests)
# ---------------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _load_pool_tile(  # type: ignore[no-untyped-def]  # Triton reads parameter annotations itself
        weights_ptr,  # [num_pages * page_elems]
        pt_row_ptr,  # the slot's row of page_table
        stride_pt_page,
        matrix_offset,  # logical element offset of the matrix in the slot's region (int64)
        row_len,  # elements per row of the matrix
        rows,  # [BLOCK_ROWS] row indices of the tile
        row_valid,  # [BLOCK_ROWS]
        col_start,  # first column of the tile
        BLOCK_COLS: tl.constexpr,  # <= PAGE_ELEMS: a row chunk spans at most two pages
        PAGE_ELEMS: tl.constexpr,
    ):
        """The [BLOCK_ROWS, BLOCK_COLS] tile (rows, col_start + c) of a row-major matrix in a slot's pages; masked
        entries (invalid rows, columns >= row_len) are 0.

        Each row chunk starts in page `page_lo` and may run into the next, `page_hi`: two page-table reads per
        row instead of one per element, and no per-element division.
        """
        cols = col_start + tl.arange(0, BLOCK_COLS)
        num_cols_left = tl.minimum(row_len - col_start, BLOCK_COLS)
        chunk = matrix_offset + rows.to(tl.int64) * row_len + col_start  # [BLOCK_ROWS]: logical element of col 0
        page_idx = chunk // PAGE_ELEMS
        in_page = chunk - page_idx * PAGE_ELEMS
        page_lo = tl.load(pt_row_ptr + page_idx * stride_pt_page, mask=row_valid, other=0).to(tl.int64)
        # Read the next page id only where the row's valid columns reach it: past the slot's last page the
        # page table may hold anything, or end.
        crosses = row_valid & (in_page + num_cols_left > PAGE_ELEMS)
        page_hi = tl.load(pt_row_ptr + (page_idx + 1) * stride_pt_page, mask=crosses, other=0).to(tl.int64)
        local = in_page[:, None] + tl.arange(0, BLOCK_COLS)[None, :]  # [BLOCK_ROWS, BLOCK_COLS]
        addr = tl.where(
            local < PAGE_ELEMS,
            page_lo[:, None] * PAGE_ELEMS + local,
            page_hi[:, None] * PAGE_ELEMS + (local - PAGE_ELEMS),
        )
        mask = row_valid[:, None] & (cols < row_len)[None, :]
        return tl.load(weights_ptr + addr, mask=mask, other=0.0)


def _require_triton(name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs Triton (the `kernels` extra); use the torch path")


def _block_t(num_tokens: int, max_segment_len: int | None) -> tuple[int, int]:
    """(tokens per program, token tiles per segment). 16 rows (tl.dot's minimum) for decode-sized segments."""
    longest = num_tokens if max_segment_len is None else min(max_segment_len, num_tokens)
    block_t = 16 if longest <= 16 else 64
    return block_t, triton.cdiv(max(longest, 1), block_t)


def _block_cols(page_elems: int, preferred: int) -> int:
    """A column tile <= page_elems (a row chunk then spans at most two pages), >= 16 (tl.dot's minimum)."""
    if page_elems < 16:
        raise ValueError(f"the Triton kernels need page_elems >= 16, got {page_elems}")
    return min(preferred, 1 << (page_elems.bit_length() - 1))
