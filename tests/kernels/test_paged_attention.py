"""Paged attention: the torch path and the Triton kernel against a naive loop over sequences and queries.

Without CUDA the Triton kernel runs in Triton's interpreter, which Triton picks when a function is decorated,
its own library's included: TRITON_INTERPRET must be set before anything in the session imports Triton.
Every cache slot that no sequence owns (tails of last blocks, unused blocks) holds NaN, so a path that reads
past a sequence's length, or lets a masked NaN into a sum, fails every comparison.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex.kernels import native  # noqa: E402  (after TRITON_INTERPRET, see above)
from loraplex.kernels import paged_attention as pa  # noqa: E402

pytestmark = pytest.mark.unit

ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# (q_len, seq_len) per sequence. Lengths straddle block boundaries for block sizes 16 and 32.
DECODE = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 33), (1, 64), (1, 65)]
FRESH = [(5, 5), (16, 16), (17, 17), (33, 33)]
CHUNKED = [(3, 40), (16, 49), (31, 32), (2, 17)]
MIXED = [(1, 17), (5, 5), (3, 40), (1, 33), (17, 17), (1, 1), (16, 49), (1, 16)]


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int
    sliding_window: int | None = None
    softcap: float | None = None

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)

    def kwargs(self) -> dict[str, Any]:
        sizes = {"scale": self.scale, "max_query_len": self.max_query_len, "max_seq_len": self.max_seq_len}
        variants = {"sliding_window": self.sliding_window, "softcap": self.softcap}
        return sizes | {name: value for name, value in variants.items() if value is not None}


def make_batch(
    layout: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    strided: bool = False,
    device: str = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Batch:
    """Sequences with their blocks at shuffled pool positions, spare blocks, NaN in every unowned slot.

    strided: K and V are views into one page-major pool and q is a slice of a wider tensor.
    sliding_window: as the engine's KV groups leave a sliding layer's table, every block wholly before the window of a
    sequence's first query is NO_PAGE (-1), and its page is back in the pool: NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in layout]
    num_blocks = sum(blocks_per_seq) + 3
    pool_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(layout), max(blocks_per_seq) + 2, dtype=torch.int32)  # 0-padded past the end
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    taken = 0
    for i, (_, seq_len) in enumerate(layout):
        ids = pool_ids[taken : taken + blocks_per_seq[i]]
        taken += blocks_per_seq[i]
        block_tables[i, : ids.numel()] = ids.to(torch.int32)
        released = 0
        if sliding_window is not None:
            q_len = layout[i][0]
            released = max(0, seq_len - q_len - sliding_window + 1) // block_size
            block_tables[i, :released] = -1
        for t in range(released * block_size, seq_len):
            owned[ids[t // block_size], t % block_size] = True
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if strided:
        # One page-major pool holding K and V side by side: the caches are non-contiguous views of it.
        pool = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    unowned = ~owned[:, None, :, None].expand(shape)
    k_cache[unowned] = float("nan")
    v_cache[unowned] = float("nan")
    q_lens = [q_len for q_len, _ in layout]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    if strided:
        # q as the query slice of a fused qkv projection: rows are not contiguous either.
        qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        q = qkv[:, :num_heads]
    else:
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    batch = Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([seq_len for _, seq_len in layout], dtype=torch.int32),
        query_start_loc=query_start_loc,
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_len for _, seq_len in layout),
        sliding_window=sliding_window,
        softcap=softcap,
    )
    tensors = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"]
    return dataclasses.replace(batch, **{name: getattr(batch, name).to(device) for name in tensors})


