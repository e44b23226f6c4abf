"""Quantized weights: the quantizers' error bounds and layout, the torch paths and the Triton kernels of the int8
and int4 matmuls against x @ dequantize(w)^T, and the memory they keep.

Without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET must be set before anything in the
session imports Triton; tests/conftest.py does it). Weights are random normal, scaled by in_features ** -0.5 so
outputs are of order 1 and the tolerances below are absolute.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex.kernels import native as native_ops  # noqa: E402
from loraplex.kernels import quant  # noqa: E402  (after TRITON_INTERPRET, see above)
from loraplex.kernels.quant import Int4Weight, Int8Weight  # noqa: E402

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both paths accumulate in float32 against a float32 reference: float32 outputs differ by summation order only.
# Half outputs are rounded once to x's dtype (half an ulp; a whole one where Triton's interpreter truncates to
# bfloat16): outputs here stay below 8.
TOL = {  # (atol, rtol)
    torch.float32: (1e-4, 1e-5),
    torch.float16: (4e-3, 2**-10),
    torch.bfloat16: (4e-2, 2**-7),
}
TOKENS = [1, 7, 64, 65]  # int4's torch path: split tiles up to 64 tokens, interleaved tiles past

Linear = Callable[[torch.Tensor, "Int8Weight | Int4Weight", "torch.Tensor | None"], torch.Tensor]


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) / in_features**0.5


def _inputs(num_tokens: int, in_features: int, out_features: int, dtype: torch.dtype, with_bias: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype=dtype, device=DEVICE)
    bias = torch.randn(out_features, generator=gen).to(dtype=dtype, device=DEVICE) if with_bias else None
    return x, bias


def _reference(x: torch.Tensor, dequantized: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dequantized.double().t()
    return y if bias is None else y + bias.double()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double().cpu(), expected.cpu(), atol=atol, rtol=rtol)


class TestQuantizeInt8:
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_round_trip_within_half_a_step(self, dtype: torch.dtype) -> None:
        w = _weight(64, 200).to(dtype)
        q = quant.quantize_int8(w)
        assert q.qweight.dtype == torch.int8 and q.qweight.shape == (64, 200) and q.scales.shape == (64,)
        err = (quant.dequantize_int8(q, torch.float32) - w.float()).abs()
        # Ties (bfloat16 weights hit w / scale = k + 0.5 exactly) land on half a step, plus float32 rounding.
        assert torch.all(err <= q.scales[:, None] / 2 + 1e-6 * w.float().abs())
        assert torch.equal(q.scales, w.float().abs().amax(dim=1) / 127)

    def test_zero_row_stays_zero(self) -> None:
        w = _weight(4, 128)
        w[2] = 0
        assert torch.all(quant.dequantize_int8(quant.quantize_int8(w), torch.float32)[2] == 0)


class TestQuantizeInt4:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("group_size", [32, 128])
    def test_round_trip_within_half_a_step(self, dtype: torch.dtype, group_size: int) -> None:
        w = _weight(48, 256).to(dtype)
        w[0, :group_size] = w[0, :group_size].abs() + 1  # a group of one sign keeps its range too
        w[1, :group_size] = 0.25  # a constant group is exact
        q = quant.quantize_int4(w, group_size)
        groups = 256 // group_size
        assert q.packed.dtype == torch.uint8 and q.packed.shape == (48, 128)
        assert q.scales.shape == q.zeros.shape == (48, groups) and q.group_size == group_size
        err = (quant.dequantize_int4(q, torch.float32) - w.float()).abs().view(48, groups, group_size)
        slack = 1e-6 * w.float().abs().view(48, groups, group_size)  # float32 rounding, as for int8
        assert torch.all(err <= q.scales[..., None] / 2 + slack)
        assert torch.all(err[1, 0] == 0)

    def test_packing_puts_even_columns_in_the_low_nibble(self) -> None:
        # One group of 4, min -3 and max 4.5: scale 0.5, zero 6, so codes are 2 * w + 6.
        w = torch.tensor([[-3.0, 4.5, -1.0, 0.5]])
        q = quant.quantize_int4(w, group_size=4)
        assert q.scales.tolist() == [[0.5]] and q.zeros.tolist() == [[6.0]]
        codes = [0, 15, 4, 7]
        assert q.packed.tolist() == [[codes[0] | codes[1] << 4, codes[2] | codes[3] << 4]]
        assert quant.unpack_int4(q.packed).tolist() == [codes]
        assert quant.dequantize_int4(q, torch.float32).tolist() == w.tolist()

    @pytest.mark.parametrize("in_features", [200, 64])
    def test_refuses_in_features_not_a_multiple_of_the_group(self, in_features: int) -> None:
        with pytest.raises(ValueError, match="multiple of group_size"):
            quant.quantize_int4(_weight(8, in_features), group_size=128)

    def test_refuses_odd_group_size(self) -> None:
        with pytest.raises(ValueError, match="even"):
            quant.quantize_int4(_weight(8, 96), group_size=3)


class TestMemory:
    def test_quantized_bytes_against_bf16(self) -> None:
        w = _weight(1024, 512)
        bf16_bytes = w.numel() * 2
        int8 = quant.quantize_int8(w).nbytes() / bf16_bytes
        int4 = quant.quantize_int4(w).nbytes() / bf16_bytes
        assert 0.5 <= int8 <= 0.51
        assert 0.25 <= int4 <= 0.30


def _int8_paths() -> list[tuple[str, Linear]]:
    weight_only = functools.partial(quant.int8_linear, dynamic=False)
    return [("torch", quant.int8_linear_torch), ("triton", quant.int8_linear_triton), ("dispatch", weight_only)]


def _int4_paths() -> list[tuple[str, Linear]]:
    weight_only = functools.partial(quant.int4_linear, dynamic=False)
    return [("torch", quant.int4_linear_torch), ("triton", quant.int4_linear_triton), ("dispatch", weight_only)]


class TestInt8Linear:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("num_tokens", TOKENS)
    @pytest.mark.parametrize("with_bias", [False, True])
    @pytest.mark.parametrize("shape", [(96, 256), (72, 200)], ids=["in256", "in200"])
    def test_torch_path_matches_the_reference(
        self, dtype: torch.dtype, num_tokens: int, with_bias: bool, shape: tuple[int, int]
    ) -> None:
        w = quant.quantize_int8(_weight(*shape).to(DEVICE))
        x, bias = _inputs(num_tokens, shape[1], shape[0], dtype, with_bias)
        expected = _reference(x, quant.dequantize_int8(w, torch.float32), bias)
        _assert_close(quant.int8_linear_torch(x, w, bias), expected, dtype)
        _assert_close(quant.int8_linear(x, w, bias, dynamic=False), expected, dtype)

    @pytest.mark.parametrize("num_tokens", [5, 40])
    def test_torch_path_covers_matrices_of_several_tiles(
        self, monkeypatch: pytest.MonkeyPatch, num_tokens: int
    ) -> None:
        from loraplex.kernels import quant_int8

        monkeypatch.setattr(quant_int8, "TILE_ELEMS", 40 * 200)  # at most 40 rows: 4 tiles of 33, 33, 33, 31
        w = quant.quantize_int8(_weight(130, 200).to(DEVICE))
        x, bias = _inputs(num_tokens, 200, 130, torch.float32, True)
        expected = _reference(x, quant.dequantize_int8(w, torch.float32), bias)
        _assert_close(quant.int8_linear_torch(x, w, bias), expected, torch.float32)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("num_tokens", [1, 20])
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_triton_kernel_matches_the_reference(self, dtype: torch.dtype, num_tokens: int, with_bias: bool) -> None:
        w = quant.quantize_int8(_weight(136, 200).to(DEVICE))  # partial output and reduction tiles
        x, bias = _inputs(num_tokens, 200, 136, dtype, with_bias)
        expected = _reference(x, quant.dequantize_int8(w, torch.float32), bias)
        _assert_close(quant.int8_linear_triton(x, w, bias), expected, dtype)

    @pytest.mark.parametrize("name_fn", _int8_paths(), ids=lambda p: p[0])
    def test_rejects_mismatched_inputs(self, name_fn: tuple[str, Linear]) -> None:
        fn = name_fn[1]
        w = quant.quantize_int8(_weight(16, 64).to(DEVICE))
        with pytest.raises(ValueError, match="x must be"):
            fn(torch.randn(2, 65, device=DEVICE), w, None)
        with pytest.raises(ValueError, match="bias must be"):
            fn(torch.randn(2, 64, device=DEVICE), w, torch.zeros(15, device=DEVICE))

    def test_no_tokens(self) -> None:
        w = quant.quantize_int8(_weight(16, 64).to(DEVICE))
        for _, fn in _int8_paths():
            assert fn(torch.empty(0, 64, device=DEVICE), w, None).shape == (0, 16)


@pytest.mark.skipif(DEVICE != "cpu", reason="8-bit activations are a CPU path")
class TestInt8Dynamic:
    """int8_linear_dynamic: x rounded to 8 bits per row, an integer product, both scales after."""

    @staticmethod
    def _expected(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 product of the row-quantized x with the dequantized weight, its bound against x unrounded)."""
        xf = x.float()
        scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        codes = torch.round(xf * (1 / scale))
        assert codes.abs().max() <= 127
        weight = quant.dequantize_int8(w, torch.float32).double()
        y = (codes.double() * scale.double()) @ weight.t()
        if bias is not None:
            y = y + bias.double()
        # Each element of x moves by at most half its row's step: |dy[t, n]| <= scale[t] / 2 * sum_k |W[n, k]|.
        return y, scale.double() / 2 * weight.abs().sum(dim=1)

    @pytest.mark.parametrize("num_tokens", [1, 7, 64, 65])
    @pytest.mark.parametrize("with_bias", [False, True])
    @pytest.mark.parametrize("shape", [(96, 256), (72, 200), (8, 40)], ids=["in256", "in200", "in40"])
    @pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
    def test_matches_the_row_quantized_product(
        self, num_tokens: int, with_bias: bool, shape: tuple[int, int], native: bool
    ) -> None:
        if native and not native_ops.load():
            pytest.skip("the native operators are not built (make native)")
        w = quant.quantize_int8(_weight(*shape))
        x, bias = _inputs(num_tokens, shape[1], shape[0], torch.float32, with_bias)
        x[0, 3] = 4.0  # one large activation: the row's scale follows it
        residual = torch.randn(num_tokens, shape[0], generator=torch.Generator().manual_seed(2))
        before = residual.clone()
        y = quant.int8_linear_dynamic(x, w, bias, residual=residual, native=native)
        expected, bound = self._expected(x, w, bias)
        # float32 rounding of the scaled products only: a code off by one would move an output by ~1e-2.
        torch.testing.assert_close(y.double(), expected + residual.double(), atol=2e-5, rtol=1e-5)
        assert torch.equal(residual, before), "the residual must not be written"
        unrounded = _reference(x, quant.dequantize_int8(w, torch.float32), bias)
        assert ((expected - unrounded).abs() <= bound + 1e-9).all()
        assert (expected - unrounded).abs().max() > 1e-6, "x was not rounded"

    def test_native_equals_the_torch_path_on_half_types_and_zero_rows(self) -> None:
        w = quant.quantize_int8(_weight(48, 96))
        x, bias = _inputs(9, 96, 48, torch.float32, True)
        x[4] = 0.0  # an all-zero row: its scale is the smallest normal float, its codes zeros, its output the bias
        y = quant.int8_linear_dynamic(x, w, bias, native=native_ops.load())
        torch.testing.assert_close(y, quant.int8_linear_dynamic(x, w, bias), atol=2e-5, rtol=1e-5)
        assert torch.equal(y[4], bias)
        half = quant.int8_linear_dynamic(x.bfloat16(), w, bias.bfloat16(), native=True)  # native takes float32 only
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), y, atol=0.1, rtol=2**-6)

    def test_no_tokens_and_bad_residual(self) -> None:
        w = quant.quantize_int8(_weight(16, 64))
        for native in (False, True):
            assert quant.int8_linear_dynamic(torch.empty(0, 64), w, native=native).shape == (0, 16)
        with pytest.raises(ValueError, match="residual must be"):
            quant.int8_linear_dynamic(torch.randn(2, 64), w, residual=torch.zeros(2, 15))
        with pytest.raises(ValueError, match="x must be"):
            quant.int8_linear_dynamic(torch.randn(2, 65), w)

    def test_dispatch_follows_the_setting(self, monkeypatch: pytest.MonkeyPatch) -> None:
        w = quant.quantize_int8(_weight(24, 64))
        x, bias = _inputs(5, 64, 24, torch.float32, True)
        weight_only, dynamic = quant.int8_linear_torch(x, w, bias), quant.int8_linear_dynamic(x, w, bias)
        assert not torch.allclose(weight_only, dynamic, atol=1e-6, rtol=0)
        try:
            for setting, expected in (("0", weight_only), ("1", dynamic)):
                monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", setting)
                quant.int8_activations.cache_clear()
                assert quant.int8_activations() is (setting == "1")
                torch.testing.assert_close(quant.int8_linear(x, w, bias), expected, atol=2e-5, rtol=1e-5)
            residual = torch.randn(5, 24)
            torch.testing.assert_close(
                quant.int8_linear(x, w, bias, residual=residual), dynamic + residual, atol=2e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                quant.int8_linear(x, w, bias, dynamic=False, residual=residual), weight_only + residual
            )
        finally:
            quant.int8_activations.cache_clear()


