#!/usr/bin/env bash
# The paper's kn=8192 ResNet-50 run compiled on this CPU host (largebatch_jax.aot), ours
# beside the Flax-example-style reference, float32 and bfloat16:
#   bash experiments/aot_paper_runs.sh tpu   # Cloud TPU slices (the tpu extra)
#                                            #   -> experiments/results/aot_paper.txt
#   bash experiments/aot_paper_runs.sh gpu   # NVIDIA GPU clusters (the gpu-compiler extra)
#                                            #   -> experiments/results/aot_gpu.txt
#   bash experiments/aot_paper_runs.sh exact # reduction=exact beside fast, TPU and GPU
#                                            #   -> experiments/results/exact_aot.txt
# Fast mode unless a run names exact (the reference comparisons are of XLA's all-reduce).
# Each run's command heads its output; a failed run is recorded and the next one goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
case "${1:-tpu}" in
  tpu)
    OUT=experiments/results/aot_paper.txt
    runs=()
    for dtype in float32 bfloat16; do
      for where in "--topology=v5e-256" "--topology=v4-512" "--topology=v5e-32 --per_device_batch=32"; do
        runs+=("$where --config.dtype=$dtype --config.reduction=fast --reference")
      done
    done
    ;;
  gpu)
    OUT=experiments/results/aot_gpu.txt
    runs=()
    for dtype in float32 bfloat16; do
      runs+=("--topology=h100:32x8 --config.dtype=$dtype --config.reduction=fast --reference"
             "--topology=h100:1x8 --per_device_batch=32 --config.dtype=$dtype --config.reduction=fast --reference"
             "--topology=h100:32x8 --config.dtype=$dtype --config.reduction=exact --config.eval_batch_size=8192")
    done
    for gpu in a100 h200 b200; do
      runs+=("--topology=$gpu:32x8 --config.dtype=bfloat16 --config.reduction=fast")
    done
    ;;
  exact)
    OUT=experiments/results/exact_aot.txt
    runs=()
    for where in "--topology=v5e-256" "--topology=v4-512" "--topology=h100:32x8"; do
      for dtype in float32 bfloat16; do
        runs+=("$where --config.dtype=$dtype --config.reduction=exact" "$where --config.dtype=$dtype --config.reduction=fast")
      done
    done
    ;;
  *) echo "usage: $0 tpu|gpu|exact" >&2; exit 2 ;;
esac
: > "$OUT"
for run in "${runs[@]}"; do
  echo "\$ python -m largebatch_jax.aot --config=configs/imagenet_8k.py $run" >> "$OUT"
  # shellcheck disable=SC2086
  "$PY" -m largebatch_jax.aot --config=configs/imagenet_8k.py $run >> "$OUT" 2> /tmp/aot_stderr.log \
    || echo "(failed: exit $?, see /tmp/aot_stderr.log)" >> "$OUT"
  echo >> "$OUT"
done
