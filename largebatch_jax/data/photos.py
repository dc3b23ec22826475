"""Photo-like JPEGs made on the spot, for tests and measurements that need real-size
images without a dataset: a smooth random colour field with pixel noise."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# ImageNet's sizes and kinds of JPEG (height, width, PIL mode): what the transforms'
# fidelity is measured and tested on.
TEST_IMAGES = [
    (48, 64, "RGB"),  # smaller than the output: upsampled
    (375, 500, "RGB"),  # ImageNet's typical sizes
    (500, 375, "L"),  # grayscale, portrait (ImageNet has some)
    (900, 1200, "RGB"),  # DCT-scaled 1/2 for large windows
    (900, 1200, "CMYK"),  # ImageNet has a few CMYK JPEGs: PIL decodes them
    (2000, 1500, "RGB"),  # portrait, scaled up to 1/8: the size rounds up (1500 / 8 -> 188)
]


def photo_jpeg(height: int, width: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """A JPEG (q=90) of a smooth random colour field, content up to 1/25 of the image a
    cycle, with noise of 12 grey levels (harsher for a downscale than real photos)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 25 + 2, width // 25 + 2, 3)).astype(np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), float)
    noisy = np.clip(field + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noisy).convert(mode).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