@pytest.mark.skipif(DEVICE != "cpu", reason="8-bit activations are a CPU path")
class TestInt4Dynamic:
    """int4_linear_dynamic: the int4 rows requantized to int8 for the call, then the int8 path."""

    @pytest.mark.parametrize("group_size", [32, 64, 128])
    def test_requantized_rows_stay_within_half_an_int8_step(self, group_size: int) -> None:
        weight = _weight(72, 256)
        weight[3, :group_size] = weight[3, :group_size].abs() + 0.5  # one sign: a zero point outside 0..15
        w = quant.quantize_int4(weight, group_size)
        assert (w.zeros[3, 0] < 0) or (w.zeros[3, 0] > 15)
        rows = quant.requantize_int4_rows(w)
        int4 = quant.dequantize_int4(w, torch.float32)
        int8 = rows.qweight.float() * rows.scales[:, None]
        assert ((int8 - int4).abs() <= rows.scales[:, None] * (0.5 + 1e-5)).all()
        assert (rows.qweight.abs().amax(dim=1) == 127).all(), "each row's largest value takes the full range"

    @pytest.mark.parametrize("num_tokens", [1, 7, 65])
    @pytest.mark.parametrize("with_bias", [False, True])
    @pytest.mark.parametrize("group_size", [32, 128])
    @pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
    def test_is_the_int8_path_over_the_requantized_rows(
        self, num_tokens: int, with_bias: bool, group_size: int, native: bool
    ) -> None:
        if native and not native_ops.load():
            pytest.skip("the native operators are not built (make native)")
        w = quant.quantize_int4(_weight(136, 256), group_size)
        x, bias = _inputs(num_tokens, 256, 136, torch.float32, with_bias)
        residual = torch.randn(num_tokens, 136, generator=torch.Generator().manual_seed(3))
        y = quant.int4_linear_dynamic(x, w, bias, residual=residual, native=native)
        expected = quant.int8_linear_dynamic(x, quant.requantize_int4_rows(w), bias, residual=residual)
        torch.testing.assert_close(y, expected, atol=2e-5, rtol=1e-5)

    def test_native_requantizes_to_the_same_codes(self) -> None:
        if not native_ops.load():
            pytest.skip("the native operators are not built (make native)")
        for group_size in (32, 64, 128):
            w = quant.quantize_int4(_weight(200, 384, seed=group_size), group_size)
            rows = quant.requantize_int4_rows(w)
            # Identity rows quantize exactly (code 127, scale 1 / 127), so the product is each code times its scale.
            product = quant.int4_linear_dynamic(torch.eye(384), w, native=True).t()
            torch.testing.assert_close(product, rows.qweight.float() * rows.scales[:, None], atol=0, rtol=1e-6)

    def test_dispatch_and_no_tokens(self, monkeypatch: pytest.MonkeyPatch) -> None:
        w = quant.quantize_int4(_weight(24, 64), 32)
        x, _ = _inputs(5, 64, 24, torch.float32, False)
        for native in (False, True):
            assert quant.int4_linear_dynamic(torch.empty(0, 64), w, native=native).shape == (0, 24)
        try:
            monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", "1")
            quant.int8_activations.cache_clear()
            torch.testing.assert_close(quant.int4_linear(x, w), quant.int4_linear_dynamic(x, w), atol=2e-5, rtol=1e-5)
            monkeypatch.setenv("LORAPLEX_INT8_ACTIVATIONS", "0")
            quant.int8_activations.cache_clear()
            assert torch.equal(quant.int4_linear(x, w), quant.int4_linear_torch(x, w))
        finally:
            quant.int8_activations.cache_clear()
        with pytest.raises(ValueError, match="residual must be"):
            quant.int4_linear_dynamic(x, w, residual=torch.zeros(5, 23), native=True)


