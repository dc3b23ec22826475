"""Datasets as random-access sources: the real tfds builders, prepared as array_record.

Supported: `imagenet2012` (from a manual_dir with the two ILSVRC2012 tars; nothing is
downloaded), `fashion_mnist` (tfds's download, or the same IDX files installed locally,
e.g. by Debian's `dataset-fashion-mnist`), `cifar10` (tfds's download) and
`image_folder/<name>` (a user's `root/{train,val}/<class>/*.jpg`, converted once).
A source is indexable: `source[i] -> {'image': encoded bytes or uint8 array, 'label': int}`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from largebatch_jax.data import folder
from largebatch_jax.data.idx import DEFAULT_IDX_DIR, local_fashion_mnist_builder
from largebatch_jax.errors import DatasetChangedError, DatasetNotPreparedError

IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What the loader and transforms need to know about a dataset."""

    name: str
    num_classes: int
    train_split: str
    eval_split: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    large_images: bool  # ImageNet-style crops (True) or small fixed-size images (False)
    native_size: int | None = None


SPECS = {
    "imagenet2012": DatasetSpec(
        "imagenet2012", 1000, "train", "validation", IMAGENET_MEAN, IMAGENET_STD, True
    ),
    "fashion_mnist": DatasetSpec(
        "fashion_mnist", 10, "train", "test", (72.94,), (90.02,), False, 28
    ),
    "cifar10": DatasetSpec(
        "cifar10",
        10,
        "train",
        "test",
        (125.31, 122.95, 113.87),
        (62.99, 62.09, 66.70),
        False,
        32,
    ),
}
FOLDER_PREFIX = "image_folder/"
# Training-set sizes, for what must know the steps per epoch without the data (the
# benchmark, an ahead-of-time compile): the schedule's epoch boundaries depend on it.
TRAIN_SIZES = {"imagenet2012": 1_281_167, "fashion_mnist": 60_000, "cifar10": 50_000}


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Updates per epoch: whole minibatches of kn, the remainder of N / kn dropped
    (Remark 4's epoch, `loader.train_step_indices`): 156 for kn=8192 on ImageNet's
    1,281,167 images."""
    if batch_size > num_examples:
        raise ValueError(
            f"batch_size={batch_size} is larger than the training set ({num_examples})."
        )
    return num_examples // batch_size


def pixel_statistics(name: str) -> tuple[tuple[float, ...], tuple[float, ...], int | None]:
    """(mean, std, native size or None) of a dataset's pixels, without loading it: what
    the step needs to normalise the uint8 batches. Image folders use ImageNet's."""
    if name in SPECS:
        spec = SPECS[name]
        return spec.mean, spec.std, None if spec.large_images else spec.native_size
    if name.startswith(FOLDER_PREFIX):
        return IMAGENET_MEAN, IMAGENET_STD, None
    raise ValueError(f"dataset={name!r} is not one of {(*SPECS, FOLDER_PREFIX + '<name>')}.")


def default_data_dir() -> str:
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


def prepare_command(name: str, data_dir: str) -> str:
    extra = {
        "imagenet2012": " --manual_dir=DIR_WITH_ILSVRC2012_TARS",
        "fashion_mnist": f" --idx_dir={DEFAULT_IDX_DIR}",
    }.get(name, "")
    if name.startswith(FOLDER_PREFIX):
        name, extra = "image_folder", f" --name={name[len(FOLDER_PREFIX) :]} --root=ROOT"
    return f"python -m largebatch_jax.data.prepare {name} --data_dir={data_dir}{extra}"


def _folder_dir(name: str, data_dir: str) -> Path:
    return Path(data_dir) / "image_folder" / folder_name(name[len(FOLDER_PREFIX) :])


def folder_name(short: str) -> str:
    """An image folder dataset's name, checked: one plain folder name, so that it stays
    inside data_dir/image_folder/ (ValueError otherwise)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", short) or ".." in short:
        raise ValueError(
            f"image folder name {short!r} is not a plain name (letters, digits, '_', '-', "
            "'.'; no '/' or '..'): choose one, e.g. --name=pets."
        )
    return short


def dataset_folder(name: str, data_dir: str, root: str | None = None) -> Path:
    """The folder of a dataset's prepared versions under data_dir (and of tfds's
    `incomplete.*` folders while it prepares one)."""
    if name == "image_folder":
        return Path(data_dir) / "image_folder" / folder_name(Path(root or "").name)
    if name.startswith(FOLDER_PREFIX):
        return _folder_dir(name, data_dir)
    return Path(data_dir) / name


def _builder(name: str, data_dir: str) -> Any:
    """The prepared tfds builder, or DatasetNotPreparedError."""
    import tensorflow_datasets as tfds

    if name.startswith(FOLDER_PREFIX):
        versions = sorted(_folder_dir(name, data_dir).glob("*/dataset_info.json"))
        if versions:
            return tfds.builder_from_directory(str(versions[-1].parent))
    elif name in SPECS:
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
        if builder.is_prepared():
            return builder
    else:
        raise ValueError(f"dataset={name!r} is not one of {(*SPECS, FOLDER_PREFIX + '<name>')}.")
    raise DatasetNotPreparedError(
        f"dataset {name!r} is not prepared in {data_dir}: run `{prepare_command(name, data_dir)}`"
    )


def dataset_spec(name: str, data_dir: str | None = None) -> DatasetSpec:
    """The spec of a named dataset (an image folder's is read from its prepared info)."""
    if name in SPECS:
        return SPECS[name]
    builder = _builder(name, data_dir or default_data_dir())
    return DatasetSpec(
        name,
        builder.info.features["label"].num_classes,
        "train",
        "validation",
        IMAGENET_MEAN,
        IMAGENET_STD,
        True,
    )


class InMemorySource:
    """A small dataset decoded once into memory (Fashion-MNIST, CIFAR-10): the training
    loop then spends no time decoding 28x28 PNGs every epoch."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "label": int(self.labels[i])}


class Subset:
    """The first `size` records of a source (small runs and tests); the loader's global
    shuffle then applies to this subset."""

    def __init__(self, source: Any, size: int):
        if not 0 < size <= len(source):
            raise ValueError(f"subset size {size} must be in [1, {len(source)}].")
        self.source, self.size = source, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.source[i]


class EncodedSource:
    """An array_record source whose images stay encoded (decoded, cropped, by transforms)."""

    def __init__(self, source: Any):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        record = self.source[int(i)]
        out = {"image": record["image"], "label": int(record["label"])}
        if "file_name" in record:  # named in the loader's error for an undecodable image
            name = record["file_name"]
            out["file_name"] = name.decode() if isinstance(name, bytes) else str(name)
        return out


def load_source(name: str, split: str, data_dir: str | None = None) -> Any:
    """A random-access source over one split of a prepared dataset; prepared files that
    are missing or cut short stop here with DatasetNotPreparedError (one line)."""
    import tensorflow_datasets as tfds

    data_dir = data_dir or default_data_dir()
    builder = _builder(name, data_dir)
    if split not in builder.info.splits:
        raise DatasetNotPreparedError(
            f"dataset {name!r} in {data_dir} has no split {split!r} "
            f"(it has {sorted(builder.info.splits)})"
        )
    try:
        source = builder.as_data_source(split=split, decoders={"image": tfds.decode.SkipDecoding()})
        _check_shards(source, builder.info.splits[split].shard_lengths)
    except Exception as e:  # whatever array_record raises for a missing or torn file
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DatasetNotPreparedError(
            f"dataset {name!r} in {data_dir}: the prepared files of split {split!r} cannot "
            f"be read ({type(e).__name__}: {first}): prepare it again with "
            f"`{prepare_command(name, data_dir)} --overwrite`"
        ) from None
    if name in SPECS and not SPECS[name].large_images:
        return InMemorySource(*_decoded(source, Path(builder.data_dir) / f"decoded-{split}.npz"))
    return EncodedSource(source)


def _check_shards(source: Any, shard_lengths: list[int]) -> None:
    """Read the first and the last record of every shard: opens every file and reads its
    footer, so a deleted or truncated shard is found before training, not at its batch."""
    if len(source) != sum(shard_lengths):
        raise ValueError(f"{len(source)} records where the dataset info says {sum(shard_lengths)}")
    start = 0
    for length in shard_lengths:
        if length:
            source.__getitems__([start, start + length - 1])
        start += length


def _decoded(source: Any, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """Decoded images and labels of a small split, cached beside the prepared files (the
    decode takes ~15 s for Fashion-MNIST, the cache 0.1 s). A cache that cannot be read
    (cut short) or does not match the split is decoded again from the prepared files."""
    if cache.exists():
        try:
            with np.load(cache) as f:
                images, labels = f["images"], f["labels"]
            if len(labels) == len(images) == len(source):
                return images, labels
            logging.warning(
                "%s holds %d images, the split %d: decoding again", cache, len(labels), len(source)
            )
        except Exception as e:  # a truncated zip: BadZipFile, EOFError, ValueError, ...
            logging.warning(
                "%s cannot be read (%s): decoding the split again", cache, type(e).__name__
            )
    images, labels = _decode_all(source)
    try:  # a read-only data_dir only loses the cache
        tmp = cache.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, images=images, labels=labels)
        tmp.replace(cache)
    except OSError:
        pass
    return images, labels


def _decode_all(source: Any) -> tuple[np.ndarray, np.ndarray]:
    import io
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    def decode(start: int) -> list:
        chunk = source.__getitems__(list(range(start, min(start + 4096, len(source)))))
        return [(np.asarray(Image.open(io.BytesIO(r["image"]))), r["label"]) for r in chunk]

    with ThreadPoolExecutor(os.cpu_count()) as pool:  # PIL releases the GIL to decode
        pairs = [p for chunk in pool.map(decode, range(0, len(source), 4096)) for p in chunk]
    images = np.stack([image for image, _ in pairs])
    if images.ndim == 3:
        images = images[..., None]
    return images, np.asarray([label for _, label in pairs], np.int32)


# ----------------------------------------------------------------------------- preparing


def _builder_for(
    name: str, data_dir: str, manual_dir: str | None, idx_dir: str | None, root: str | None
) -> tuple[Any, Callable[[], Any], Any]:
    """The tfds builder that prepares `name`, the call that prepares it, and the scanned
    image folder (None for the others)."""
    import tensorflow_datasets as tfds

    if name == "imagenet2012":
        if not manual_dir:
            raise DatasetNotPreparedError(
                "imagenet2012 needs --manual_dir holding ILSVRC2012_img_train.tar and "
                "ILSVRC2012_img_val.tar"
            )
        tars = [Path(manual_dir) / f"ILSVRC2012_img_{s}.tar" for s in ("train", "val")]
        if not any(t.is_file() for t in tars):
            raise DatasetNotPreparedError(
                f"imagenet2012: neither {tars[0].name} nor {tars[1].name} is in {manual_dir}"
            )
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
        config = tfds.download.DownloadConfig(manual_dir=manual_dir)
        return builder, lambda: builder.download_and_prepare(download_config=config), None
    if name == "fashion_mnist" and (idx_dir or Path(DEFAULT_IDX_DIR).is_dir()):
        builder = local_fashion_mnist_builder(idx_dir or DEFAULT_IDX_DIR, data_dir)
        return builder, builder.download_and_prepare, None
    if name in ("fashion_mnist", "cifar10"):
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
        return builder, builder.download_and_prepare, None
    if name.startswith(FOLDER_PREFIX) or name == "image_folder":
        if not root:
            raise DatasetNotPreparedError("image_folder needs --root (with train/ and val/)")
        short = name[len(FOLDER_PREFIX) :] if name.startswith(FOLDER_PREFIX) else Path(root).name
        folder_name(short)
        try:
            found = folder.scan(root)
        except ValueError as e:
            raise DatasetNotPreparedError(str(e)) from None
        builder = folder.builder(found, short, data_dir)
        return builder, builder.download_and_prepare, found
    raise ValueError(f"dataset={name!r} is not one of {(*SPECS, 'image_folder')}.")


def prepare(
    name: str,
    data_dir: str | None = None,
    *,
    manual_dir: str | None = None,
    idx_dir: str | None = None,
    root: str | None = None,
    overwrite: bool = False,
    report: Callable[[str], None] = logging.info,
) -> str:
    """Prepare a dataset as array_record under data_dir; returns where it went.

    A dataset prepared before is reused, except that an image folder whose files changed
    since is refused (DatasetChangedError) unless `overwrite`, which deletes the prepared
    copy and prepares it again (for any dataset: the fix for corrupt prepared files).
    `report` receives one line on what was prepared (an image folder's left-out files)."""
    data_dir = os.path.expanduser(data_dir) if data_dir else default_data_dir()
    builder, make, found = _builder_for(name, data_dir, manual_dir, idx_dir, root)
    version_dir = Path(builder.data_dir)
    prepared = (version_dir / "dataset_info.json").exists()
    if prepared and found is not None and not overwrite:
        before = folder.recorded_source(version_dir)
        if before is None or before.get("fingerprint") != found.fingerprint:
            raise DatasetChangedError(
                f"image folder {found.root} changed since it was prepared in {version_dir} "
                "(files added, removed or modified): rerun the prepare command with "
                "--overwrite to prepare it again (a run already trained on the old copy "
                "should then start in a new workdir)."
            )
    if prepared and overwrite:
        shutil.rmtree(version_dir)
    make()
    if found is not None:
        folder.write_source(version_dir, found)
        report(found.summary())
    return str(builder.data_dir)
