"""Pixel fidelity of rule 13's transforms against a full decode + antialiased resize.

For each of the project's test images (`photos.TEST_IMAGES`: ImageNet's sizes, grayscale,
CMYK, portrait) and each output size, the eval window and 20 training windows (each with
its flip) go through:

- ours: libjpeg-turbo's decode of the window, DCT-scaled by the largest power of 2 that
  leaves it at least the output size, then one bilinear warp (no antialiasing);
- previous: the project's transform until 2026-12-06 (PIL's DCT-scaled draft decode, then
  PIL's antialiased bilinear resize);
- tf.data: the benchmark's baseline (`decode_and_crop_jpeg`, bilinear `tf.image.resize`
  without antialiasing, cast to uint8);

and each output is compared with the reference: PIL's full-resolution decode and its
antialiased bilinear resize of the same window, mirrored where the flip says. Prints
the mean over the outputs of their mean absolute difference, the worst output's mean
and the worst pixel, in grey levels.

    python -m experiments.input_fidelity [--sizes 224 64]
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image

from largebatch_jax import host
from largebatch_jax.data import photos, transforms


def windows(height: int, width: int, size: int) -> list[tuple[tuple, bool]]:
    out = [(transforms.center_window(height, width, size), False)]
    for i in range(20):
        rng = transforms.example_rng(0, 0, i)
        out.append((transforms.sample_crop_window(rng, height, width), bool(rng.random() < 0.5)))
    return out


def ours(encoded: bytes, window: tuple, size: int, flip: bool) -> np.ndarray:
    return transforms.decode_crop_resize(encoded, lambda h, w: window, size, lambda: flip)


def reference(encoded: bytes, window: tuple, size: int, flip: bool) -> np.ndarray:
    return transforms.decode_crop_resize(encoded, lambda h, w: window, size, lambda: flip, True)


def previous(encoded: bytes, window: tuple, size: int, flip: bool) -> np.ndarray:
    """PIL's draft decode at 1/r (r: the largest power of 2 with the window at least
    `size` a side), antialiased bilinear resize of the scaled window."""
    image = Image.open(io.BytesIO(encoded))
    full_w, full_h = image.size
    top, left, h, w = window
    reduce = min(h, w) // size
    if reduce >= 2:
        image.draft("RGB", (max(1, full_w // reduce), max(1, full_h // reduce)))
    scale = 1 / 2 ** round(np.log2(full_w / image.size[0]))
    box = (left * scale, top * scale, (left + w) * scale, (top + h) * scale)
    out = image.convert("RGB").resize((size, size), Image.BILINEAR, box=box)
    return np.asarray(out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out)


def tf_data(encoded: bytes, window: tuple, size: int, flip: bool) -> np.ndarray:
    import tensorflow as tf

    image = tf.io.decode_and_crop_jpeg(encoded, tf.constant(window, tf.int32), channels=3)
    image = tf.image.resize(image, (size, size), method="bilinear")
    image = tf.cast(image, tf.uint8).numpy()
    return image[:, ::-1] if flip else image


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.input_fidelity", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 64])
    args = parser.parse_args()
    with host.plugin_noise_filtered():  # TensorFlow's start-up banners (tf.data is compared)
        import tensorflow  # noqa: F401
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} | against PIL's full decode")
    print("grey levels: mean of the 21 outputs' mean / worst output's mean / worst pixel")
    candidates = {"ours": ours, "previous": previous, "tf.data": tf_data}
    print(f"{'image':>19} {'size':>4} " + " ".join(f"{n:>20}" for n in candidates))
    for height, width, mode in photos.TEST_IMAGES:
        encoded = photos.photo_jpeg(height, width, mode)
        for size in args.sizes:
            cells = []
            for fn in candidates.values():
                means, worst = [], 0
                try:
                    for window, flip in windows(height, width, size):
                        a = fn(encoded, window, size, flip).astype(int)
                        gap = np.abs(a - reference(encoded, window, size, flip))
                        means.append(gap.mean())
                        worst = max(worst, int(gap.max()))
                    cells.append(f"{np.mean(means):.2f} / {max(means):.2f} / {worst:>3}")
                except Exception as e:  # tf.data may refuse an image (CMYK)
                    cells.append(f"{type(e).__name__:>20}")
            name = f"{height}x{width} {mode}"
            print(f"{name:>19} {size:>4} " + " ".join(f"{c:>20}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
