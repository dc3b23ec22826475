"""BatchNorm over groups of n examples: paper rule 9 (per-worker statistics).

In the paper each of the k workers normalises with the statistics of its own n images;
nothing is reduced across workers. Here a device may host several virtual workers (its
local batch is cut into consecutive groups of `group_size`), so the statistics, and
hence the update, depend only on n, never on how many devices run the job.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn


def check_group_size(local_batch: int, group_size: int) -> None:
    """The local batch must split into whole BN groups (a worker has exactly n images)."""
    if group_size <= 0:
        raise ValueError(f"bn_group_size={group_size} must be > 0.")
    if group_size > local_batch:
        raise ValueError(
            f"bn_group_size={group_size} is larger than the per-device micro-batch "
            f"{local_batch}: lower bn_group_size or raise batch_size per device."
        )
    if local_batch % group_size:
        raise ValueError(
            f"bn_group_size={group_size} does not divide the per-device micro-batch "
            f"{local_batch}: choose a divisor of {local_batch}."
        )


def _grouped(x: jax.Array, group_size: int) -> jax.Array:
    """x [batch, ..., features] as float32 [groups, group_size, ..., features].

    The spatial axes stay axes: with them flattened into one n*H*W axis, XLA:CPU ran
    ResNet-50's forward and backward 1.36x slower at 224x224 (1 device, 4 images; 1970
    against 1434 ms, measured as `experiments/benchmark_model.py` does, 2026-12-04)."""
    return x.astype(jnp.float32).reshape(x.shape[0] // group_size, group_size, *x.shape[1:])


def _per_group(stat: jax.Array, ndim: int) -> jax.Array:
    """[groups, features] broadcastable against `_grouped`'s [groups, n, ..., features]."""
    return stat.reshape(stat.shape[0], *(1,) * (ndim - 2), stat.shape[-1])


def group_moments(x: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """Paper rule 9: mean and (biased) variance of each group of `group_size` examples.

    x is [batch, ..., features]; returns two [batch // group_size, features] arrays,
    computed in float32 whatever the input dtype.

    The variance is E[x^2] - E[x]^2 (as flax's BatchNorm and `synced_moments` compute it):
    both sums come from one read of the activations, forward and backward, where the
    two-pass E[(x - E[x])^2] reads them twice; on a TPU that made the ResNet-50 step move
    13% more bytes than the reference's (`largebatch_jax.aot`). Same math; the float32
    rounding differs only where |mean| >> std, which BN inputs are not.
    """
    check_group_size(x.shape[0], group_size)
    xg = _grouped(x, group_size)
    axes = tuple(range(1, xg.ndim - 1))
    mean = jnp.mean(xg, axis=axes)
    mean_sq = jnp.mean(jnp.square(xg), axis=axes)
    return mean, jnp.maximum(mean_sq - jnp.square(mean), 0.0)


def synced_moments(x: jax.Array, axis_name: str) -> tuple[jax.Array, jax.Array]:
    """Statistics over the whole batch of every device on `axis_name` (the Flax-example
    behaviour, *not* the paper's; kept for the ablation). Returns [1, features]."""
    xf = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    mean = jax.lax.pmean(jnp.mean(xf, axis=0), axis_name)
    mean_sq = jax.lax.pmean(jnp.mean(jnp.square(xf), axis=0), axis_name)
    return mean[None], jnp.maximum(mean_sq - jnp.square(mean), 0.0)[None]


class BatchNorm(nn.Module):
    """BatchNorm whose training statistics come from groups of `group_size` examples.

    Attributes:
      group_size: n, images per BN group (`bn_group_size`); ignored when `axis_name` is set.
      momentum: running-average momentum (the paper's 0.9).
      epsilon: added to the variance.
      axis_name: if set, synchronise statistics over this mapped axis instead of groups.
      scale_init: gamma's initialiser (zeros for the last BN of a residual block).
      dtype: output dtype; statistics and parameters stay float32.
    """

    group_size: int
    momentum: float = 0.9
    epsilon: float = 1e-5
    axis_name: str | None = None
    scale_init: Any = nn.initializers.ones
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, use_running_average: bool) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", self.scale_init, (features,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,), jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, (features,), jnp.float32)

        if use_running_average:
            y = (x.astype(jnp.float32) - ra_mean.value) * jax.lax.rsqrt(ra_var.value + self.epsilon)
            return (y * scale + bias).astype(self.dtype)

        if self.axis_name is not None:
            mean, var = synced_moments(x, self.axis_name)
        else:
            mean, var = group_moments(x, self.group_size)
        if not self.is_initializing():
            # Linear in the statistics, so the mean over groups equals the mean of the
            # groups' own running averages: the exact combination of the k workers'.
            m = self.momentum
            ra_mean.value = m * ra_mean.value + (1 - m) * jnp.mean(mean, axis=0)
            ra_var.value = m * ra_var.value + (1 - m) * jnp.mean(var, axis=0)

        xg = _grouped(x, x.shape[0] // mean.shape[0])
        inv = jax.lax.rsqrt(var + self.epsilon) * scale
        y = (xg - _per_group(mean, xg.ndim)) * _per_group(inv, xg.ndim) + bias
        return y.reshape(x.shape).astype(self.dtype)
