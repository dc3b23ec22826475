"""Throughput of the input pipeline against the strongest tf.data pipeline, per core.

Each decodes the same JPEGs, takes rule 13's random-size crop (8%-100% area, aspect
3/4-4/3), resizes it to 224, flips and batches (`--transform eval`: the centre window
that resize-256 + crop-224 selects, resized to 224). Columns, side by side in one
process, images/s (median of alternating repeats):

- ours: the loader with `workers` decoding threads in this process (libjpeg-turbo and
  OpenCV release the GIL);
- tf.data u8, the main baseline: `decode_and_crop_jpeg` of the window, bilinear
  `tf.image.resize`, flip, cast to uint8, normalisation left to the device as ours;
  `num_parallel_calls` and a private thread pool of `workers` threads;
- tf.data f32: the same, normalised to float32 on the host, as the Flax ImageNet example;
- ours procs: the loader with `workers` grain processes of one thread each (the
  process layout a multi-accelerator host uses; ratio against tf.data u8).

The process (every thread, and the processes it starts) is pinned to `workers` cores, so
each figure is what that many cores deliver.

Image sets: synthesised photo-like 500x375 JPEGs, and real photographs where a folder
of them exists (`--photos`; by default the sample images of Debian's opencv-doc:
`apt-get download opencv-doc && dpkg-deb -x opencv-doc_*.deb DIR`, then
`--photos DIR/usr/share/doc/opencv-doc/examples/data`, or `apt-get install opencv-doc`).

    python -m experiments.benchmark_input [--images 256] [--batch 64] [--batches 24] \
        [--repeats 5] [--workers 1 2] [--transform train eval] [--photos DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import time
from pathlib import Path

from largebatch_jax import host

with host.plugin_noise_filtered():  # the accelerator plugins' loading banners on a CPU host
    import grain
    import numpy as np
    from PIL import Image

    from largebatch_jax.data import jpeg, loader, sources

# Real photographs where Debian's opencv-doc is installed (apt-get install opencv-doc):
# the sample images of OpenCV's examples, 256-1282 px a side.
PHOTOS = "/usr/share/doc/opencv-doc/examples/data"
CORES = sorted(os.sched_getaffinity(0))  # the cores this process may use, at start


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
    """images/s over `batches` batches after `warmup`; then the loader's threads or
    processes are stopped, so that none is left to run during the next measurement."""
    try:
        for _ in range(warmup):
            next(iterator)
        start = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return batches * batch / (time.perf_counter() - start)
    finally:
        if hasattr(iterator, "close"):
            iterator.close()


def ours_eval(images: list[bytes], workers: int, batch: int, batches: int, processes=False):
    aug = loader.default_augmentation(sources.SPECS["imagenet2012"], 224)
    repeat = -(-(batches + 2) * batch // len(images))
    it = loader.eval_batches(
        ListSource(images, repeat), aug, batch, **_decoders(workers, processes)
    )
    return time_batches(it, batches, batch)


def ours(images: list[bytes], workers: int, batch: int, batches: int, processes=False) -> float:
    aug = loader.default_augmentation(sources.SPECS["imagenet2012"], 224)
    it = loader.TrainLoader(
        ListSource(images, -(-batch // len(images))),
        aug,
        batch,
        seed=0,
        num_steps=(batches + 2) * 4,
        prefetch=2,
        **_decoders(workers, processes),
    )
    return time_batches(it, batches, batch)


def ours_processes(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    return ours(images, workers, batch, batches, processes=True)


def ours_eval_processes(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    return ours_eval(images, workers, batch, batches, processes=True)


def _decoders(workers: int, processes: bool) -> dict:
    """`workers` decoding threads in this process (as tf.data's), or `workers` grain
    processes of one thread each."""
    return dict(workers=workers, threads=1) if processes else dict(workers=0, threads=workers)


def tf_data(
    images: list[bytes], workers: int, batch: int, batches: int, train=True, float32=False
) -> float:
    """tf.data as the strongest CPU pipeline: the crop window decoded with
    `decode_and_crop_jpeg` (libjpeg-turbo skips what lies outside it), bilinear resize,
    flip, uint8 out (normalisation left to the device, as ours). `float32=True`: the
    Flax ImageNet example's, which normalises to float32 on the host."""
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
        return (image - mean) / std if float32 else tf.cast(image, tf.uint8)

    return _run_tf(tf, images, transform, workers, batch, batches)


def tf_data_eval(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    return tf_data(images, workers, batch, batches, train=False)


def tf_flax(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    return tf_data(images, workers, batch, batches, float32=True)


def tf_flax_eval(images: list[bytes], workers: int, batch: int, batches: int) -> float:
    return tf_data(images, workers, batch, batches, train=False, float32=True)


def _run_tf(tf, images, transform, workers: int, batch: int, batches: int) -> float:
    ds = tf.data.Dataset.from_tensor_slices(images).repeat()
    ds = ds.map(transform, num_parallel_calls=workers).batch(batch).prefetch(2)
    options = tf.data.Options()
    options.threading.private_threadpool_size = workers
    options.deterministic = True
    return time_batches(iter(ds.with_options(options)), batches, batch)


def real_photos(folder: str, minimum_side: int = 300) -> list[bytes]:
    """The JPEG photographs in `folder` whose longer side is at least `minimum_side`."""
    import simplejpeg

    photos = []
    for path in sorted(Path(folder).glob("*.jpg")):
        data = path.read_bytes()
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            continue
        if max(height, width) >= minimum_side:
            photos.append(data)
    return photos


def pin_to_cores(count: int) -> None:
    """Confine every thread of this process (and the processes it starts) to the first
    `count` cores, so that "per core" holds: tf.data's batching and prefetch threads and
    the main thread share the decoding workers' cores instead of using idle ones."""
    cores = set(CORES[:count])
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that has just ended
            os.sched_setaffinity(int(task.name), cores)


def processor() -> str:
    """The processor model, as /proc/cpuinfo names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def describe(name: str, images: list[bytes]) -> str:
    import simplejpeg

    sides = [simplejpeg.decode_jpeg_header(b)[:2] for b in images]
    long_sides = sorted(max(s) for s in sides)
    return (
        f"{name}: {len(images)} JPEGs, mean {np.mean([len(b) for b in images]) / 1024:.0f} KiB, "
        f"longer side {long_sides[0]}-{long_sides[-1]} px (median {long_sides[len(sides) // 2]})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.benchmark_input", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--transform", nargs="+", default=["train", "eval"])
    parser.add_argument(
        "--photos",
        default=PHOTOS,
        help="a folder of real JPEG photographs, also measured where it exists (default: "
        "the sample data of Debian's opencv-doc)",
    )
    args = parser.parse_args()
    with host.plugin_noise_filtered():  # TensorFlow's start-up banners
        import cv2
        import simplejpeg
        import tensorflow as tf

    sets = {"synthetic photos": synth_jpegs(args.images)}
    if args.photos and Path(args.photos).is_dir():
        sets["real photos"] = real_photos(args.photos)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} | {processor()}, "
        f"{len(CORES)} cores | TurboJPEG crop decode {jpeg.crop_decoder_available()}, "
        f"simplejpeg {simplejpeg.__version__}, opencv {cv2.__version__}, "
        f"tensorflow {tf.__version__}, grain {grain.__version__}"
    )
    print(
        f"batch {args.batch}, {args.batches} batches timed, median of {args.repeats} "
        "alternating repeats; the process pinned to `workers` cores; ratios ours / tf.data"
    )
    for name, images in sets.items():
        print(describe(name, images))
    print(
        f"{'images':>16} {'transform':>9} {'workers':>7} {'ours':>8} {'tf.data u8':>10} "
        f"{'ratio':>6} {'tf.data f32':>11} {'ratio':>6} {'ours procs':>10} {'ratio':>6}"
    )
    runs = {
        "train": (ours, tf_data, tf_flax, ours_processes),
        "eval": (ours_eval, tf_data_eval, tf_flax_eval, ours_eval_processes),
    }
    for name, images in sets.items():
        for transform in args.transform:
            for workers in args.workers:
                pin_to_cores(workers)
                rates: list[list[float]] = [[], [], [], []]
                for _ in range(args.repeats):
                    for fn, out in zip(runs[transform], rates, strict=True):
                        out.append(fn(images, workers, args.batch, args.batches))
                a, b, c, d = (statistics.median(r) for r in rates)
                print(
                    f"{name:>16} {transform:>9} {workers:>7} {a:>8.1f} {b:>10.1f} "
                    f"{a / b:>6.2f} {c:>11.1f} {a / c:>6.2f} {d:>10.1f} {d / b:>6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