class TestWorkspace:
    @pytest.mark.parametrize("num_tokens", [3, 70])
    def test_a_kept_workspace_gives_the_same_results(self, num_tokens: int) -> None:
        workspace = torch.full((quant.workspace_elems(256),), float("nan"), device=DEVICE)  # stale values
        w8 = quant.quantize_int8(_weight(96, 256).to(DEVICE))
        w4 = quant.quantize_int4(_weight(96, 256).to(DEVICE), 64)
        x, bias = _inputs(num_tokens, 256, 96, torch.float32, True)
        for _ in range(2):
            assert torch.equal(
                quant.int8_linear(x, w8, bias, workspace=workspace, dynamic=False), quant.int8_linear_torch(x, w8, bias)
            )
            assert torch.equal(
                quant.int4_linear(x, w4, bias, workspace=workspace, dynamic=False), quant.int4_linear_torch(x, w4, bias)
            )

    def test_rejects_a_workspace_too_small(self) -> None:
        w8 = quant.quantize_int8(_weight(96, 256).to(DEVICE))
        x, _ = _inputs(1, 256, 96, torch.float32, False)
        with pytest.raises(ValueError, match="workspace needs"):
            quant.int8_linear_torch(x, w8, workspace=torch.empty(96 * 256 - 1, device=DEVICE))
        with pytest.raises(ValueError, match="float32"):
            quant.int8_linear_torch(x, w8, workspace=torch.empty(1 << 20, dtype=torch.float16, device=DEVICE))