def reference(batch: Batch) -> torch.Tensor:
    """The docstring's loop, in float64: per sequence, keys gathered position by position, then per query."""
    q, k_cache, v_cache = (t.cpu().double() for t in (batch.q, batch.k_cache, batch.v_cache))
    block_tables, seq_lens, starts = (
        t.cpu().tolist() for t in (batch.block_tables, batch.seq_lens, batch.query_start_loc)
    )
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    kv_head_of = [h // (num_heads // num_kv_heads) for h in range(num_heads)]
    out = torch.full_like(q, float("nan"))
    window = batch.sliding_window
    for i, seq_len in enumerate(seq_lens):
        q_len = starts[i + 1] - starts[i]
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        page = [block_tables[i][t // block_size] if t >= first else 0 for t in range(seq_len)]  # 0: never read
        keys = torch.stack([k_cache[page[t], :, t % block_size] for t in range(seq_len)])
        values = torch.stack([v_cache[page[t], :, t % block_size] for t in range(seq_len)])
        keys, values = keys[:, kv_head_of], values[:, kv_head_of]  # [seq_len, num_heads, head_dim]
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,thd->ht", q[starts[i] + j], keys[lo : pos + 1]) * batch.scale
            if batch.softcap is not None:
                scores = batch.softcap * torch.tanh(scores / batch.softcap)
            out[starts[i] + j] = torch.einsum("ht,thd->hd", scores.softmax(-1), values[lo : pos + 1])
    return out


def assert_matches(actual: torch.Tensor, batch: Batch) -> None:
    assert actual.dtype == batch.q.dtype
    assert actual.shape == batch.q.shape
    torch.testing.assert_close(actual.cpu().double(), reference(batch), atol=ATOL[batch.q.dtype], rtol=0)


def require_triton() -> None:
    if not pa.HAS_TRITON:
        pytest.fail("Triton is not installed: `pip install -e '.[kernels]'`", pytrace=False)
    if DEVICE == "cpu" and type(pa._paged_attention_kernel).__name__ != "InterpretedFunction":
        pytest.fail(
            "Triton was imported before TRITON_INTERPRET=1 was set (engine modules import the kernels), so it "
            "cannot run on CPU: set the variable at the top of tests/conftest.py when CUDA is unavailable",
            pytrace=False,
        )


SWEEP = pytest.mark.parametrize(
    ("dtype", "group", "block_size"),
    [(d, g, b) for d in (torch.float32, torch.float16, torch.bfloat16) for g in (1, 2, 4) for b in (16, 32)],
    ids=lambda v: str(v).removeprefix("torch."),
)


class TestTorchPath:
    @SWEEP
    def test_mixed_batch_sweep(self, dtype: torch.dtype, group: int, block_size: int) -> None:
        batch = make_batch(MIXED, num_heads=2 * group, block_size=block_size, dtype=dtype)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs()), batch)

    @pytest.mark.parametrize(
        "layout",
        [
            DECODE,
            FRESH,
            CHUNKED,
            DECODE + FRESH + CHUNKED,
            [(1, 40)],
            [(333, 333)],
            [(333, 333), (8, 8), (300, 301), (1, 350), (64, 400), (20, 20)],
        ],
        ids=["decode", "fresh", "chunked", "all", "one-decode", "long-prompt", "long-mixed"],
    )
    def test_layouts(self, layout: list[tuple[int, int]]) -> None:
        batch = make_batch(layout, num_heads=8, num_kv_heads=2, head_dim=64)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs()), batch)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_strided_inputs(self, dtype: torch.dtype) -> None:
        batch = make_batch(MIXED, strided=True, dtype=dtype)
        assert not batch.k_cache.is_contiguous()
        assert not batch.q.is_contiguous()
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs()), batch)

    def test_upper_bounds_for_max_lengths(self) -> None:
        batch = make_batch(MIXED)
        kwargs = batch.kwargs() | {"max_query_len": batch.max_query_len + 7, "max_seq_len": batch.max_seq_len + 40}
        assert_matches(pa.paged_attention_torch(*batch.args(), **kwargs), batch)

    def test_writes_into_out(self) -> None:
        batch = make_batch(MIXED)
        out = torch.empty_like(batch.q)
        result = pa.paged_attention_torch(*batch.args(), **batch.kwargs(), out=out)
        assert result is out
        assert_matches(out, batch)

    def test_dispatch_uses_torch_path_for_cpu_tensors(self) -> None:
        batch = make_batch(MIXED)
        expected = pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=native.load())
        torch.testing.assert_close(pa.paged_attention(*batch.args(), **batch.kwargs()), expected, atol=0, rtol=0)

    def test_empty_batch(self) -> None:
        batch = make_batch(MIXED)
        empty = Batch(
            q=batch.q[:0],
            k_cache=batch.k_cache,
            v_cache=batch.v_cache,
            block_tables=batch.block_tables[:0],
            seq_lens=batch.seq_lens[:0],
            query_start_loc=batch.query_start_loc[:1],
            scale=batch.scale,
            max_query_len=0,
            max_seq_len=0,
        )
        assert pa.paged_attention_torch(*empty.args(), **empty.kwargs()).shape == (0, *batch.q.shape[1:])


def require_native() -> None:
    if not native.load():
        pytest.fail(
            "the native CPU operators are not built: `make` builds them (python -m loraplex.kernels.native)",
            pytrace=False,
        )


