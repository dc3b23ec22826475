"""The ImageNet stem's 3x3 / stride 2 max-pool, with a gradient that needs no scatter.

XLA differentiates `reduce_window(max)` into a select-and-scatter, which XLA's GPU
compiler rewrites into a scatter of the stem's whole activation (32 x 114 x 114 x 64
values per device for ResNet-50 at 32 images): atomic adds, so not run-to-run
deterministic, and under `--xla_gpu_deterministic_ops` (the exact mode on GPU) XLA makes
it deterministic by sorting its 6.4 million indices every step (README, "Compiled for
NVIDIA GPUs"). `impl='slices'` computes the same numbers from the nine strided window
slices: the forward is their maximum, the gradient goes to the first maximum of each
window in row-major order (the element select-and-scatter picks, with `>=`), and the
contributions of overlapping windows are added in a fixed order of the nine offsets,
by padding, never scattering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax

POOL_IMPLS = ("xla", "slices")
WINDOW, STRIDE, PAD = 3, 2, 1


def max_pool(x: jax.Array, impl: str = "xla") -> jax.Array:
    """3x3 max-pool, stride 2, one pixel of -inf padding on each side, NHWC."""
    if impl == "xla":
        return nn.max_pool(
            x, (WINDOW, WINDOW), strides=(STRIDE, STRIDE), padding=((PAD, PAD), (PAD, PAD))
        )
    if impl != "slices":
        raise ValueError(f"pool_impl={impl!r} is not one of {POOL_IMPLS}.")
    return _sliced_max_pool(x)


def _offsets() -> list[tuple[int, int]]:
    return [(i, j) for i in range(WINDOW) for j in range(WINDOW)]


def _windows(padded: jax.Array, out_h: int, out_w: int) -> list[jax.Array]:
    """The nine [B, out_h, out_w, C] slices: element k of window (r, c) of each."""
    b, _, _, c = padded.shape
    return [
        lax.slice(
            padded,
            (0, i, j, 0),
            (b, i + STRIDE * (out_h - 1) + 1, j + STRIDE * (out_w - 1) + 1, c),
            (1, STRIDE, STRIDE, 1),
        )
        for i, j in _offsets()
    ]


def _pad(x: jax.Array) -> jax.Array:
    return jnp.pad(x, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)), constant_values=-jnp.inf)


def _out_size(n: int) -> int:
    return (n + 2 * PAD - WINDOW) // STRIDE + 1


@jax.custom_vjp
def _sliced_max_pool(x: jax.Array) -> jax.Array:
    _, h, w, _ = x.shape
    return functools.reduce(jnp.maximum, _windows(_pad(x), _out_size(h), _out_size(w)))


def _forward(x):
    y = _sliced_max_pool(x)
    return y, (x, y)


def _backward(residuals, g):
    x, y = residuals
    b, h, w, c = x.shape
    oh, ow = _out_size(h), _out_size(w)
    padded_h, padded_w = h + 2 * PAD, w + 2 * PAD
    taken = jnp.zeros(y.shape, bool)
    grad = jnp.zeros((b, padded_h, padded_w, c), g.dtype)
    zero = jnp.zeros((), g.dtype)
    for (i, j), window in zip(_offsets(), _windows(_pad(x), oh, ow), strict=True):
        first = (window == y) & ~taken
        taken = taken | first
        # Window (r, s)'s element (i, j) sits at padded pixel (2r + i, 2s + j): spread
        # the windows' gradients STRIDE apart (interior padding), shifted by (i, j).
        spread = lax.pad(
            jnp.where(first, g, zero),
            zero,
            (
                (0, 0, 0),
                (i, padded_h - i - STRIDE * (oh - 1) - 1, STRIDE - 1),
                (j, padded_w - j - STRIDE * (ow - 1) - 1, STRIDE - 1),
                (0, 0, 0),
            ),
        )
        grad = grad + spread
    return (grad[:, PAD : PAD + h, PAD : PAD + w, :],)


_sliced_max_pool.defvjp(_forward, _backward)
