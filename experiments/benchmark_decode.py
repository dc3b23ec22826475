"""Decode-path candidates for rule 13's training transform, one image at a time on one
pinned core: which way of getting a 224 x 224 random-size crop out of a JPEG is fastest.

    python experiments/benchmark_decode.py [--images=64] [--repeats=5]

Every candidate does the same work per image: read the size, draw the crop window from
`example_rng` (the loader's draws), decode (all of it, or only the window where the
library can), resize the window to 224 x 224, uint8 out. Passes alternate between the
candidates; the median images/s of `--repeats` passes is printed. Optional candidates
run where their library is installed: TensorFlow (a dependency), OpenCV
(`pip install opencv-python-headless`), libjpeg-turbo's TurboJPEG 2.x/3.x C API
(`apt-get install libturbojpeg0`; its lossless crop `tjTransform` then a decode of the
cropped JPEG, through ctypes).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.benchmark_input import synth_jpegs
from largebatch_jax.data import transforms

SIZE = 224


def window(index: int, height: int, width: int) -> tuple[int, int, int, int]:
    return transforms.sample_crop_window(transforms.example_rng(0, 0, index), height, width)


def ours(index: int, data: bytes) -> np.ndarray:
    """The loader's path: PIL, DCT-domain scaling where the crop is >= 2x the output."""
    return transforms.train_transform_large(data, transforms.example_rng(0, 0, index), SIZE)


def pil_full(index: int, data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    top, left, h, w = window(index, image.size[1], image.size[0])
    box = (left, top, left + w, top + h)
    return np.asarray(image.resize((SIZE, SIZE), Image.BILINEAR, box=box))


def tensorflow_candidates() -> dict[str, Callable]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)

    @tf.function
    def crop_decode(data, crop):
        image = tf.io.decode_and_crop_jpeg(data, crop, channels=3)
        return tf.cast(tf.image.resize(image, (SIZE, SIZE)), tf.uint8)

    @tf.function
    def full_decode(data, crop):
        image = tf.io.decode_jpeg(data, channels=3)
        image = image[crop[0] : crop[0] + crop[2], crop[1] : crop[1] + crop[3]]
        return tf.cast(tf.image.resize(image, (SIZE, SIZE)), tf.uint8)

    def wrap(fn):
        def run(index, data):
            shape = tf.io.extract_jpeg_shape(data).numpy()
            crop = tf.constant(window(index, int(shape[0]), int(shape[1])))
            return fn(tf.constant(data), crop).numpy()

        return run

    return {
        "tf decode_and_crop_jpeg + resize": wrap(crop_decode),
        "tf decode_jpeg + crop + resize": wrap(full_decode),
    }


def opencv_candidates() -> dict[str, Callable]:
    import cv2

    cv2.setNumThreads(1)

    def wrap(interpolation):
        def run(index, data):
            image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
            top, left, h, w = window(index, *image.shape[:2])
            crop = image[top : top + h, left : left + w]
            return cv2.resize(crop, (SIZE, SIZE), interpolation=interpolation)

        return run

    return {
        "cv2 imdecode + crop + resize INTER_LINEAR (aliases)": wrap(cv2.INTER_LINEAR),
        "cv2 imdecode + crop + resize INTER_AREA": wrap(cv2.INTER_AREA),
    }


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _Transform(ctypes.Structure):
    _fields_ = [
        ("r", _Region),
        ("op", ctypes.c_int),
        ("options", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("customFilter", ctypes.c_void_p),
    ]


def turbojpeg_candidates() -> dict[str, Callable]:
    name = ctypes.util.find_library("turbojpeg")
    if name is None:
        raise OSError("libturbojpeg not found")
    lib = ctypes.CDLL(name)
    lib.tjInitTransform.restype = ctypes.c_void_p
    lib.tjDecompressHeader3.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_ulong] + [
        ctypes.POINTER(ctypes.c_int)
    ] * 4
    lib.tjTransform.argtypes = [
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.POINTER(_Transform),
        ctypes.c_int,
    ]
    lib.tjDecompress2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong]
    lib.tjDecompress2.argtypes += [ctypes.c_void_p] + [ctypes.c_int] * 5
    lib.tjFree.argtypes = [ctypes.c_void_p]
    handle = lib.tjInitTransform()
    mcu_w, mcu_h = (8, 16, 16, 8, 8, 32), (8, 8, 16, 8, 16, 8)  # per TJSAMP_*

    def run(index, data):
        w_, h_, sub, cs = (ctypes.c_int() for _ in range(4))
        args = (ctypes.byref(w_), ctypes.byref(h_), ctypes.byref(sub), ctypes.byref(cs))
        assert lib.tjDecompressHeader3(handle, data, len(data), *args) == 0
        top, left, h, w = window(index, h_.value, w_.value)
        # The lossless crop starts on an MCU boundary: crop from there, then the window.
        x0, y0 = (
            left // mcu_w[sub.value] * mcu_w[sub.value],
            top // mcu_h[sub.value] * mcu_h[sub.value],
        )
        t = _Transform()
        t.r.x, t.r.y, t.r.w, t.r.h = x0, y0, left + w - x0, top + h - y0
        t.options = 4  # TJXOPT_CROP
        out, size = ctypes.c_void_p(), ctypes.c_ulong()
        assert lib.tjTransform(handle, data, len(data), 1, out, size, t, 0) == 0
        pixels = np.empty((t.r.h, t.r.w, 3), np.uint8)
        assert lib.tjDecompress2(handle, out, size, pixels.ctypes.data, t.r.w, 0, t.r.h, 0, 0) == 0
        lib.tjFree(out)
        box = (left - x0, top - y0, left - x0 + w, top - y0 + h)
        return np.asarray(Image.fromarray(pixels).resize((SIZE, SIZE), Image.BILINEAR, box=box))

    return {"turbojpeg tjTransform crop + decode + PIL resize": run}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    images = synth_jpegs(args.images)
    candidates: dict[str, Callable] = {"ours (PIL, DCT scaling >= 2x)": ours}
    candidates["PIL full decode + crop + resize"] = pil_full
    for extra in (tensorflow_candidates, opencv_candidates, turbojpeg_candidates):
        try:
            candidates.update(extra())
        except (ImportError, OSError) as e:
            print(f"skipped {extra.__name__}: {type(e).__name__}: {e}")
    rates: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            started = time.perf_counter()
            for i, data in enumerate(images):
                fn(i, data)
            rates[name].append(len(images) / (time.perf_counter() - started))
    base = statistics.median(rates["ours (PIL, DCT scaling >= 2x)"])
    print(
        f"{args.images} JPEGs (500x375 / 375x500, q=90), one pinned core, median of "
        f"{args.repeats} alternating passes"
    )
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:55s} {rate:7.1f} images/s  ({rate / base:.2f} x ours)")


if __name__ == "__main__":
    main()