class TestNativeDecode:
    """Decode rows through the native operator (kernels/csrc/cpu_ops.cpp); prefill rows stay in torch."""

    @pytest.mark.parametrize(("group", "block_size"), [(g, b) for g in (1, 2, 4) for b in (16, 32)])
    def test_mixed_batch_sweep(self, group: int, block_size: int) -> None:
        require_native()
        batch = make_batch(MIXED, num_heads=2 * group, block_size=block_size)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True), batch)

    # 64 and 128 take the vector path in 64-column runs, 40 in runs of 8, 36 (not a multiple of 8) the scalar loops.
    @pytest.mark.parametrize("head_dim", [36, 40, 64, 128])
    def test_head_dims(self, head_dim: int) -> None:
        require_native()
        batch = make_batch([*DECODE, (1, 200), (1, 9)], num_heads=8, num_kv_heads=2, head_dim=head_dim)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True), batch)

    def test_strided_pool_and_query(self) -> None:
        require_native()
        batch = make_batch(DECODE, strided=True)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True), batch)

    def test_many_sequences_split_over_threads(self) -> None:
        require_native()  # past the operator's inline threshold: runs of sequences go to torch's threads
        layout = [(1, 1 + (37 * i) % 300) for i in range(48)]
        batch = make_batch(layout, num_heads=8, num_kv_heads=4, head_dim=64)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True), batch)

    def test_dispatch_takes_the_native_operator(self) -> None:
        require_native()
        batch = make_batch(DECODE, num_heads=8, num_kv_heads=2, head_dim=64)
        expected = pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True)
        torch.testing.assert_close(pa.paged_attention(*batch.args(), **batch.kwargs()), expected, atol=0, rtol=0)

    def test_rejects_a_page_outside_the_pool(self) -> None:
        require_native()
        batch = make_batch(DECODE)
        batch.block_tables[2, 0] = batch.k_cache.shape[0] + 5
        with pytest.raises(RuntimeError, match="page id"):
            pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True)


class TestTritonKernel:
    @SWEEP
    def test_mixed_batch_sweep(self, dtype: torch.dtype, group: int, block_size: int) -> None:
        require_triton()
        batch = make_batch(MIXED, num_heads=2 * group, block_size=block_size, dtype=dtype, device=DEVICE)
        assert_matches(pa.paged_attention_triton(*batch.args(), **batch.kwargs()), batch)

    @pytest.mark.parametrize(
        "layout",
        [DECODE, FRESH + CHUNKED, [(333, 333), (1, 350), (64, 400)]],
        ids=["decode", "prefill", "long-mixed"],
    )
    def test_layouts(self, layout: list[tuple[int, int]]) -> None:
        require_triton()
        batch = make_batch(layout, num_heads=4, num_kv_heads=1, device=DEVICE)
        assert_matches(pa.paged_attention_triton(*batch.args(), **batch.kwargs()), batch)

    def test_group_of_three_heads(self) -> None:
        require_triton()  # 3 is padded to 4 rows per query: the padding head must not be stored
        batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=40, device=DEVICE)
        assert_matches(pa.paged_attention_triton(*batch.args(), **batch.kwargs()), batch)

    def test_strided_inputs(self) -> None:
        require_triton()
        batch = make_batch(MIXED, strided=True, dtype=torch.float16, device=DEVICE)
        assert not batch.k_cache.is_contiguous()
        assert not batch.q.is_contiguous()
        assert_matches(pa.paged_attention_triton(*batch.args(), **batch.kwargs()), batch)


# (sliding_window, softcap): Mistral's window alone, Gemma 2's window and cap, a cap alone (Gemma 2's global layers),
# a window of one block and one of a single key.
VARIANTS = pytest.mark.parametrize(
    ("window", "softcap"),
    [(24, None), (16, 50.0), (None, 20.0), (40, 2.0), (1, None)],
    ids=["window", "window-softcap", "softcap", "wide-window-tight-cap", "window-of-one"],
)
VARIANT_LAYOUTS = [
    *MIXED,
    (1, 100),
    (9, 70),
    (40, 90),
    (64, 64),
]


