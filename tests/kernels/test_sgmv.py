"""SGMV shrink and expand: the torch paths and the Triton kernels against a naive loop over tokens that rebuilds
each adapter's A and B element by element through the page table.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET must be set before anything in the
session imports Triton; tests/conftest.py does it). Matrices start at odd offsets and pages are not a multiple of
a row, so rows straddle page boundaries; pages are shuffled. Every pool element that no matrix owns (gaps, page
tails, spare pages, and the page-table entries past a slot's pages, which point at a spare page) is NaN, so a
wrong page lookup, a read past a rank or a row, or a masked NaN let into a sum fails the comparison.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex.kernels import native, sgmv  # noqa: E402  (after TRITON_INTERPRET, see above)

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Inputs are exact in every dtype and both paths accumulate in float32: the shrink output (float32) is tight for
# all of them. The expand output is rounded once to y's dtype: half an ulp (2^-11 or 2^-8 relative), but Triton's
# interpreter converts float32 to bfloat16 by truncation, a whole ulp (2^-7), where a GPU rounds to nearest.
SHRINK_ATOL = 1e-4
EXPAND_TOL = {  # (atol, rtol)
    torch.float32: (1e-4, 0.0),
    torch.float16: (1e-3, 2**-10),
    torch.bfloat16: (1e-3, 2**-7),
}
IN_FEATURES, OUT_FEATURES = 96, 72
PAGE_ELEMS = 80  # not a multiple of either row length: rows straddle pages
MIXED_RANKS = [16, 4, 128, 0, 64, 8, 32, 4]  # slot i gets MIXED_RANKS[i]; rank 0 is a loaded but empty adapter


@dataclass
class Pool:
    """One layer's adapter storage with each slot's matrices placed through shuffled pages."""

    weights: torch.Tensor  # [num_pages * page_elems]
    page_table: torch.Tensor  # [num_slots, max_pages] int32
    offsets: list[list[int]]  # per slot, the logical offset of each matrix given to make_pool
    slot_bases: list[int | None]  # per slot, its logical element 0's place in weights when pages are in order
    page_elems: int
    _values: list[float] | None = None  # weights as a host list, for the reference (weights are never written)

    def values(self) -> list[float]:
        if self._values is None:
            self._values = self.weights.cpu().double().tolist()
        return self._values


def make_pool(
    matrices: list[list[torch.Tensor]],
    *,
    dtype: torch.dtype,
    page_elems: int = PAGE_ELEMS,
    contiguous: bool = False,
    gen: torch.Generator,
) -> Pool:
    """Place matrices[slot] (row-major, back to back after odd gaps) in the slot's logical region."""
    regions: list[torch.Tensor] = []
    offsets: list[list[int]] = []
    for slot, mats in enumerate(matrices):
        parts: list[torch.Tensor] = []
        slot_offsets: list[int] = []
        cursor = 0
        for i, mat in enumerate(mats):
            gap = 3 + 2 * slot + 5 * i  # odd and varying: rows start anywhere in a page
            parts.append(torch.full((gap,), float("nan")))
            cursor += gap
            slot_offsets.append(cursor)
            parts.append(mat.reshape(-1).float())
            cursor += mat.numel()
        region = torch.cat(parts)
        num_pages = max(1, math.ceil(region.numel() / page_elems))
        padded = torch.full((num_pages * page_elems,), float("nan"))
        padded[: region.numel()] = region
        regions.append(padded)
        offsets.append(slot_offsets)
    pages_per_slot = [r.numel() // page_elems for r in regions]
    num_spare = 3
    num_pages = sum(pages_per_slot) + num_spare
    # Contiguous: slots in order after one spare page (so no base is 0). Else every page anywhere.
    order = torch.arange(num_pages) if contiguous else torch.randperm(num_pages, generator=gen)
    spare = int(order[0])
    owned = order[1 : 1 + sum(pages_per_slot)].tolist()
    max_pages = max(pages_per_slot) + 2
    page_table = torch.full((len(matrices), max_pages), spare, dtype=torch.int32)  # padding -> a NaN page
    weights = torch.full((num_pages, page_elems), float("nan"))
    slot_bases: list[int | None] = []
    taken = 0
    for slot, region in enumerate(regions):
        ids = owned[taken : taken + pages_per_slot[slot]]
        taken += len(ids)
        page_table[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        weights[ids] = region.view(-1, page_elems)
        in_order = ids == list(range(ids[0], ids[0] + len(ids)))
        slot_bases.append(ids[0] * page_elems if in_order else None)
    return Pool(weights.view(-1).to(dtype), page_table, offsets, slot_bases, page_elems)


def rebuild(pool: Pool, slot: int, offset: int, rows: int, cols: int) -> torch.Tensor:
    """The docstring's pool(slot, e), element by element, as a float64 [rows, cols] matrix."""
    flat = pool.values()
    table = pool.page_table.cpu().tolist()[slot]
    pe = pool.page_elems
    values = [flat[table[e // pe] * pe + e % pe] for e in range(offset, offset + rows * cols)]
    return torch.tensor(values, dtype=torch.float64).view(rows, cols)


def token_slots(layout: list[tuple[int, int]]) -> list[int]:
    """The slot of every token, segment by segment: the naive loop's per-token lookup."""
    return [slot for length, slot in layout for _ in range(length)]


@dataclass
class Case:
    x: torch.Tensor  # [num_tokens, in_features]
    h: torch.Tensor  # [num_tokens, max_rank + 3], a column slice of a wider tensor
    y_wide: torch.Tensor  # [num_tokens, out_features + 9]; y is its columns 4 .. 4 + out_features
    pool: Pool
    ranks: list[int]
    layout: list[tuple[int, int]]  # (length, slot) per segment
    max_rank: int
    device: str

    @property
    def y(self) -> torch.Tensor:
        return self.y_wide[:, 4 : 4 + OUT_FEATURES]

    def tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def metadata(self, module: int = 0) -> dict[str, torch.Tensor]:
        """The shared tensor arguments; `module` picks the offsets (0: A, 1: B^T)."""
        starts = [0]
        for length, _ in self.layout:
            starts.append(starts[-1] + length)
        return {
            "weights": self.pool.weights,
            "page_table": self.pool.page_table,
            "offsets": self.tensor([offs[module] for offs in self.pool.offsets], torch.int64),
            "ranks": self.tensor(self.ranks, torch.int32),
            "seg_starts": self.tensor(starts, torch.int32),
            "seg_slots": self.tensor([slot for _, slot in self.layout], torch.int32),
        }

    def host_hints(self) -> dict[str, Any]:
        segments, start = [], 0
        for length, slot in self.layout:
            segments.append((start, start + length, slot))
            start += length
        return {"segments": segments, "slot_bases": self.pool.slot_bases}

    def shrink(self, fn: Callable[..., torch.Tensor], **extra: Any) -> torch.Tensor:
        m = self.metadata(0)
        a_offsets = m.pop("offsets")
        args = (self.x, m["weights"], m["page_table"], a_offsets, m["ranks"], m["seg_starts"], m["seg_slots"])
        return fn(*args, page_elems=self.pool.page_elems, max_rank=self.max_rank, **extra)

    def expand(self, fn: Callable[..., torch.Tensor], **extra: Any) -> torch.Tensor:
        m = self.metadata(1)
        b_offsets = m.pop("offsets")
        args = (self.h, m["weights"], m["page_table"], b_offsets, m["ranks"], m["seg_starts"], m["seg_slots"])
        return fn(*args, self.y, page_elems=self.pool.page_elems, **extra)

    def reference_shrink(self) -> torch.Tensor:
        """Per token: its slot's A rebuilt through the page table, times x[t]; zeros past the rank."""
        out = torch.zeros(self.x.shape[0], self.max_rank, dtype=torch.float64)
        mats: dict[int, torch.Tensor] = {}
        x = self.x.cpu().double()
        for t, slot in enumerate(token_slots(self.layout)):
            if slot == -1:
                continue
            rank = self.ranks[slot]
            if slot not in mats:
                mats[slot] = rebuild(self.pool, slot, self.pool.offsets[slot][0], rank, IN_FEATURES)
            out[t, :rank] = mats[slot] @ x[t]
        return out

    def reference_expand(self) -> torch.Tensor:
        """The whole of y_wide after y[t] += h[t, :rank] @ B^T, per token; -1 tokens and other columns as they were."""
        expected = self.y_wide.cpu().double()
        mats: dict[int, torch.Tensor] = {}
        h = self.h.cpu().double()
        for t, slot in enumerate(token_slots(self.layout)):
            if slot == -1:
                continue
            rank = self.ranks[slot]
            if slot not in mats:
                mats[slot] = rebuild(self.pool, slot, self.pool.offsets[slot][1], rank, OUT_FEATURES)
            expected[t, 4 : 4 + OUT_FEATURES] += h[t, :rank] @ mats[slot]
        return expected


def make_case(
    ranks: list[int],
    layout: list[tuple[int, int]],
    *,
    dtype: torch.dtype = torch.float32,
    page_elems: int = PAGE_ELEMS,
    contiguous: bool = False,
    max_rank: int | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    matrices = [
        [
            torch.randn(r, IN_FEATURES, generator=gen) / IN_FEATURES**0.5,  # A [rank, in]
            torch.randn(r, OUT_FEATURES, generator=gen) / max(r, 1) ** 0.5,  # B^T [rank, out], scaled
        ]
        for r in ranks
    ]
    pool = make_pool(matrices, dtype=dtype, page_elems=page_elems, contiguous=contiguous, gen=gen)
    num_tokens = sum(length for length, _ in layout)
    max_rank = max(ranks) if max_rank is None else max_rank
    h_wide = torch.randn(num_tokens, max_rank + 5, generator=gen)
    case = Case(
        x=torch.randn(num_tokens, IN_FEATURES, generator=gen).to(dtype),
        h=h_wide[:, 2:],  # [num_tokens, max_rank + 3], not contiguous
        y_wide=torch.randn(num_tokens, OUT_FEATURES + 9, generator=gen).to(dtype),
        pool=pool,
        ranks=ranks,
        layout=layout,
        max_rank=max_rank,
        device=device,
    )
    if device != "cpu":
        case.x, case.h, case.y_wide = case.x.to(device), case.h.to(device), case.y_wide.to(device)
        case.pool.weights = case.pool.weights.to(device)
        case.pool.page_table = case.pool.page_table.to(device)
    return case


def layouts(num_adapters: int) -> dict[str, list[tuple[int, int]]]:
    """(length, slot) per segment for each segment layout of the sweep; slot -1 = no adapter."""
    n = num_adapters
    return {
        "empty-segments": [(0, 0), *[seg for i in range(n) for seg in ((2 + i % 3, i), (0, (i + 1) % n))], (0, -1)],
        "one-token": [(1, i % n) for i in range(2 * n + 3)],
        "no-adapter": [(3, -1), (4, 0), (2, -1), (1, n - 1), *[(2, i) for i in range(n)], (5, -1)],
        "one-long": [(70, n - 1)],  # > 64 tokens: two token tiles, the second ragged
        "many-short": [(1 + i % 3, i % n) for i in range(3 * n + 4)] + [(1, -1)],
    }


def sweep_ranks(config: str, num_adapters: int) -> tuple[list[int], int]:
    """(rank per slot, max_rank). Mixed ranks pass a max_rank above all of them: the extra columns must be 0."""
    if config == "mixed":
        ranks = MIXED_RANKS[:num_adapters]
        return ranks, max(ranks) + 3
    return [int(config)] * num_adapters, int(config)


RANK_CONFIGS = ["4", "8", "16", "64", "128", "mixed"]
LAYOUTS = list(layouts(1))


def check_shrink(case: Case, fn: Callable[..., torch.Tensor], **extra: Any) -> None:
    out = torch.full((case.x.shape[0], case.max_rank), float("nan"), device=case.device)  # every cell must be set
    result = case.shrink(fn, out=out, **extra)
    assert result is out
    torch.testing.assert_close(result.cpu().double(), case.reference_shrink(), atol=SHRINK_ATOL, rtol=0)


def check_expand(case: Case, fn: Callable[..., torch.Tensor], **extra: Any) -> None:
    expected = case.reference_expand()
    y = case.y
    result = case.expand(fn, **extra)
    assert result is y or result.data_ptr() == y.data_ptr()
    atol, rtol = EXPAND_TOL[y.dtype]
    torch.testing.assert_close(case.y_wide.cpu().double(), expected, atol=atol, rtol=rtol)


def require_triton() -> None:
    if not sgmv.HAS_TRITON:
        pytest.fail("Triton is not installed: `pip install -e '.[kernels]'`", pytrace=False)
    if DEVICE == "cpu" and type(sgmv._sgmv_shrink_kernel).__name__ != "InterpretedFunction":
        pytest.fail(
            "Triton was imported before TRITON_INTERPRET=1 was set (engine modules import the kernels), so it "
            "cannot run on CPU: set the variable at the top of tests/conftest.py when CUDA is unavailable",
            pytrace=False,
        )


def ids(value: Any) -> str:
    return str(value).removeprefix("torch.")


class TestTorchPath:
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("num_adapters", [1, 3, 8])
    @pytest.mark.parametrize("rank_config", RANK_CONFIGS)
    @pytest.mark.parametrize("dtype", DTYPES, ids=ids)
    def test_sweep(self, dtype: torch.dtype, rank_config: str, num_adapters: int, layout: str) -> None:
        ranks, max_rank = sweep_ranks(rank_config, num_adapters)
        case = make_case(ranks, layouts(num_adapters)[layout], dtype=dtype, max_rank=max_rank)
        check_shrink(case, sgmv.sgmv_shrink_torch)
        check_expand(case, sgmv.sgmv_expand_torch)

    @pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "shuffled"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=ids)
    def test_host_hints_give_the_same_result(self, dtype: torch.dtype, contiguous: bool) -> None:
        case = make_case(MIXED_RANKS, layouts(8)["no-adapter"], dtype=dtype, contiguous=contiguous)
        assert (None not in case.pool.slot_bases) is contiguous
        check_shrink(case, sgmv.sgmv_shrink_torch, **case.host_hints())
        check_expand(case, sgmv.sgmv_expand_torch, **case.host_hints())

    def test_contiguous_slot_is_read_in_place(self) -> None:
        # Zero-copy is the point of contiguous slots on CPU: the matrix must be a view of the pool.
        for contiguous in (True, False):
            case = make_case([8, 16], [(3, 0), (2, 1)], contiguous=contiguous)
            pool = case.pool
            for hints in (None, pool.slot_bases):
                a = sgmv._slot_matrix(pool.weights, pool.page_table, 1, pool.offsets[1][0], 16, 96, PAGE_ELEMS, hints)
                assert (a.untyped_storage().data_ptr() == pool.weights.untyped_storage().data_ptr()) is contiguous
                torch.testing.assert_close(a.double(), rebuild(pool, 1, pool.offsets[1][0], 16, 96), atol=0, rtol=0)

    def test_allocates_out(self) -> None:
        case = make_case(MIXED_RANKS[:3], layouts(3)["no-adapter"], max_rank=131)
        out = case.shrink(sgmv.sgmv_shrink_torch)
        assert out.shape == (case.x.shape[0], 131)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), case.reference_shrink(), atol=SHRINK_ATOL, rtol=0)

    def test_dispatch_uses_torch_path_for_cpu_tensors(self) -> None:
        case = make_case(MIXED_RANKS[:3], layouts(3)["many-short"])
        expected = case.shrink(sgmv.sgmv_shrink_torch)
        torch.testing.assert_close(case.shrink(sgmv.sgmv_shrink), expected, atol=0, rtol=0)
        check_expand(case, sgmv.sgmv_expand)

    def test_empty_batch(self) -> None:
        case = make_case([8], [])
        assert case.shrink(sgmv.sgmv_shrink_torch).shape == (0, 8)
        assert case.expand(sgmv.sgmv_expand_torch).shape == (0, OUT_FEATURES)

    def test_wrong_page_would_be_caught(self) -> None:
        # The fixtures make a page mix-up visible: swapping two of a slot's pages changes the result.
        case = make_case([16], [(5, 0)])
        expected = case.reference_shrink()
        case.pool.page_table[0, [0, 1]] = case.pool.page_table[0, [1, 0]]
        assert not torch.allclose(case.shrink(sgmv.sgmv_shrink_torch).double(), expected, atol=SHRINK_ATOL)


class TestTritonKernel:
    @pytest.mark.parametrize("rank_config", RANK_CONFIGS)
    @pytest.mark.parametrize("dtype", DTYPES, ids=ids)
    def test_dtype_and_rank_sweep(self, dtype: torch.dtype, rank_config: str) -> None:
        require_triton()
        ranks, max_rank = sweep_ranks(rank_config, 3)
        layout = [(2, 0), (0, 1), (1, -1), (3, 2), (1, 1), (0, -1), (17, 0)]  # 17: a 16-token tile plus one
        case = make_case(ranks, layout, dtype=dtype, max_rank=max_rank, device=DEVICE)
        check_shrink(case, sgmv.sgmv_shrink_triton)
        check_expand(case, sgmv.sgmv_expand_triton)

    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("num_adapters", [1, 3, 8])
    def test_layout_sweep(self, num_adapters: int, layout: str) -> None:
        require_triton()
        ranks, max_rank = sweep_ranks("mixed", num_adapters)
        case = make_case(ranks, layouts(num_adapters)[layout], dtype=torch.bfloat16, max_rank=max_rank, device=DEVICE)
        check_shrink(case, sgmv.sgmv_shrink_triton)
        check_expand(case, sgmv.sgmv_expand_triton)

    @pytest.mark.parametrize("page_elems", [16, 37, 4096], ids=["tiny-pages", "odd-pages", "large-pages"])
    def test_page_sizes(self, page_elems: int) -> None:
        # 16 and 37: every 64-column tile crosses pages (tiles shrink to 16 and 32 columns); 4096: one page holds
        # a whole matrix.
        require_triton()
        case = make_case(MIXED_RANKS[:3], layouts(3)["no-adapter"], page_elems=page_elems, device=DEVICE)
        check_shrink(case, sgmv.sgmv_shrink_triton)
        check_expand(case, sgmv.sgmv_expand_triton)

    def test_max_segment_len_hint(self) -> None:
        require_triton()
        case = make_case(MIXED_RANKS[:3], layouts(3)["many-short"], device=DEVICE)
        check_shrink(case, sgmv.sgmv_shrink_triton, max_segment_len=3)
        check_expand(case, sgmv.sgmv_expand_triton, max_segment_len=3)

    def test_empty_batch(self) -> None:
        require_triton()
        case = make_case([8], [], device=DEVICE)
        assert case.shrink(sgmv.sgmv_shrink_triton).shape == (0, 8)
        assert case.expand(sgmv.sgmv_expand_triton).shape == (0, OUT_FEATURES)


QKV_OUT = [40, 16, 16]  # q, k, v output features
QKV_RANKS = [[8, 8, 8], [16, 4, 4], [0, 0, 0], [32, 32, 16]]  # per slot: q, k, v ranks


def make_group_case(
    dtype: torch.dtype, device: str, *, contiguous: bool = False, layout: list[tuple[int, int]] | None = None
) -> tuple[Case, list[list[torch.Tensor]]]:
    """q/k/v of 4 slots: A rows back to back ([rq + rk + rv, in]), then B^T of q, k and v."""
    gen = torch.Generator().manual_seed(7)
    mats = []
    for ranks in QKV_RANKS:
        a = torch.randn(sum(ranks), IN_FEATURES, generator=gen) / IN_FEATURES**0.5
        bts = [torch.randn(r, out, generator=gen) / max(r, 1) ** 0.5 for r, out in zip(ranks, QKV_OUT, strict=True)]
        mats.append([a, *bts])
    pool = make_pool(mats, dtype=dtype, gen=gen, contiguous=contiguous)
    layout = layout or [(3, 0), (1, -1), (4, 1), (2, 2), (1, 3), (0, 1), (5, 3)]
    num_tokens = sum(length for length, _ in layout)
    max_rank = max(sum(r) for r in QKV_RANKS)
    case = Case(
        x=torch.randn(num_tokens, IN_FEATURES, generator=gen).to(dtype),
        h=torch.empty(0),
        y_wide=torch.randn(num_tokens, sum(QKV_OUT), generator=gen).to(dtype),  # the fused qkv output
        pool=pool,
        ranks=[sum(r) for r in QKV_RANKS],
        layout=layout,
        max_rank=max_rank,
        device=device,
    )
    case.x, case.y_wide = case.x.to(device), case.y_wide.to(device)
    pool.weights, pool.page_table = pool.weights.to(device), pool.page_table.to(device)
    return case, mats


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_qkv_group(dtype: torch.dtype, path: str) -> None:
    """One shrink over the group's total rank, then one expand per module into its columns of the fused output."""
    if path == "triton":
        require_triton()
    shrink = sgmv.sgmv_shrink_triton if path == "triton" else sgmv.sgmv_shrink_torch
    expand = sgmv.sgmv_expand_triton if path == "triton" else sgmv.sgmv_expand_torch
    case, _ = make_group_case(dtype, DEVICE)
    m = case.metadata(0)
    h = shrink(
        case.x,
        m["weights"],
        m["page_table"],
        m["offsets"],
        m["ranks"],
        m["seg_starts"],
        m["seg_slots"],
        page_elems=PAGE_ELEMS,
        max_rank=case.max_rank,
    )
    expected = group_reference(case)
    col = 0
    for module, out_features in enumerate(QKV_OUT):
        ranks = [r[module] for r in QKV_RANKS]
        h_cols = [sum(r[:module]) for r in QKV_RANKS]  # the group's A rows stored before this module's
        b_offsets = case.tensor([offs[1 + module] for offs in case.pool.offsets], torch.int64)
        expand(
            h,
            m["weights"],
            m["page_table"],
            b_offsets,
            case.tensor(ranks, torch.int32),
            m["seg_starts"],
            m["seg_slots"],
            case.y_wide[:, col : col + out_features],
            page_elems=PAGE_ELEMS,
            h_col_offsets=case.tensor(h_cols, torch.int32),
        )
        col += out_features
    atol, rtol = EXPAND_TOL[dtype]
    torch.testing.assert_close(case.y_wide.cpu().double(), expected, atol=atol, rtol=rtol)


def group_reference(case: Case) -> torch.Tensor:
    """y_wide after every token's q, k and v deltas, each module's A and B^T rebuilt through the page table."""
    expected = case.y_wide.cpu().double()
    x = case.x.cpu().double()
    col = 0
    for module, out_features in enumerate(QKV_OUT):
        ranks = [r[module] for r in QKV_RANKS]
        h_cols = [sum(r[:module]) for r in QKV_RANKS]
        for t, slot in enumerate(token_slots(case.layout)):
            if slot == -1 or ranks[slot] == 0:
                continue
            a = rebuild(
                case.pool, slot, case.pool.offsets[slot][0] + h_cols[slot] * IN_FEATURES, ranks[slot], IN_FEATURES
            )
            bt = rebuild(case.pool, slot, case.pool.offsets[slot][1 + module], ranks[slot], out_features)
            expected[t, col : col + out_features] += (a @ x[t]) @ bt
        col += out_features
    return expected


def native_group_args(case: Case) -> tuple[torch.Tensor, ...]:
    """lora_add's tables for make_group_case's slots (kernels/csrc/cpu_ops.cpp states them)."""
    segments, start = [], 0
    for length, slot in case.layout:
        if slot >= 0:
            segments.append((start, start + length, slot))
        start += length
    bases = [-1 if b is None else b for b in case.pool.slot_bases]
    outputs, col = [], 0
    for out_features in QKV_OUT:
        outputs.append((col, col + out_features))
        col += out_features
    modules = [
        [(offs[1 + m], r[m], sum(r[:m])) for offs, r in zip(case.pool.offsets, QKV_RANKS, strict=True)]
        for m in range(len(QKV_OUT))
    ]
    return (
        torch.tensor(segments, dtype=torch.int64).view(-1, 3),
        torch.tensor(bases, dtype=torch.int64),
        torch.tensor([offs[0] for offs in case.pool.offsets], dtype=torch.int64),
        torch.tensor([sum(r) for r in QKV_RANKS], dtype=torch.int64),
        torch.tensor(outputs, dtype=torch.int64),
        torch.tensor(modules, dtype=torch.int64),
    )


class TestNativeLoraAdd:
    """The native operator (kernels/csrc/cpu_ops.cpp, lora_add): a whole fused projection's segments in one call,
    against the same reference as the torch paths."""

    @pytest.fixture(autouse=True)
    def _built(self) -> None:
        if not native.load():
            pytest.fail("the native CPU operators are not built: `make` builds them", pytrace=False)

    @pytest.mark.parametrize(
        "layout",
        [
            [(3, 0), (1, -1), (4, 1), (2, 2), (1, 3), (0, 1), (5, 3)],
            [(1, 0), (1, 1), (1, 3), (1, -1), (1, 0)],  # decode: one token per segment, a slot twice
            [(40, 3), (64, 0), (2, -1), (17, 1)],  # long segments: past the inline threshold, split over threads
        ],
        ids=["mixed", "decode", "long"],
    )
    def test_matches_the_reference(self, layout: list[tuple[int, int]]) -> None:
        case, _ = make_group_case(torch.float32, "cpu", contiguous=True, layout=layout)
        expected = group_reference(case)
        torch.ops.loraplex_cpu.lora_add(case.x, case.y_wide, case.pool.weights, *native_group_args(case))
        torch.testing.assert_close(case.y_wide.double(), expected, atol=1e-4, rtol=0)

    def test_rejects_a_slot_whose_pages_are_not_one_run(self) -> None:
        case, _ = make_group_case(torch.float32, "cpu", contiguous=True)
        segments, bases, *rest = native_group_args(case)
        bases[1] = -1
        before = case.y_wide.clone()
        with pytest.raises(RuntimeError, match="not a contiguous slot"):
            torch.ops.loraplex_cpu.lora_add(case.x, case.y_wide, case.pool.weights, segments, bases, *rest)
        assert torch.equal(case.y_wide, before)  # checked before anything is written

    def test_rejects_a_matrix_past_the_pool(self) -> None:
        case, _ = make_group_case(torch.float32, "cpu", contiguous=True)
        segments, bases, a_offsets, *rest = native_group_args(case)
        a_offsets[3] = case.pool.weights.numel()
        with pytest.raises(RuntimeError, match="past the pool"):
            torch.ops.loraplex_cpu.lora_add(case.x, case.y_wide, case.pool.weights, segments, bases, a_offsets, *rest)


def _bad_shrink_inputs() -> list[tuple[str, dict[str, Any], str]]:
    case = make_case([8, 16], [(2, 0), (3, 1)])
    m = case.metadata(0)
    x, w, pt, offs = case.x, m["weights"], m["page_table"], m["offsets"]
    return [
        ("x rank", {"x": x[0]}, "x must be"),
        ("x dtype", {"x": x.half()}, "share a dtype"),
        ("weights dtype", {"x": x.double(), "weights": w.double()}, "weights dtype"),
        ("weights 2-D", {"weights": w.view(-1, PAGE_ELEMS)}, "flat, contiguous"),
        ("weights pages", {"weights": w[:-1]}, "not a multiple of page_elems"),
        ("page_elems", {"page_elems": 0}, "page_elems must be positive"),
        ("page_table rank", {"page_table": pt[0]}, "page_table must be"),
        ("page_table dtype", {"page_table": pt.long()}, "page_table must be int32"),
        ("a_offsets length", {"a_offsets": offs[:1]}, "a_offsets must be"),
        ("a_offsets dtype", {"a_offsets": offs.int()}, "a_offsets must be int64"),
        ("ranks length", {"ranks": m["ranks"][:1]}, "ranks must be"),
        ("ranks dtype", {"ranks": m["ranks"].long()}, "ranks must be int32"),
        ("seg_starts empty", {"seg_starts": m["seg_starts"][:0]}, "seg_starts must be"),
        ("seg_slots length", {"seg_slots": m["seg_slots"][:1]}, "seg_slots must be"),
        ("seg_slots dtype", {"seg_slots": m["seg_slots"].long()}, "seg_slots must be int32"),
        ("max_rank", {"max_rank": -1}, "max_rank must be"),
        ("out shape", {"out": torch.empty(x.shape[0], 8)}, "out must be"),
        ("out dtype", {"out": torch.empty(x.shape[0], 16, dtype=torch.float16)}, "out must be"),
    ]


def _bad_expand_inputs() -> list[tuple[str, dict[str, Any], str]]:
    case = make_case([8, 16], [(2, 0), (3, 1)])
    m = case.metadata(1)
    return [
        ("h rank", {"h": case.h[0]}, "h must be"),
        ("h dtype", {"h": case.h.double()}, "h dtype"),
        ("y rows", {"y": case.y[:-1]}, "y must be"),
        ("y dtype", {"y": case.y.half()}, "share a dtype"),
        ("b_offsets length", {"b_offsets": m["offsets"][1:]}, "b_offsets must be"),
        ("h_col_offsets dtype", {"h_col_offsets": torch.zeros(2, dtype=torch.int64)}, "h_col_offsets must be"),
        ("seg_starts dtype", {"seg_starts": m["seg_starts"].long()}, "seg_starts must be int32"),
    ]


def _call_shrink(fn: Callable[..., torch.Tensor], change: dict[str, Any]) -> None:
    case = make_case([8, 16], [(2, 0), (3, 1)])
    m = case.metadata(0)
    inputs = {
        "x": case.x,
        "weights": m["weights"],
        "page_table": m["page_table"],
        "a_offsets": m["offsets"],
        "ranks": m["ranks"],
        "seg_starts": m["seg_starts"],
        "seg_slots": m["seg_slots"],
        "page_elems": PAGE_ELEMS,
        "max_rank": 16,
    }
    fn(**(inputs | change))


def _call_expand(fn: Callable[..., torch.Tensor], change: dict[str, Any]) -> None:
    case = make_case([8, 16], [(2, 0), (3, 1)])
    m = case.metadata(1)
    inputs = {
        "h": case.h,
        "weights": m["weights"],
        "page_table": m["page_table"],
        "b_offsets": m["offsets"],
        "ranks": m["ranks"],
        "seg_starts": m["seg_starts"],
        "seg_slots": m["seg_slots"],
        "y": case.y,
        "page_elems": PAGE_ELEMS,
    }
    fn(**(inputs | change))


BOTH = pytest.mark.parametrize("path", ["triton", "torch"])


@BOTH
@pytest.mark.parametrize(
    ("case", "change", "message"), _bad_shrink_inputs(), ids=[c for c, _, _ in _bad_shrink_inputs()]
)
def test_shrink_rejects_bad_inputs(path: str, case: str, change: dict[str, Any], message: str) -> None:
    fn = sgmv.sgmv_shrink_triton if path == "triton" else sgmv.sgmv_shrink_torch
    with pytest.raises(ValueError, match=message):
        _call_shrink(fn, change)


@BOTH
@pytest.mark.parametrize(
    ("case", "change", "message"), _bad_expand_inputs(), ids=[c for c, _, _ in _bad_expand_inputs()]
)
def test_expand_rejects_bad_inputs(path: str, case: str, change: dict[str, Any], message: str) -> None:
    fn = sgmv.sgmv_expand_triton if path == "triton" else sgmv.sgmv_expand_torch
    with pytest.raises(ValueError, match=message):
        _call_expand(fn, change)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_rank": 8}, "rank 16 > max_rank=8"),
        ({"segments": [(0, 2, 0), (3, 5, 1)]}, "must tile"),
        ({"segments": [(0, 2, 0), (2, 4, 1)]}, "must tile"),
        ({"segments": [(0, 5, 0)]}, "segments has 1 entries"),
        ({"seg_slots": torch.tensor([0, 2], dtype=torch.int32)}, "neither -1 nor one of the 2 slots"),
        ({"seg_slots": torch.tensor([-2, 1], dtype=torch.int32)}, "neither -1 nor one of the 2 slots"),
        ({"slot_bases": [None]}, "slot_bases has 1 entries"),
        ({"a_offsets": torch.tensor([0, 10_000], dtype=torch.int64)}, "need .* pages, page_table has"),
        ({"slot_bases": [0, 10**9]}, "run past the pool"),
    ],
    ids=[
        "rank-above-max",
        "gap",
        "short",
        "count",
        "slot-too-large",
        "slot-below-minus-one",
        "slot-bases",
        "past-page-table",
        "past-pool",
    ],
)
def test_torch_shrink_rejects_bad_values(change: dict[str, Any], message: str) -> None:
    # Values only the torch path reads (the Triton launcher never reads device tensors).
    with pytest.raises(ValueError, match=message):
        _call_shrink(sgmv.sgmv_shrink_torch, change)


def test_torch_expand_rejects_columns_past_h() -> None:
    case = make_case([8, 16], [(2, 0), (3, 1)])
    with pytest.raises(ValueError, match=r"columns .* of h"):
        _call_expand(sgmv.sgmv_expand_torch, {"h": case.h[:, :12]})
    with pytest.raises(ValueError, match=r"columns .* of h"):
        _call_expand(sgmv.sgmv_expand_torch, {"h_col_offsets": torch.tensor([0, 8], dtype=torch.int32)})


def test_triton_needs_pages_of_16_elements() -> None:
    require_triton()
    case = make_case([8], [(2, 0)], page_elems=8)
    with pytest.raises(ValueError, match="page_elems >= 16"):
        case.shrink(sgmv.sgmv_shrink_triton)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_cuda_kernels_match_torch_path(dtype: torch.dtype) -> None:
    layout = [*layouts(8)["many-short"], (300, 2), (1, -1), (70, 5)]
    # Exact products accumulated in float32 in another order (and tf32 for half-precision expands): near-exact.
    shrink_atol = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}[dtype]
    for page_elems in (PAGE_ELEMS, 4096):
        case = make_case(MIXED_RANKS, layout, dtype=dtype, page_elems=page_elems, max_rank=131, device="cuda")
        expected = case.shrink(sgmv.sgmv_shrink_torch)
        torch.testing.assert_close(case.shrink(sgmv.sgmv_shrink), expected, atol=shrink_atol, rtol=1e-3)
        y_before = case.y_wide.clone()
        expected_y = case.expand(sgmv.sgmv_expand_torch).clone()
        case.y_wide.copy_(y_before)
        atol, rtol = EXPAND_TOL[dtype]
        torch.testing.assert_close(case.expand(sgmv.sgmv_expand), expected_y, atol=atol, rtol=rtol)


def test_torch_expand_writes_nothing_on_bad_input() -> None:
    case = make_case([8, 16], [(2, 0), (3, 1)])  # slot 0's segment comes first and is fine
    before = case.y_wide.clone()
    with pytest.raises(ValueError, match=r"columns .* of h"):
        case.expand(sgmv.sgmv_expand_torch, h_col_offsets=torch.tensor([0, 8], dtype=torch.int32))
    assert torch.equal(case.y_wide, before)
