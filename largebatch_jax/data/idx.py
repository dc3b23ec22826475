"""Fashion-MNIST from the IDX files it is distributed as (Debian's
`dataset-fashion-mnist` installs them), prepared by tfds's own builder."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np

from largebatch_jax.errors import DatasetNotPreparedError

DEFAULT_IDX_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (as distributed by MNIST / Fashion-MNIST), gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _idx_files(idx_dir: str) -> dict[str, Path]:
    names = {
        "train_images": "train-images-idx3-ubyte",
        "train_labels": "train-labels-idx1-ubyte",
        "test_images": "t10k-images-idx3-ubyte",
        "test_labels": "t10k-labels-idx1-ubyte",
    }
    found = {}
    for key, stem in names.items():
        for candidate in (Path(idx_dir) / f"{stem}.gz", Path(idx_dir) / stem):
            if candidate.exists():
                found[key] = candidate
                break
        else:
            raise DatasetNotPreparedError(
                f"dataset 'fashion_mnist': {stem}[.gz] not found in {idx_dir} "
                "(install Debian's dataset-fashion-mnist or pass --idx_dir)"
            )
    return found


def local_fashion_mnist_builder(idx_dir: str, data_dir: str) -> Any:
    """tfds's own FashionMNIST builder, fed from local IDX files instead of its URLs:
    the same features, splits and examples in the same order, written where
    `tfds.builder('fashion_mnist')` reads them."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.image_classification import mnist

    files = _idx_files(idx_dir)

    class LocalFashionMNIST(mnist.FashionMNIST, skip_registration=True):
        name = "fashion_mnist"

        def _split_generators(self, dl_manager):
            del dl_manager
            return [
                tfds.core.SplitGenerator(name=split, gen_kwargs={"split": split})
                for split in ("train", "test")
            ]

        def _generate_examples(self, split):
            images = read_idx(files[f"{split}_images"])[..., None]
            labels = read_idx(files[f"{split}_labels"])
            for index, (image, label) in enumerate(zip(images, labels, strict=True)):
                yield index, {"image": image, "label": int(label)}

    return LocalFashionMNIST(data_dir=data_dir, file_format="array_record")
