"""A convolution whose kernel gradient is computed as matrix products (an XLA:CPU option).

The kernel gradient (the "weight gradient") as one matrix product per kernel tap: the
sum over (batch, output pixel) of input[tap] x output-gradient. The forward and the input
gradient are XLA's own. Same math, summed in another order: results agree to float
rounding. It was written when XLA:CPU's kernel gradients looked very slow; most of that
turned out to be the model running inside `lax.scan` (see `parallel.resolve_accum_loop`).
Measured 2026-12-03 in plain jit code (jax 0.10.2, 1 CPU device), a 3x3 16->16 conv on
256 x 28x28: XLA's kernel gradient 66 ms, this one 88 ms; whole steps: XLA's faster for
ResNet-8/20, this one 1.15x for ResNet-50 at 64x64. So `conv_impl='xla'` is the default
and this an option.

`conv_general_dilated` has the signature flax's `nn.Conv(conv_general_dilated=...)`
expects; anything it does not handle (dilation, feature groups, other layouts) goes to
`lax.conv_general_dilated` unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_NHWC = lax.ConvDimensionNumbers(
    lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2)
)


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """`lax.conv_general_dilated`, with the kernel gradient as per-tap matrix products
    for 2-D NHWC/HWIO convolutions with explicit padding (what our ResNets use)."""
    plain = (
        lhs.ndim == 4
        and not isinstance(padding, str)
        and all(d == 1 for d in (lhs_dilation or (1, 1)))
        and all(d == 1 for d in (rhs_dilation or (1, 1)))
        and feature_group_count == 1
        and batch_group_count == 1
        and preferred_element_type is None
        and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == _NHWC
    )
    if not plain:
        return lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            batch_group_count,
            precision,
            preferred_element_type,
        )
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    return _conv(lhs, rhs, tuple(int(s) for s in window_strides), pads, precision)


def _xla_conv(x, w, strides, pads, precision):
    return lax.conv_general_dilated(
        x, w, strides, pads, dimension_numbers=_NHWC, precision=precision
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv(x, w, strides, pads, precision):
    return _xla_conv(x, w, strides, pads, precision)


def _conv_fwd(x, w, strides, pads, precision):
    return _xla_conv(x, w, strides, pads, precision), (x, w)


def _conv_bwd(strides, pads, precision, residuals, g):
    x, w = residuals
    _, input_vjp = jax.vjp(lambda x_: _xla_conv(x_, w, strides, pads, precision), x)
    (dx,) = input_vjp(g)
    return dx, kernel_gradient(x, g, w.shape, strides, pads, precision)


_conv.defvjp(_conv_fwd, _conv_bwd)


def kernel_gradient(
    x: jax.Array,
    g: jax.Array,
    kernel_shape: Sequence[int],
    strides: Sequence[int],
    pads: Sequence[tuple[int, int]],
    precision: Any = None,
) -> jax.Array:
    """d loss / d kernel [kh, kw, c_in, c_out] of an NHWC conv: for each tap (i, j), the
    strided window of the padded input that tap saw, [N*Ho*Wo, c_in], transposed times
    the output gradient [N*Ho*Wo, c_out]."""
    kh, kw, c_in, c_out = kernel_shape
    (sh, sw), ((ph0, ph1), (pw0, pw1)) = strides, pads
    n, ho, wo, _ = g.shape
    xp = jnp.pad(x, ((0, 0), (ph0, ph1), (pw0, pw1), (0, 0)))
    g2 = g.reshape(n * ho * wo, c_out)
    taps = []
    for i in range(kh):
        for j in range(kw):
            window = lax.slice(
                xp,
                (0, i, j, 0),
                (n, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1, c_in),
                (1, sh, sw, 1),
            )
            taps.append(
                jnp.dot(
                    window.reshape(n * ho * wo, c_in).T,
                    g2,
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
            )
    return jnp.stack(taps).reshape(kh, kw, c_in, c_out).astype(x.dtype)
