"""Throughput of the training input pipeline against a plain tf.data pipeline.

Both decode the same real-size JPEGs (synthesised 500x375 photo-like images), take a
random-size crop (8%-100% area, aspect 3/4-4/3), resize to 224, flip and batch; tf.data
also normalises to float32 on the host, as the Flax ImageNet example's pipeline does,
while ours hands uint8 pixels to the step, which normalises on the device. `--transform
eval`: rule 13's evaluation crop instead (the centre window that resize-256 + crop-224
selects, resized to 224; tf.data as the Flax example: `decode_and_crop_jpeg` of that
window + resize). Ours runs on grain with `workers` decoding processes (one thread each);
tf.data runs with `num_parallel_calls` and a private thread pool of the same size. Prints
images/s of each, side by side in one process, and the ratio ours / tf.data.

    python experiments/benchmark_input.py [--images 256] [--batch 64] [--batches 24] \
        [--repeats 3] [--transform train eval]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time

import numpy as np
from PIL import Image

from largebatch_jax.data import loader, sources


def synth_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """Photo-like JPEGs: smooth colour fields with texture, 500x375 or 375x500, q=90."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        h, w = (375, 500) if i % 3 else (500, 375)
        coarse = rng.integers(0, 256, (h // 25 + 1, w // 25 + 1, 3)).astype(np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), np.float32)
        image = np.clip(field + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


class ListSource:
    """The images, `repeat` times over (evaluation reads a split once)."""

    def __init__(self, images: list[bytes], repeat: int = 1):
        self.images, self.repeat = images, repeat

    def __len__(self) -> int:
        return len(self.images) * self.repeat

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i % len(self.images)], "label": i % 1000}


def time_batches(iterator, batches: int, batch: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch / (time.perf_counter() - start)


def ours_eval(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    aug = loader.default_augmentation(sources.SPECS["imagenet2012"], 224)
    repeat = -(-(batches + 2) * batch // len(images))
    it = loader.eval_batches(ListSource(images, repeat), aug, batch, threads=1, workers=workers)
    return time_batches(it, batches, batch)


def ours(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    aug = loader.default_augmentation(sources.SPECS["imagenet2012"], 224)
    steps = (batches + 2) * 4
    it = loader.TrainLoader(
        ListSource(images),
        aug,
        batch,
        seed=0,
        num_steps=steps,
        workers=workers,
        threads=1,
        prefetch=2,
    )
    return time_batches(it, batches, batch)


def tf_data(images: list[bytes], workers: int, batch: int, batches: int, train=True) -> float:
    """The Flax ImageNet example's tf.data pipeline: the crop window decoded with
    `decode_and_crop_jpeg`, bilinear resize, (flip,) normalisation to float32."""
    import tensorflow as tf

    mean = tf.constant(sources.IMAGENET_MEAN, tf.float32)
    std = tf.constant(sources.IMAGENET_STD, tf.float32)

    def window(shape):
        if not train:  # the centre window that resize-256 + crop-224 selects
            side = tf.cast(tf.minimum(shape[0], shape[1]), tf.float32)
            crop = tf.cast(tf.round(side * 224 / 256), tf.int32)
            return tf.stack([(shape[0] - crop) // 2, (shape[1] - crop) // 2, crop, crop])
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape,
            tf.zeros([0, 0, 4], tf.float32),
            area_range=(0.08, 1.0),
            aspect_ratio_range=(3 / 4, 4 / 3),
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        return tf.stack([begin[0], begin[1], size[0], size[1]])

    def transform(encoded):
        shape = tf.io.extract_jpeg_shape(encoded)
        image = tf.io.decode_and_crop_jpeg(encoded, window(shape), channels=3)
        image = tf.image.resize(image, (224, 224), method="bilinear")
        if train:
            image = tf.image.random_flip_left_right(image)
        return (image - mean) / std

    return _run_tf(tf, images, transform, workers, batch, batches)


def tf_data_eval(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    return tf_data(images, workers, batch, batches, train=False)


def _run_tf(tf, images, transform, workers: int, batch: int, batches: int) -> float:
    ds = tf.data.Dataset.from_tensor_slices(images).repeat()
    ds = ds.map(transform, num_parallel_calls=workers).batch(batch).prefetch(2)
    options = tf.data.Options()
    options.threading.private_threadpool_size = workers
    options.deterministic = True
    return time_batches(iter(ds.with_options(options)), batches, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--transform", nargs="+", default=["train", "eval"])
    args = parser.parse_args()
    images = synth_jpegs(args.images)
    print(
        f"{len(images)} JPEGs, mean {np.mean([len(b) for b in images]) / 1024:.0f} KiB, "
        f"{os.cpu_count()} cores; batch {args.batch}, {args.batches} batches timed, "
        f"median of {args.repeats} alternating repeats"
    )
    print(f"{'transform':>9} {'workers':>7} {'ours img/s':>11} {'tf.data img/s':>14} {'ratio':>6}")
    pairs = {"train": (ours, tf_data), "eval": (ours_eval, tf_data_eval)}
    for transform in args.transform:
        mine, theirs = pairs[transform]
        for workers in args.workers:
            a, b = [], []
            for _ in range(args.repeats):
                a.append(mine(images, workers, args.batch, args.batches))
                b.append(theirs(images, workers, args.batch, args.batches))
            ma, mb = statistics.median(a), statistics.median(b)
            print(
                f"{transform:>9} {workers:>7} {ma:>11.1f} {mb:>14.1f} {ma / mb:>6.2f}", flush=True
            )


if __name__ == "__main__":
    main()
