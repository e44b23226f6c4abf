"""Which implementation each of the engine's hot operators runs in this process: a native CPU level
(kernels/native.py), the torch reference, or a Triton kernel, and which library multiplies float32 weights on a
CPU (`cpu_matmul`: oneDNN or torch's BLAS, docs/decisions/0055). The engine logs it at start and reports it
(GET /v1/state `operators`, /metrics `loraplex_engine_operator_path`), so an operator can see that a container
serves on the fast path, not only that it serves."""

from __future__ import annotations

import os
import platform
from functools import cache
from typing import Literal

import torch

from loraplex.kernels import native
from loraplex.kernels.quant import int8_activations

INTEGER_WEIGHTS = ("int8", "int4", "gptq", "awq")  # what the int8 and int4 matmuls run

CpuMatmul = Literal["onednn", "blas"]
_CPU_MATMULS: tuple[CpuMatmul, ...] = ("onednn", "blas")


@cache
def cpu_matmul() -> CpuMatmul:
    """The library that multiplies float32 weights on this CPU, chosen once per process (`choose_cpu_matmul`)."""
    return choose_cpu_matmul(
        os.environ.get("LORAPLEX_CPU_MATMUL", ""),
        machine=platform.machine(),
        vendor=native.cpu_vendor(),
        onednn_available=bool(torch.backends.mkldnn.is_available()),  # type: ignore[no-untyped-call]
    )


def choose_cpu_matmul(configured: str, *, machine: str, vendor: str, onednn_available: bool) -> CpuMatmul:
    """`configured` ($LORAPLEX_CPU_MATMUL: "onednn", "blas", or empty) where set, else oneDNN on an AMD x86-64 CPU
    and torch's BLAS (MKL on x86) on any other (decision 0055: MKL runs the engine's shapes at about half an AMD
    Zen 4's float32 rate, oneDNN near it; on Intel MKL was measured fast and oneDNN not yet). BLAS wherever torch
    was built without oneDNN."""
    configured = configured.strip().lower()
    if configured and configured not in _CPU_MATMULS:
        raise ValueError(f"LORAPLEX_CPU_MATMUL must be one of {', '.join(_CPU_MATMULS)}, not {configured!r}")
    if not onednn_available:
        return "blas"
    if configured:
        return "onednn" if configured == "onednn" else "blas"
    return "onednn" if machine in ("x86_64", "AMD64") and vendor == "AuthenticAMD" else "blas"


def operator_paths(device: torch.device, dtype: torch.dtype, quantization: str | None) -> dict[str, str]:
    """Each operator's path for a model of `dtype` on `device` with weights `quantization` (None: unquantized),
    decided as the operators decide at each call."""
    if device.type == "cuda":
        paths = {"paged_attention": "triton", "lora": "triton"}
        if quantization in INTEGER_WEIGHTS:
            paths["quantized_matmul"] = "triton"
        elif quantization == "fp8":
            paths["quantized_matmul"] = "torch"
        return paths
    fast = native.status().path  # "native/<level>" or "torch"
    # Both native decode operators take float32 rows; other dtypes stay on torch's kernels.
    float32 = dtype == torch.float32
    paths = {"paged_attention": fast if float32 else "torch", "lora": fast if float32 else "torch"}
    if float32 and quantization is None:
        paths["matmul"] = cpu_matmul()
    if quantization in INTEGER_WEIGHTS:
        paths["quantized_matmul"] = fast if int8_activations() else "torch"
    elif quantization == "fp8":
        paths["quantized_matmul"] = "torch"
    return paths