class TestInt4Linear:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("num_tokens", TOKENS)
    @pytest.mark.parametrize("with_bias", [False, True])
    @pytest.mark.parametrize("group_size", [32, 128])
    def test_torch_path_matches_the_reference(
        self, dtype: torch.dtype, num_tokens: int, with_bias: bool, group_size: int
    ) -> None:
        w = quant.quantize_int4(_weight(96, 384).to(DEVICE), group_size)
        x, bias = _inputs(num_tokens, 384, 96, dtype, with_bias)
        expected = _reference(x, quant.dequantize_int4(w, torch.float32), bias)
        _assert_close(quant.int4_linear_torch(x, w, bias), expected, dtype)
        _assert_close(quant.int4_linear(x, w, bias, dynamic=False), expected, dtype)

    @pytest.mark.parametrize("num_tokens", [5, 40])
    def test_torch_path_covers_matrices_of_several_tiles(
        self, monkeypatch: pytest.MonkeyPatch, num_tokens: int
    ) -> None:
        from loraplex.kernels import quant_int4

        monkeypatch.setattr(quant_int4, "TILE_ELEMS", 40 * 256)  # at most 40 rows: 4 tiles of 33, 33, 33, 31
        w = quant.quantize_int4(_weight(130, 256).to(DEVICE), 64)
        x, bias = _inputs(num_tokens, 256, 130, torch.float32, True)
        expected = _reference(x, quant.dequantize_int4(w, torch.float32), bias)
        _assert_close(quant.int4_linear_torch(x, w, bias), expected, torch.float32)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("num_tokens", [1, 20])
    @pytest.mark.parametrize("with_bias", [False, True])
    @pytest.mark.parametrize("group_size", [32, 128])
    def test_triton_kernel_matches_the_reference(
        self, dtype: torch.dtype, num_tokens: int, with_bias: bool, group_size: int
    ) -> None:
        w = quant.quantize_int4(_weight(136, 384).to(DEVICE), group_size)  # partial output and reduction tiles
        x, bias = _inputs(num_tokens, 384, 136, dtype, with_bias)
        expected = _reference(x, quant.dequantize_int4(w, torch.float32), bias)
        _assert_close(quant.int4_linear_triton(x, w, bias), expected, dtype)

    @pytest.mark.parametrize("name_fn", _int4_paths(), ids=lambda p: p[0])
    def test_rejects_mismatched_inputs(self, name_fn: tuple[str, Linear]) -> None:
        fn = name_fn[1]
        w = quant.quantize_int4(_weight(16, 128).to(DEVICE))
        with pytest.raises(ValueError, match="x must be"):
            fn(torch.randn(2, 127, device=DEVICE), w, None)
        with pytest.raises(ValueError, match="bias must be"):
            fn(torch.randn(2, 128, device=DEVICE), w, torch.zeros(15, device=DEVICE))

    def test_no_tokens(self) -> None:
        w = quant.quantize_int4(_weight(16, 128).to(DEVICE))
        for _, fn in _int4_paths():
            assert fn(torch.empty(0, 128, device=DEVICE), w, None).shape == (0, 16)
