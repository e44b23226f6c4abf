#!/usr/bin/env bash
# The GPU variant of `make bench` (`make bench-gpu`): on one CUDA GPU, with the venv `make venv` made (`.[dev,kernels]`:
# torch with CUDA, Triton). It builds nothing. Each step has a time limit, and the limits add up to 8 minutes.
#
#   1. The Triton kernels against their torch paths on the GPU: the tests of tests/kernels that run them (paged
#      attention, SGMV shrink/expand, int8/int4 matmuls; each compares at an explicit tolerance; skipped on a CPU).
#   2. The quantized matmul kernels (int8, int4, and fp8 on both its paths) timed against torch's bf16 F.linear at a
#      7B model's projection shapes (triton.testing.do_bench, median ms) -> $OUT_DIR/quant_kernels.json.
#   3. Online serving on a bigger model: a random Llama of about 1B parameters (hidden 2048, 16 layers, bf16) with
#      16 adapters of ranks 8-64 (the serving suite's kind, benchmarks/suite_assets.py), served by
#      `loraplex engine serve --device cuda` and driven by benchmarks/serve.py at three request rates (200 requests,
#      64-512 words in, 128 tokens out, 10% to the base model) -> $OUT_DIR/serve_rate_R.json.
#
# What it does not do, and why: the offline throughput scripts (engine_throughput.py, lora_throughput.py,
# quant_throughput.py) build CPU engines (device="cpu" in the scripts). The serving suite (suite.py) has no device
# option: its engine servers would take the GPU (`--device auto`) while its naive peer and peft run on the CPU, which
# compares nothing like for like. The engine has no CUDA graphs to turn on. benchmarks/report.py reads only
# benchmarks/results/*.json, so these files (under benchmarks/results/gpu/) are not on docs/benchmarks.md yet.
#
# Written where no GPU was available: steps 1-3 have not run on one. `DEVICE=cpu SMALL=1 scripts/bench_gpu.sh` runs
# the same steps on a CPU with a small model, which checks the script itself, not the kernels (step 1 is skipped
# there, step 2 times the CPU paths).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
OUT_DIR=${OUT_DIR:-benchmarks/results/gpu}
RATES=${RATES:-"8 32 128"}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# shellcheck source=scripts/limited.sh
source scripts/limited.sh

if [ "$DEVICE" = cuda ]; then
    "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "bench_gpu.sh: torch sees no CUDA GPU (DEVICE=cpu SMALL=1 checks the script on a CPU)")'
    "$PYTHON" -c 'import triton' || { echo "bench_gpu.sh: no Triton: pip install -e '.[kernels]'" >&2; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
fi

echo "== 1. Triton kernels against their torch paths (limit 120 s)"
if [ "$DEVICE" = cuda ]; then
    limited 120 "$PYTHON" -m pytest tests/kernels -q -x -p no:cacheprovider -k "cuda or triton"
else
    echo "skipped: no GPU"
fi

echo "== 2. quantized matmuls against bf16 F.linear (limit 60 s)"
export DEVICE SMALL=${SMALL:-} WORK
OUT="$OUT_DIR/quant_kernels.json" limited 60 "$PYTHON" - <<'EOF'
import json, os, statistics, time

import torch
import torch.nn.functional as F

from loraplex.kernels.quant import int4_linear, int8_linear
from loraplex.kernels.quant_formats import quantize_int4, quantize_int8
from loraplex.kernels.quant_fp8 import fp8_gemm_supported, fp8_linear, quantize_fp8

device = torch.device(os.environ["DEVICE"])
# A 7B Llama's projections [out, in]: qkv, o, gate_up, down (the small set: the CPU benchmark model's).
shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
if os.environ.get("SMALL"):
    shapes = {"qkv": (1024, 512), "o": (512, 512), "gate_up": (2816, 512), "down": (512, 1408)}


def median_ms(fn):
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    times = []
    for _ in range(10):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


rows = []
for name, (out_features, in_features) in shapes.items():
    weight = torch.randn(out_features, in_features, device=device) * 0.02
    w8, w4, wf8 = quantize_int8(weight), quantize_int4(weight), quantize_fp8(weight)
    bf16 = weight.to(torch.bfloat16)
    for tokens in (1, 16, 64, 512):
        x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
        row = {"matrix": name, "out": out_features, "in": in_features, "tokens": tokens}
        row["bf16_linear_ms"] = median_ms(lambda: F.linear(x, bf16))
        row["int8_ms"] = median_ms(lambda: int8_linear(x, w8))
        row["int4_ms"] = median_ms(lambda: int4_linear(x, w4))
        # fp8: the path the device takes (FP8 GEMMs on compute capability >= 8.9) and the dequantizing one
        row["fp8_ms"] = median_ms(lambda: fp8_linear(x, wf8))
        row["fp8_dequantizing_ms"] = median_ms(lambda: fp8_linear(x, wf8, fp8_gemm=False))
        rows.append(row)
        print(f"{name:8s} {tokens:4d} tokens: bf16 {row['bf16_linear_ms']:.3f}  int8 {row['int8_ms']:.3f}  "
              f"int4 {row['int4_ms']:.3f}  fp8 {row['fp8_ms']:.3f} (dequantizing {row['fp8_dequantizing_ms']:.3f})")
name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
document = {
    "device": name,
    "torch": torch.__version__,
    "activations": "bfloat16",
    "fp8_gemm": fp8_gemm_supported(device),
    "results": rows,
}
with open(os.environ["OUT"], "w") as out:
    json.dump(document, out, indent=2)
EOF

echo "== 3. online serving, larger model, --device $DEVICE (limits: 90 s to write it, 70 s per rate)"
limited 90 "$PYTHON" - <<'EOF'
import os, sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from suite_assets import GPU_SPEC, SMALL_SPEC, mixed_adapters, write_model

from loraplex.engine.model.config import ModelConfig

work = Path(os.environ["WORK"])
spec = SMALL_SPEC if os.environ.get("SMALL") else GPU_SPEC  # about 1B parameters, bf16 (about 2 GB on disk)
model = write_model(work / "model", spec)
adapters = mixed_adapters(work / "adapters", ModelConfig.from_dir(model), 16)
(work / "loras.txt").write_text("".join(f"--lora lora-{i}={path}\n" for i, path in enumerate(adapters.paths)))
print(f"model {ModelConfig.from_dir(model).num_parameters() / 1e6:.0f}M parameters, {len(adapters.paths)} adapters")
EOF
mapfile -t LORAS < <(tr ' ' '\n' < "$WORK/loras.txt" | sed '/^$/d')
NUM_REQUESTS=200 OUTPUT_LEN=128
if [ -n "$SMALL" ]; then NUM_REQUESTS=16 OUTPUT_LEN=32; fi
for rate in $RATES; do
    limited 70 "$PYTHON" benchmarks/serve.py --launch-engine "$WORK/model" "${LORAS[@]}" \
        --engine-args "--device $DEVICE" --rate "$rate" --num-requests "$NUM_REQUESTS" \
        --num-adapters 16 --adapter-prefix lora- --base-share 0.1 --input-len 64:512 --output-len "$OUTPUT_LEN" \
        --slo-ttft-ms 500 --slo-tpot-ms 50 --no-progress --out "$OUT_DIR/serve_rate_$rate.json"
done
echo "wrote $OUT_DIR"
