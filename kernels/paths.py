"""Which implementation each of the engine's hot operators runs in this process: a native CPU level
(kernels/native.py), the torch reference, or a Triton kernel. The engine logs it at start and reports it
(GET /v1/state `operators`, /metrics `loraplex_engine_operator_path`), so an operator can see that a container
serves on the fast path, not only that it serves."""

from __future__ import annotations

import torch

from loraplex.kernels import native
from loraplex.kernels.quant import int8_activations

INTEGER_WEIGHTS = ("int8", "int4", "gptq", "awq")  # what the int8 and int4 matmuls run


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
    if quantization in INTEGER_WEIGHTS:
        paths["quantized_matmul"] = fast if int8_activations() else "torch"
    elif quantization == "fp8":
        paths["quantized_matmul"] = "torch"
    return paths
