"""The reference we measure ourselves against: a train step written the way the Flax
ImageNet example writes one, per device, mapped by the same engine as ours.

A plain linen ResNet-50 v1.5 with `nn.BatchNorm(axis_name=AXIS)` (statistics synchronised
over the global batch, *not* the paper's rule 9), linen's default conv init, `optax.sgd`
with Nesterov momentum, weight decay as an L2 term in the loss, the gradients `pmean`-ed.
Its input is float32 images already normalised on the host, as the example's tf.data
pipeline hands them out. Not part of any training run: experiments/benchmark.py times it
beside ours on real devices, `largebatch_jax.aot` compiles it beside ours for a TPU slice.
Imports only jax, flax and optax, like the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from largebatch_jax import parallel
from largebatch_jax.parallel import AXIS
from largebatch_jax.step import one_random_stream


class _Bottleneck(nn.Module):
    features: int
    strides: int
    dtype: Any

    @nn.compact
    def __call__(self, x, train: bool):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=AXIS,
        )
        y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.features, (3, 3), (self.strides,) * 2)(y)))
        y = norm(scale_init=nn.initializers.zeros)(conv(self.features * 4, (1, 1))(y))
        if x.shape != y.shape:
            x = norm()(conv(self.features * 4, (1, 1), (self.strides,) * 2)(x))
        return nn.relu(x + y)


class ReferenceResNet50(nn.Module):
    """ResNet-50 v1.5 as the Flax ImageNet example builds it."""

    num_classes: int = 1000
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, dtype=self.dtype)(
            x.astype(self.dtype)
        )
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name=AXIS,
        )(x)
        x = nn.max_pool(nn.relu(x), (3, 3), (2, 2), padding="SAME")
        for i, blocks in enumerate((3, 4, 6, 3)):
            for j in range(blocks):
                x = _Bottleneck(64 * 2**i, 2 if i > 0 and j == 0 else 1, self.dtype)(x, train)
        x = nn.Dense(self.num_classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return x.astype(jnp.float32)


def make_reference_step(
    model: nn.Module, tx: optax.GradientTransformation, weight_decay: float = 1e-4
) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """The example's per-device step: loss + L2, grads `pmean`-ed, metrics `pmean`-ed.
    state: (params, batch_stats, opt_state, count)."""

    def step(state, batch):
        params, batch_stats, opt_state, count = state
        # The example runs under pmap, where each device differentiates its own copy; under
        # shard_map the same needs the copy marked per-device (else the gradient of the
        # replicated value would be summed implicitly).
        local = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), params)

        def loss_fn(params):
            logits, updated = model.apply(
                {"params": params, "batch_stats": batch_stats},
                batch["image"],
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            l2 = sum(jnp.sum(p**2) for p in jax.tree.leaves(params) if p.ndim > 1)
            return loss + 0.5 * weight_decay * l2, (logits, updated["batch_stats"])

        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(local)
        grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = jax.lax.pmean(
            {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])},
            AXIS,
        )
        return (params, new_stats, opt_state, count + 1), metrics

    return step


@dataclasses.dataclass(frozen=True)
class Reference:
    """The reference's mapped step and its initial state (or its shapes, `abstract`)."""

    state: tuple
    train_step: Callable[[tuple, dict], tuple[tuple, dict]]
    image_shape: tuple[int, int, int]


def build_reference(
    engine: parallel.DataParallel,
    batch_size: int,
    image_size: int,
    num_classes: int = 1000,
    dtype: str = "float32",
    abstract: bool = False,
) -> Reference:
    """The reference at kn = `batch_size` (its rate by the linear rule, 0.1 per 256)."""
    model = ReferenceResNet50(num_classes, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    tx = optax.sgd(0.1 * batch_size / 256, momentum=0.9, nesterov=True)
    shape = (image_size, image_size, 3)

    def init(rng):
        variables = model.init(rng, jnp.zeros((1, *shape)), train=False)
        params = variables["params"]
        return params, variables["batch_stats"], tx.init(params), jnp.zeros([], jnp.int32)

    with one_random_stream():
        if abstract:
            state = engine.abstract_replicated(jax.eval_shape(init, jax.random.key(0)))
        else:
            state = engine.replicate(jax.jit(init)(jax.random.key(0)))
    step = engine.map(parallel.Chain.of(make_reference_step(model, tx)), donate_state=True)
    return Reference(state=state, train_step=step, image_shape=shape)
