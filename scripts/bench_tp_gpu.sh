#!/usr/bin/env bash
# Tensor parallelism on a GPU machine, in under 8 minutes: benchmarks/tensor_parallel.py with NCCL.
#
#   1. The split-engine tests, for what they check on any machine (gloo on the CPU ranks), limit 150 s.
#   2. TP=1 and, with at least two GPUs, TP=2 on a ~1B random Llama (hidden 2048, 16 layers, bf16): decode step time
#      at batch 1, 8, 32 and a 512-token prefill, with the bytes the collectives move per step and per token
#      -> $OUT_DIR/tensor_parallel.json, limit 300 s. On one GPU only TP=1 runs; the bytes a split would move are
#      the same per token as on the CPU (benchmarks/results/tensor_parallel.json: 2 * layers + 1 hidden vectors),
#      so the file holds the step time the communication would be added to.
#
# Written where no GPU was available: it has not run on one (`DEVICE=cpu scripts/bench_tp_gpu.sh` checks the script).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
OUT_DIR=${OUT_DIR:-benchmarks/results/gpu}
mkdir -p "$OUT_DIR"

# shellcheck source=scripts/limited.sh
source scripts/limited.sh

SIZES=1
LARGE=(--large --dtype bfloat16)
if [ "$DEVICE" = cuda ]; then
    GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
    if [ "$GPUS" -ge 2 ]; then SIZES=1,2; fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
else
    SIZES=1,2 LARGE=()
fi

echo "== 1. split-engine tests (limit 150 s)"
limited 150 "$PYTHON" -m pytest tests/engine/parallel -q -x -p no:cacheprovider -m "not integration"

echo "== 2. TP sizes $SIZES on $DEVICE (limit 300 s)"
limited 300 "$PYTHON" benchmarks/tensor_parallel.py --device "$DEVICE" --sizes "$SIZES" "${LARGE[@]}" \
    --out "$OUT_DIR/tensor_parallel.json"
echo "wrote $OUT_DIR/tensor_parallel.json"
