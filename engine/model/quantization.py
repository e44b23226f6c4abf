"""The names of the weight-only quantizations the model applies at load (kept apart from the kernels and from
`quant_linear`, so configs can name them without importing torch)."""

from __future__ import annotations

from typing import Literal

# Weight-only quantization of the decoder layers' projections, done at load from a 16/32-bit checkpoint (fp8: e4m3
# per channel, what an FP8 checkpoint holds; kernels/quant_fp8.py).
QuantizationName = Literal["int8", "int4", "fp8"]
QUANTIZATIONS: tuple[QuantizationName, ...] = ("int8", "int4", "fp8")

__all__ = ["QUANTIZATIONS", "QuantizationName"]
