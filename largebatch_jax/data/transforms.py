"""Paper rule 13: train and eval transforms, on the host: JPEGs decoded by libjpeg-turbo
(`jpeg`: only the window, DCT-scaled), crops resized by OpenCV, anything else by PIL.

They hand out uint8 pixels (4x fewer bytes to copy between processes and to the devices
than float32); the per-channel mean/std normalisation of rule 13 runs inside the jitted
step on the device (`step.PixelNormalization`). Every random draw comes from
`example_rng(seed, epoch, index)`, so an image's augmentation depends only on the run's
seed, the epoch and the image, never on how many processes or decoding workers there are.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable

import numpy as np
from PIL import Image

from largebatch_jax.data import jpeg

# fb.resnet.torch's lighting noise (PCA of ImageNet RGB, pixel values in [0, 1]).
PCA_EIGVAL = np.array([0.2175, 0.0188, 0.0045])
PCA_EIGVEC = np.array(
    [[-0.5675, 0.7192, 0.4009], [-0.5808, -0.0045, -0.8140], [-0.5836, -0.6948, 0.4203]]
)
EVAL_RESIZE_RATIO = 256 / 224


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random stream of one image in one epoch (independent of worker layout)."""
    return np.random.default_rng([seed, epoch, index])


def sample_crop_window(
    rng: np.random.Generator,
    height: int,
    width: int,
    area_range: tuple[float, float] = (0.08, 1.0),
    ratio_range: tuple[float, float] = (3 / 4, 4 / 3),
    attempts: int = 10,
) -> tuple[int, int, int, int]:
    """Paper rule 13, random-size crop: a window of 8%-100% of the image area with aspect
    ratio (w/h) in [3/4, 4/3] (uniform, as fb.resnet.torch), 10 tries, then the
    centre crop of the largest window with an allowed ratio. Returns (top, left, h, w)."""
    area = height * width
    for _ in range(attempts):
        target = rng.uniform(*area_range) * area
        ratio = rng.uniform(*ratio_range)
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    ratio = width / height
    if ratio < ratio_range[0]:
        w, h = width, min(height, round(width / ratio_range[0]))
    elif ratio > ratio_range[1]:
        h, w = height, min(width, round(height * ratio_range[1]))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


# What PIL raises for a file that is not a decodable image (truncated, another format
# under a .jpg name, a text file): the loader turns them into one line naming the record.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
# libjpeg's DCT-domain downscaling: only these reductions are faster than a full decode
# (simplejpeg, the benchmark's 500x375 JPEGs, one core, 2026-12-06: 1/1 1207 images/s,
# 7/8 702, 3/4 about 845, 1/2 1384, 1/4 1495, 1/8 1680).
DCT_REDUCTIONS = (8, 4, 2)


def _open(encoded: bytes) -> Image.Image:
    return Image.open(io.BytesIO(encoded))


def decode_error(encoded: bytes) -> str | None:
    """Why `encoded` does not decode as an image (as the transforms decode it), or None."""
    try:
        with _open(encoded) as image:
            image.load()
    except DECODE_ERRORS as e:
        text = str(e)
        return type(e).__name__ + ("" if "BytesIO" in text or not text else f": {text}")
    return None


def _pil_rgb(encoded: bytes) -> Image.Image:
    image = _open(encoded)
    if image.mode.startswith("I"):  # 16-bit grayscale (a PNG): PIL's convert would clip it
        image = Image.fromarray((np.clip(np.asarray(image), 0, 65535) >> 8).astype(np.uint8))
    return image if image.mode == "RGB" else image.convert("RGB")  # grayscale, CMYK


def _reduction(window: tuple, size: int) -> int:
    """The largest power of 2, up to 8, that leaves the window at least `size` a side."""
    side = min(window[2:]) // size
    return next((r for r in DCT_REDUCTIONS if side >= r), 1)


