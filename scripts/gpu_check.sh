#!/usr/bin/env bash
# On a machine with one NVIDIA GPU: ResNet-50 train-step throughput, ours and the
# Flax-example-style reference, float32 and bfloat16, at 128 and 256 images per device:
# images/s, achieved TFLOP/s and MFU against the GPU's bf16 peak (benchmark.py's table),
# ours also fed a host batch every step as the training loop feeds it (the log's input
# wait and the GPU's peak memory in use; the first configuration's steps 1-3 traced into
# a profile, whose files are listed at the end),
# and beside ours the memory per device that the deviceless compile of the same
# configuration predicts (python -m largebatch_jax.aot, run here with JAX_PLATFORMS=cpu
# for this GPU's description): the hardware checks the compiler's figures.
#
#   bash scripts/gpu_check.sh                 # BATCHES="128 256" DTYPES="float32 bfloat16"
#   BATCHES=256 DTYPES=bfloat16 bash scripts/gpu_check.sh
#
# Needs only JAX with CUDA, flax, optax and numpy (absl-py and PyYAML come with flax and
# orbax). The configs also need ml_collections: if it is missing, it is installed from the
# wheel in $WHEELS (default wheels/; fetch it on a networked host with
# `make wheels`), nothing from the network. The deviceless compile takes the PTX assembler
# of the gpu-compiler extra if installed, else the host's CUDA toolkit's (`ptxas` on the
# PATH). About 5 minutes on an H100-class GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
BATCHES=${BATCHES:-128 256}
DTYPES=${DTYPES:-float32 bfloat16}
STEPS=${STEPS:-20}
WHEELS=${WHEELS:-wheels}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import ml_collections" 2>/dev/null; then
  if ! ls "$WHEELS"/ml_collections-*.whl >/dev/null 2>&1; then
    echo "error: ml_collections is not installed and $WHEELS/ has no wheel of it; on a" \
      "host with network run: make wheels (then copy $WHEELS/ here)" >&2
    exit 2
  fi
  deps=$(mktemp -d)
  "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$deps" "$WHEELS"/ml_collections-*.whl
  export PYTHONPATH="$deps:$PYTHONPATH"
fi

# CPU=1 runs the same commands on 8 fake CPU devices at 2 images each and 64x64 (a dry
# run of everything up to the GPU, the deviceless compile for 1 host x 8 H100 included;
# its figures mean nothing).
if [[ "${CPU:-0}" == 1 ]]; then
  devices=(--devices=8 --image_size=64)
  aot=(--topology=h100:1x8 --config.image_size=64)
  BATCHES=2 STEPS=1
  per_step=8
else
  if ! "$PYTHON" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
    echo "error: JAX sees no GPU here; install JAX with CUDA (pip install -e '.[cuda12]')" \
      "or run CPU=1 bash scripts/gpu_check.sh for a dry run" >&2
    exit 2
  fi
  devices=(--devices=0)
  kind=$("$PYTHON" -c "import jax; from largebatch_jax.aot.targets import gpu_kind_of; print(gpu_kind_of(jax.devices()[0].device_kind) or '')")
  aot=(--topology="${kind:-h100}:1x1")
  per_step=1
fi
if ! "$PYTHON" -c "from largebatch_jax.aot.targets import packaged_ptxas as p; assert p()" 2>/dev/null \
  && command -v ptxas >/dev/null; then
  aot+=(--ptxas="$(command -v ptxas)")
fi
"$PYTHON" -c "
from largebatch_jax import host
host.choose_platforms()
with host.plugin_noise_filtered():
    import jax, flax, optax
    devices = jax.devices()
print(devices, 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
work=$(mktemp -d)
for batch in $BATCHES; do
  for dtype in $DTYPES; do
    json="$work/aot_${batch}_${dtype}.json"
    compare=()
    if JAX_PLATFORMS=cpu "$PYTHON" -m largebatch_jax.aot --config=configs/imagenet.py "${aot[@]}" \
      --per_device_batch="$batch" --config.batch_size=$((batch * per_step)) \
      --config.bn_group_size=$((batch < 32 ? batch : 32)) --config.dtype="$dtype" \
      --config.conv_impl=xla --json="$json" > "$work/aot.log" 2>&1; then
      compare=(--aot_json="$json")
    else
      echo "(the deviceless compile failed: $(tail -n 1 "$work/aot.log"))"
    fi
    profile=()
    if [[ ! -d "$work/profile" ]]; then profile=(--profile="$work/profile"); fi
    "$PYTHON" -m experiments.benchmark --model=resnet50 "${devices[@]}" \
      --per_device_batch="$batch" --dtype="$dtype" --conv_impl=xla --steps="$STEPS" --repeats=1 \
      "${compare[@]}" "${profile[@]}"
  done
done
echo "profile (tensorboard --logdir $work/profile, or perfetto_trace.json.gz in ui.perfetto.dev):"
find "$work/profile" -type f -printf '  %p %s bytes\n' 2>/dev/null || echo "  (none written)"
