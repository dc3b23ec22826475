"""JPEG decoding by libjpeg-turbo: a region of the image, at 1/1, 1/2, 1/4 or 1/8 scale.

Two decoders give the same pixels, bit for bit (`tests/test_data.py`):

- the TurboJPEG 3 API (`tj3SetCroppingRegion`, through ctypes, which releases the GIL),
  which runs the inverse DCT and colour conversion only inside the region and stops
  decoding after its last row. Its library comes from the `turbojpeg` wheel (a
  dependency on Linux x86-64) or the system (`libturbojpeg0` on Debian / Ubuntu);
- simplejpeg's whole-image decode, cut to the region, where no such library is found.

libjpeg-turbo's fancy upsampling makes a region's outermost row and column differ from
the whole image's; the region asked for keeps a margin (`MARGIN`) beyond what the
caller needs, so the pixels handed out never include them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import importlib.util
import threading
from pathlib import Path

import numpy as np

# Extra pixels decoded on each side of a region (clamped to the image) and then cut off:
# one keeps the upsampling edge out (measured), the second is headroom.
MARGIN = 2
# TurboJPEG's subsampling codes -> the width of an iMCU, the unit a region starts on.
_IMCU_WIDTH = {0: 8, 1: 16, 2: 16, 3: 8, 4: 8, 5: 32, 6: 8}
_COLORSPACES = {0: "RGB", 1: "YCbCr", 2: "Gray", 3: "CMYK", 4: "YCCK"}
_TJINIT_DECOMPRESS, _TJPF_RGB, _TJPARAM_STOPONWARNING = 1, 0, 0
_TJPARAM_SUBSAMP, _TJPARAM_WIDTH, _TJPARAM_HEIGHT, _TJPARAM_COLORSPACE = 4, 5, 6, 8


@dataclasses.dataclass(frozen=True)
class Header:
    height: int
    width: int
    colorspace: str  # "YCbCr", "Gray", "RGB" decode here; "CMYK", "YCCK" do not
    imcu_width: int | None  # None: a subsampling TurboJPEG cannot crop


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _Scale(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


def _candidates() -> list[str]:
    """Where a libturbojpeg may be: the `turbojpeg` wheel's bundled copy, the system's."""
    paths = []
    spec = importlib.util.find_spec("turbojpeg")
    if spec is not None and spec.origin:
        site = Path(spec.origin).parent
        paths += sorted(str(p) for p in (site / "turbojpeg.libs").glob("libturbojpeg*.so*"))
    system = ctypes.util.find_library("turbojpeg")
    return paths + ([system] if system else [])


@functools.cache
def _library() -> ctypes.CDLL | None:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "tj3SetCroppingRegion"):  # TurboJPEG 3 API (libjpeg-turbo >= 3)
            lib.tj3Init.restype = ctypes.c_void_p
            lib.tj3Init.argtypes = [ctypes.c_int]
            buffer = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            lib.tj3DecompressHeader.argtypes = buffer
            lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.tj3Set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.tj3SetScalingFactor.argtypes = [ctypes.c_void_p, _Scale]
            lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
            lib.tj3Decompress8.argtypes = [*buffer, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            return lib
    return None


def crop_decoder_available() -> bool:
    """Whether regions are decoded by TurboJPEG's crop decode (else whole, then cut)."""
    return _library() is not None


@functools.cache
def _simplejpeg():
    """Imported on first use: what imports the data modules without decoding (the
    compile tools) needs no decoder."""
    import simplejpeg

    return simplejpeg


_THREAD = threading.local()


def _handle(lib: ctypes.CDLL) -> int:
    """This thread's decompressor (a TurboJPEG handle is not shared between threads)."""
    handle = getattr(_THREAD, "handle", None)
    if handle is None:
        handle = _THREAD.handle = lib.tj3Init(_TJINIT_DECOMPRESS)
        # A warning (truncated or corrupt data) fails, as simplejpeg's strict mode does.
        lib.tj3Set(handle, _TJPARAM_STOPONWARNING, 1)
    return handle


def header(encoded: bytes) -> Header | None:
    """The JPEG's size and colour space; None for anything libjpeg-turbo does not read."""
    lib = _library()
    if lib is None:
        try:
            height, width, colorspace, _ = _simplejpeg().decode_jpeg_header(encoded)
        except ValueError:
            return None
        return Header(height, width, colorspace, None)
    handle = _handle(lib)
    if lib.tj3DecompressHeader(handle, encoded, len(encoded)):
        return None
    get = functools.partial(lib.tj3Get, handle)
    return Header(
        get(_TJPARAM_HEIGHT),
        get(_TJPARAM_WIDTH),
        _COLORSPACES.get(get(_TJPARAM_COLORSPACE), "unknown"),
        _IMCU_WIDTH.get(get(_TJPARAM_SUBSAMP)),
    )


def scaled_size(head: Header, r: int) -> tuple[int, int]:
    """(height, width) of the image decoded at 1/r: libjpeg rounds up."""
    return -(-head.height // r), -(-head.width // r)


def decode_region(
    encoded: bytes,
    head: Header,
    r: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    crop_decode: bool = True,
) -> np.ndarray | None:
    """RGB uint8 pixels [rows[0]:rows[1], cols[0]:cols[1]] of the image decoded at 1/r
    (coordinates at that scale); None where libjpeg-turbo reports an error or a warning
    (a truncated or corrupt file: the caller lets PIL decode it or say why not).
    `crop_decode=False`: the whole-image decode, cut (the reference for tests)."""
    height, width = scaled_size(head, r)
    y0, x0 = max(rows[0] - MARGIN, 0), max(cols[0] - MARGIN, 0)
    y1, x1 = min(rows[1] + MARGIN, height), min(cols[1] + MARGIN, width)
    lib = _library() if crop_decode else None
    if lib is None or head.imcu_width is None:
        try:
            pixels = _simplejpeg().decode_jpeg(encoded, "RGB", min_height=height, min_width=width)
        except ValueError:
            return None
        return pixels[rows[0] : rows[1], cols[0] : cols[1]]
    handle = _handle(lib)
    step = -(-head.imcu_width // r)  # a region starts on a (scaled) iMCU column
    x0 = x0 // step * step
    out = np.empty((y1 - y0, x1 - x0, 3), np.uint8)
    pitch = out.strides[0]
    failed = (
        lib.tj3DecompressHeader(handle, encoded, len(encoded))
        or lib.tj3SetScalingFactor(handle, _Scale(1, r))
        or lib.tj3SetCroppingRegion(handle, _Region(x0, y0, x1 - x0, y1 - y0))
        or lib.tj3Decompress8(handle, encoded, len(encoded), out.ctypes.data, pitch, _TJPF_RGB)
    )
    if failed:
        return None
    return out[rows[0] - y0 : rows[1] - y0, cols[0] - x0 : cols[1] - x0]
