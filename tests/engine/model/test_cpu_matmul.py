"""Which library multiplies float32 weights on a CPU (kernels/paths.py `cpu_matmul`, docs/decisions/0055), and that
oneDNN's linear computes what F.linear and torch.addmm compute wherever the engine calls it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.model.quant_linear import addmm, linear, matmul_layout, onednn_fp32
from loraplex.kernels.paths import choose_cpu_matmul, cpu_matmul

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("configured", "machine", "vendor", "available", "expected"),
    [
        ("", "x86_64", "AuthenticAMD", True, "onednn"),  # MKL runs AMD's float32 at about half oneDNN's rate
        ("", "x86_64", "GenuineIntel", True, "blas"),  # MKL measured fast on Intel
        ("", "aarch64", "", True, "blas"),
        ("", "x86_64", "AuthenticAMD", False, "blas"),  # a torch without oneDNN
        ("blas", "x86_64", "AuthenticAMD", True, "blas"),
        (" oneDNN ", "x86_64", "GenuineIntel", True, "onednn"),
        ("onednn", "x86_64", "GenuineIntel", False, "blas"),
    ],
)
def test_the_library_follows_the_cpu_unless_configured(
    configured: str, machine: str, vendor: str, available: bool, expected: str
) -> None:
    assert choose_cpu_matmul(configured, machine=machine, vendor=vendor, onednn_available=available) == expected


def test_an_unknown_library_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="LORAPLEX_CPU_MATMUL must be one of onednn, blas, not 'mkl'"):
        choose_cpu_matmul("mkl", machine="x86_64", vendor="AuthenticAMD", onednn_available=True)


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv("LORAPLEX_CPU_MATMUL", "onednn")
    cpu_matmul.cache_clear()
    yield
    monkeypatch.undo()
    cpu_matmul.cache_clear()


@pytest.mark.parametrize("rows", [0, 1, 7, 37, 300])
def test_onednn_linear_and_addmm_agree_with_torch(onednn: None, rows: int) -> None:
    torch.manual_seed(rows)
    checkpoint = torch.randn(96, 80)
    weight = matmul_layout(checkpoint)
    assert weight.is_contiguous()
    x, bias, residual = torch.randn(rows, 80), torch.randn(96), torch.randn(rows, 96)
    kept = residual.clone()
    with torch.inference_mode():
        assert onednn_fp32(x, weight)
        torch.testing.assert_close(linear(x, weight), F.linear(x, checkpoint), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear(x, weight, bias), F.linear(x, checkpoint, bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(addmm(residual, x, weight), residual + x @ checkpoint.t(), atol=1e-5, rtol=1e-5)
        # A strided input (a slice of a wider activation) is multiplied as its values, not its memory.
        strided = torch.randn(rows, 160)[:, ::2]
        torch.testing.assert_close(linear(strided, weight), F.linear(strided, checkpoint), atol=1e-5, rtol=1e-5)
    assert torch.equal(residual, kept)  # addmm returns a new tensor


def test_what_onednn_cannot_take_goes_to_torch(onednn: None) -> None:
    weight = matmul_layout(torch.randn(16, 8))
    assert not onednn_fp32(torch.randn(3, 8, dtype=torch.bfloat16), weight.bfloat16())
    assert not onednn_fp32(torch.randn(2, 3, 8), weight)  # 3-D input
    assert not onednn_fp32(torch.randn(3, 8), weight.t().contiguous().t())  # the MKL layout
    x = torch.randn(3, 8, requires_grad=True)  # a gradient: oneDNN's linear has no backward
    assert not onednn_fp32(x, weight)
    linear(x, weight).sum().backward()
    assert x.grad is not None