def _box_factor(h: float, w: float, size: int) -> int:
    """k for `_resample`'s k x k box average: 1 while the warp downscales the shorter
    side by less than 2; else the factor that brings it under 2 (only a window over 16x
    the output size, beyond libjpeg's 1/8, needs one). The same k on both axes: OpenCV's
    k x k box average is 20x faster than one with two different factors."""
    return int(min(h, w) // size) if min(h, w) >= 2 * size else 1


def _reach(start: float, length: float, limit: int, k: int) -> tuple[int, int]:
    """The pixels [lo, hi) that `_resample` of [start, start + length) can read (the warp's
    two neighbours, one more for fixed-point rounding, each k pixels wide after a k x k
    box average, one more block for its alignment), within [0, limit)."""
    margin = 4 * k
    return max(math.floor(start) - margin, 0), min(math.ceil(start + length) + margin, limit)


def _decode(encoded: bytes, window_fn: Callable, size: int) -> tuple[np.ndarray, tuple]:
    """The pixels around the window `window_fn(h, w)` picks, decoded at 1/r of the
    image's size (`_reduction`), and the window in their coordinates (fractional).
    A JPEG (YCbCr, grayscale) goes through libjpeg-turbo, which scales in the DCT domain
    and decodes only the rows and columns the resample reads (`jpeg.decode_region`);
    anything else (PNG, CMYK, a JPEG libjpeg-turbo refuses) is decoded whole by PIL,
    whose errors then name what is wrong, and box-averaged r x r."""
    head = jpeg.header(encoded)
    image = None
    if head is None or head.colorspace not in ("YCbCr", "Gray", "RGB"):
        image = _pil_rgb(encoded)
        full_w, full_h = image.size
    else:
        full_h, full_w = head.height, head.width
    window = window_fn(full_h, full_w)  # once: it draws from the image's random stream
    r = _reduction(window, size)
    top, left, h, w = (v / r for v in window)
    if image is None:
        height, width = jpeg.scaled_size(head, r)
        k = _box_factor(h, w, size)
        rows, cols = _reach(top, h, height, k), _reach(left, w, width, k)
        pixels = jpeg.decode_region(encoded, head, r, rows, cols)
        if pixels is not None:
            return pixels, (top - rows[0], left - cols[0], h, w)
        image = _pil_rgb(encoded)  # libjpeg-turbo's error: PIL decodes it, or says why not
    return np.asarray(image.reduce(r) if r > 1 else image), (top, left, h, w)


def _resample(pixels: np.ndarray, box: tuple, size: int, flip: bool) -> np.ndarray:
    """The box (top, left, h, w, in `pixels`' coordinates, fractional) resized to size x
    size by bilinear interpolation without antialiasing (OpenCV's INTER_LINEAR, as the
    paper's Caffe2 pipeline and tf.data resize), mirrored if `flip`: one affine warp
    sampling at pixel centres, edges replicated; where it would downscale by 2 or more,
    after a k x k box average (`_box_factor`) that leaves the shorter side's under 2."""
    top, left, h, w = box
    cv2 = _cv2()
    k = _box_factor(h, w, size)
    if k > 1:
        rows, cols = pixels.shape[0] // k, pixels.shape[1] // k
        pixels = cv2.resize(
            pixels[: rows * k, : cols * k], (cols, rows), interpolation=cv2.INTER_AREA
        )
        top, left, h, w = top / k, left / k, h / k, w / k
    sx, sy = w / size, h / size
    row = [-sx, 0.0, left + w - 0.5 * sx - 0.5] if flip else [sx, 0.0, left + 0.5 * sx - 0.5]
    matrix = np.array([row, [0.0, sy, top + 0.5 * sy - 0.5]])
    out = cv2.warpAffine(
        pixels,
        matrix,
        (size, size),
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )
    return out[..., None] if out.ndim == 2 else out


@functools.cache
def _cv2():
    """OpenCV, imported on first use (what imports the data modules without decoding,
    such as the compile tools, needs no OpenCV), single-threaded: the loader
    parallelises over images."""
    import cv2

    cv2.setNumThreads(1)
    return cv2


def decode_crop_resize(
    encoded: bytes | np.ndarray,
    window_fn: Callable[[int, int], tuple[int, int, int, int]],
    size: int,
    flip: Callable[[], bool] | None = None,
    reference: bool = False,
) -> np.ndarray:
    """Decode an image, crop the window `window_fn(h, w)` picks, resize to size x size,
    mirrored where `flip()` says: libjpeg-turbo's decode (DCT-scaled where the window
    is at least twice `size`, `_decode`) and one bilinear warp (`_resample`).
    `reference=True`: PIL's full-resolution decode and its antialiased bilinear resize,
    the reference the fidelity tests and measurements compare with."""
    if isinstance(encoded, np.ndarray):  # decoded pixels (tfds image features)
        pixels, box = encoded, window_fn(*encoded.shape[:2])
    elif reference:
        image = _pil_rgb(encoded)
        top, left, h, w = window_fn(image.size[1], image.size[0])
        out = image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
        if flip is not None and flip():
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(out)
    else:
        pixels, box = _decode(encoded, window_fn, size)
    return _resample(pixels, box, size, flip is not None and flip())


def color_jitter(rng: np.random.Generator, image: np.ndarray, strength: float = 0.4) -> np.ndarray:
    """fb.resnet.torch's colour jitter (not in the paper; off by default): brightness,
    contrast and saturation, each by a factor in [1-s, 1+s], in random order. Input and
    output float32 in [0, 255]."""
    gray = image @ np.array([0.299, 0.587, 0.114], np.float32)
    for op in rng.permutation(3):
        alpha = np.float32(1.0 + rng.uniform(-strength, strength))
        if op == 0:  # brightness: blend with black
            image = image * alpha
        elif op == 1:  # contrast: blend with the mean grey level
            image = image * alpha + (1 - alpha) * gray.mean()
        else:  # saturation: blend with the grey image
            image = image * alpha + (1 - alpha) * gray[..., None]
        gray = image @ np.array([0.299, 0.587, 0.114], np.float32)
    return image


def pca_lighting(rng: np.random.Generator, image: np.ndarray, alpha_std: float = 0.1) -> np.ndarray:
    """AlexNet / fb.resnet.torch PCA lighting noise (not in the paper; off by default)."""
    alpha = rng.normal(0.0, alpha_std, 3)
    shift = PCA_EIGVEC @ (alpha * PCA_EIGVAL) * 255.0
    return image + shift.astype(np.float32)


def train_transform_large(
    encoded: bytes | np.ndarray,
    rng: np.random.Generator,
    size: int,
    color_augment: bool = False,
) -> np.ndarray:
    """Rule 13 for ImageNet-style data: random-size crop to size x size, horizontal flip
    with probability 1/2 (normalisation follows on the device). uint8; float32 pixels in
    [0, 255] with the optional colour jitter + lighting, which are not whole numbers."""
    flip = None  # drawn after the crop window, so the stream of draws is crop, flip

    def window(h, w):
        nonlocal flip
        crop = sample_crop_window(rng, h, w)
        flip = rng.random() < 0.5
        return crop

    image = decode_crop_resize(encoded, window, size, flip=lambda: flip)
    if color_augment:
        return pca_lighting(rng, color_jitter(rng, image.astype(np.float32)))
    return image


def center_window(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """The window that 'resize the shorter side to size * 256/224, centre crop size'
    selects, in original-image coordinates."""
    crop = round(min(height, width) * size / round(size * EVAL_RESIZE_RATIO))
    return (height - crop) // 2, (width - crop) // 2, crop, crop


def eval_transform_large(
    encoded: bytes | np.ndarray, size: int, reference: bool = False
) -> np.ndarray:
    """Rule 13 evaluation: shorter side to 256 (for size 224), centre crop 224 (uint8);
    `reference`: through `decode_crop_resize`'s reference path."""
    window = lambda h, w: center_window(h, w, size)  # noqa: E731
    return decode_crop_resize(encoded, window, size, reference=reference)


def small_image_transform(
    image: np.ndarray,
    rng: np.random.Generator | None,
    size: int,
    pad_crop: int = 0,
    flip: bool = False,
) -> np.ndarray:
    """Small fixed-size images (CIFAR, Fashion-MNIST): the CIFAR recipe when asked
    (zero-pad `pad_crop`, random crop back, flip) at the scale of `size`; `rng=None` is
    evaluation, no randomness. Stays uint8 at the native resolution: the downscale to
    `size` by box averaging (e.g. 28 -> 14, whose means are not whole numbers) runs on
    the device (`step.PixelNormalization`). Padding by `pad_crop * f` and cropping at
    multiples of f before an f x f box average is the same as after it."""
    native = image.shape[0]
    factor = native // size
    if factor * size != native:
        raise ValueError(f"image_size={size} must divide the native size {native}.")
    if rng is not None:
        if pad_crop:
            p = pad_crop * factor
            padded = np.pad(image, ((p, p), (p, p), (0, 0)))
            top, left = rng.integers(0, 2 * pad_crop + 1, size=2) * factor
            image = padded[top : top + native, left : left + native]
        if flip and rng.random() < 0.5:
            image = image[:, ::-1]
    return np.ascontiguousarray(image)
