#!/usr/bin/env bash
# The paper's kn=8192 ResNet-50 run compiled for Cloud TPU slices on this CPU host
# (largebatch_jax.aot; needs the tpu extra: pip install -e '.[tpu]'), ours beside the
# Flax-example-style reference, float32 and bfloat16. Writes
# experiments/results/aot_paper.txt (the README's "compiled for TPU" table).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=experiments/results/aot_paper.txt
: > "$OUT"
for dtype in float32 bfloat16; do
  for run in "--topology=v5e-256" "--topology=v4-512" "--topology=v5e-32 --per_chip_batch=32"; do
    # shellcheck disable=SC2086
    cmd="python -m largebatch_jax.aot --config=configs/imagenet_8k.py $run --config.dtype=$dtype --reference"
    echo "\$ $cmd" >> "$OUT"
    "$PY" -m largebatch_jax.aot --config=configs/imagenet_8k.py $run --config.dtype="$dtype" \
      --reference >> "$OUT" 2> /tmp/aot_paper_stderr.log || echo "(failed: exit $?, see /tmp/aot_paper_stderr.log)" >> "$OUT"
    echo >> "$OUT"
  done
done
