#!/usr/bin/env bash
# Fashion-MNIST's real IDX files for offline machines: Debian's dataset-fashion-mnist
# (MIT licence) puts them in /usr/share/datasets/fashion-mnist. Where apt-get cannot run,
# say so: `prepare fashion_mnist` then falls back to tfds's own download.
set -euo pipefail
dir=/usr/share/datasets/fashion-mnist
if [ -f "$dir/train-images-idx3-ubyte.gz" ]; then
  exit 0
fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null
elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
  sudo apt-get update -qq && sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
else
  echo "note: cannot install dataset-fashion-mnist here; tfds will download Fashion-MNIST" >&2
fi