class TestSlidingWindowAndSoftcap:
    """Gemma 2/3 and Mistral layers: each query sees its last `window` keys, scores soft-capped; blocks wholly
    behind the window of a sequence's first query are NO_PAGE in the table and NaN in the pool."""

    @VARIANTS
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
    def test_torch_path(self, window: int | None, softcap: float | None, dtype: torch.dtype) -> None:
        batch = make_batch(VARIANT_LAYOUTS, num_heads=8, sliding_window=window, softcap=softcap, dtype=dtype)
        if window is not None and window < 40:
            assert (batch.block_tables == -1).any()  # the layouts do release pages
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs()), batch)

    @VARIANTS
    def test_native_decode(self, window: int | None, softcap: float | None) -> None:
        require_native()
        layout = [*DECODE, (1, 200), (1, 9), (1, 100)]
        batch = make_batch(layout, num_heads=8, head_dim=64, sliding_window=window, softcap=softcap)
        assert_matches(pa.paged_attention_torch(*batch.args(), **batch.kwargs(), native=True), batch)

    @VARIANTS
    def test_triton_kernel(self, window: int | None, softcap: float | None) -> None:
        require_triton()
        batch = make_batch(VARIANT_LAYOUTS, num_heads=4, sliding_window=window, softcap=softcap, device=DEVICE)
        assert_matches(pa.paged_attention_triton(*batch.args(), **batch.kwargs()), batch)

    def test_a_window_wider_than_the_context_is_full_attention(self) -> None:
        windowed = make_batch(MIXED, sliding_window=10_000)
        plain = dataclasses.replace(windowed, sliding_window=None)
        torch.testing.assert_close(
            pa.paged_attention_torch(*windowed.args(), **windowed.kwargs()),
            pa.paged_attention_torch(*plain.args(), **plain.kwargs()),
            atol=0,
            rtol=0,
        )

    @pytest.mark.parametrize(
        ("change", "message"), [({"sliding_window": 0}, "sliding_window"), ({"softcap": 0.0}, "softcap")]
    )
    def test_rejects_a_bad_variant(self, change: dict[str, Any], message: str) -> None:
        batch = make_batch(MIXED)
        with pytest.raises(ValueError, match=message):
            pa.paged_attention_torch(*batch.args(), **batch.kwargs(), **change)


def _bad_inputs() -> list[tuple[str, dict[str, Any], str]]:
    batch = make_batch(MIXED)
    q, k, v, bt, sl, qsl = batch.args()
    return [
        ("q rank", {"q": q[0]}, "q must be"),
        ("heads", {"q": torch.randn(q.shape[0], 3, q.shape[2])}, "multiple of num_kv_heads"),
        ("head_dim", {"q": torch.randn(q.shape[0], q.shape[1], 16)}, "head_dim"),
        ("v shape", {"v_cache": v[:, :1]}, "v_cache shape"),
        ("cache dtype", {"k_cache": k.half(), "v_cache": v.half()}, "share a dtype"),
        ("q dtype", {"q": q.double(), "k_cache": k.double(), "v_cache": v.double()}, "dtype must be"),
        ("block_tables dtype", {"block_tables": bt.long()}, "block_tables must be int32"),
        ("seq_lens length", {"seq_lens": sl[:-1]}, "seq_lens must be"),
        ("query_start_loc length", {"query_start_loc": qsl[:-1]}, "query_start_loc must be"),
        ("out shape", {"out": torch.empty(q.shape[0] + 1, *q.shape[1:])}, "out must match"),
        ("out dtype", {"out": torch.empty_like(q, dtype=torch.float16)}, "out must match"),
        ("max_query_len", {"max_query_len": 0}, "max_query_len"),
    ]


@pytest.mark.parametrize(("case", "change", "message"), _bad_inputs(), ids=[case for case, _, _ in _bad_inputs()])
@pytest.mark.parametrize("fn", [pa.paged_attention_triton, pa.paged_attention_torch], ids=["triton", "torch"])
def test_rejects_bad_inputs(fn: Any, case: str, change: dict[str, Any], message: str) -> None:
    batch = make_batch(MIXED)
    names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"]
    inputs = dict(zip(names, batch.args(), strict=True)) | batch.kwargs() | change
    with pytest.raises(ValueError, match=message):
        fn(**inputs)


@pytest.mark.gpu
@pytest.mark.parametrize(("window", "softcap"), [(24, None), (16, 50.0), (None, 20.0)], ids=["window", "both", "cap"])
def test_cuda_kernel_windows_and_caps_match_torch_path(window: int | None, softcap: float | None) -> None:
    batch = make_batch(VARIANT_LAYOUTS, num_heads=8, sliding_window=window, softcap=softcap, device="cuda")
    expected = pa.paged_attention_torch(*batch.args(), **batch.kwargs())
    actual = pa.paged_attention(*batch.args(), **batch.kwargs())
    torch.testing.assert_close(actual, expected, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernel_matches_torch_path(dtype: torch.dtype) -> None:
    batch = make_batch(DECODE + FRESH + CHUNKED + [(300, 300), (64, 400)], num_heads=8, dtype=dtype, device="cuda")
    expected = pa.paged_attention_torch(*batch.args(), **batch.kwargs())
    actual = pa.paged_attention(*batch.args(), **batch.kwargs())
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=0)
