#!/usr/bin/env bash
# On a machine with one NVIDIA GPU: ResNet-50 train-step throughput in float32 and
# bfloat16 (ours and the Flax-example-style reference), images/s and achieved TFLOP/s.
#
#   bash scripts/gpu_check.sh            # BATCH=128 per device by default
#   BATCH=256 bash scripts/gpu_check.sh
#
# Needs JAX with CUDA in the venv: .venv/bin/pip install -U "jax[cuda12]"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BATCH=${BATCH:-128}
if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  echo "error: JAX sees no GPU here; install it with: $PY -m pip install -U 'jax[cuda12]'" >&2
  exit 2
fi
"$PY" -c "import jax; print(jax.devices())"
for dtype in float32 bfloat16; do
  "$PY" experiments/benchmark.py --model=resnet50 --devices=0 --per_device_batch="$BATCH" \
    --dtype="$dtype" --conv_impl=auto --steps=20 --repeats=2
done
