"""Paper rule 13: train and eval transforms, on the host in numpy / PIL.

They hand out uint8 pixels (4x fewer bytes to copy between processes and to the devices
than float32); the per-channel mean/std normalisation of rule 13 runs inside the jitted
step on the device (`step.PixelNormalization`). Every random draw comes from
`example_rng(seed, epoch, index)`, so an image's augmentation depends only on the run's
seed, the epoch and the image, never on how many processes or decoding workers there are.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

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


def decode_crop_resize(
    encoded: bytes | np.ndarray,
    window_fn,
    size: int,
    flip=None,
    dct_scaling: bool = True,
) -> np.ndarray:
    """Decode an image, crop the window `window_fn(h, w)` picks, resize to size x size.

    For JPEGs, PIL's draft mode decodes at the largest power-of-2 reduction (libjpeg's
    DCT-domain scaling) that still leaves the crop at least `size` pixels a side, so a
    crop of a large photo never pays for a full-resolution decode; `dct_scaling=False`
    always decodes at full size (the reference the tests compare with).
    """
    if isinstance(encoded, np.ndarray):
        image = Image.fromarray(encoded.squeeze(-1) if encoded.shape[-1] == 1 else encoded)
        full_w, full_h = image.size
        top, left, h, w = window_fn(full_h, full_w)
        sx = sy = 1.0
    else:
        image = _open(encoded)
        full_w, full_h = image.size
        top, left, h, w = window_fn(full_h, full_w)
        reduce = min(h, w) // size
        # (draft() at scale 1 would only cost time)
        if dct_scaling and image.format == "JPEG" and reduce >= 2:
            image.draft("RGB", (max(1, full_w // reduce), max(1, full_h // reduce)))
        # libjpeg scales by exactly 1/r (r a power of 2) and rounds the size up (1500 / 8
        # -> 188 pixels, the last one a part block): the box scales by 1/r, not size/full.
        r = 2 ** round(math.log2(full_w / image.size[0]))
        sx = sy = 1.0 / r
    if isinstance(encoded, bytes | bytearray) and image.mode != "RGB":
        image = image.convert("RGB")  # ImageNet has grayscale (and CMYK) JPEGs
    box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    out = image.resize((size, size), Image.BILINEAR, box=box)
    if flip is not None and flip():  # in PIL: a numpy flip + copy costs 10x more
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    array = np.asarray(out)
    return array[..., None] if array.ndim == 2 else array


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
    encoded: bytes | np.ndarray, size: int, dct_scaling: bool = True
) -> np.ndarray:
    """Rule 13 evaluation: shorter side to 256 (for size 224), centre crop 224 (uint8)."""
    window = lambda h, w: center_window(h, w, size)  # noqa: E731
    return decode_crop_resize(encoded, window, size, dct_scaling=dct_scaling)


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
