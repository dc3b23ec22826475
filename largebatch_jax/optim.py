"""The optimizer of the paper: rules 4-6 (README, "Where each rule of the paper lives"),
and LARS beyond 8k.

Update forms:
  optax  (default): u = m*u + g;  w -= lr * (g + m*u)  [Nesterov] or lr * u;
                    the rate stays outside the buffer, so no momentum correction is needed.
  caffe2 (ablation): v = m*v + lr*g;  w -= (1+m)*v - m*v_prev  [Nesterov] or v;
                    the rate is inside the buffer, so a rate change needs Remark 2's
                    correction v *= lr_new / lr_old.
With the correction the two forms are the same algorithm (tested).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

UPDATE_FORMS = ("optax", "caffe2")
OPTIMIZERS = ("sgd", "lars")


def weight_decay_mask(params: Any, decay_batchnorm: bool = False, decay_bias: bool = False) -> Any:
    """Paper rule 4: weight decay on conv/dense kernels only, not on BatchNorm gamma/beta.

    A BatchNorm layer is recognised by its `scale` parameter; a `bias` beside a `scale`
    is BN beta, a `bias` beside a `kernel` is a layer bias (the paper is silent about
    those: off by default, `decay_bias` switches it on).
    """
    flat = traverse_util.flatten_dict(params)
    names_in_layer = defaultdict(set)
    for path in flat:
        names_in_layer[path[:-1]].add(path[-1])
    mask = {}
    for path in flat:
        name, siblings = path[-1], names_in_layer[path[:-1]]
        if name == "kernel":
            mask[path] = True
        elif name == "scale" or (name == "bias" and "scale" in siblings):
            mask[path] = decay_batchnorm
        elif name == "bias":
            mask[path] = decay_bias
        else:
            raise ValueError(f"weight_decay_mask: unknown parameter kind {'/'.join(path)}.")
    return traverse_util.unflatten_dict(mask)


def coupled_weight_decay(weight_decay: float, mask: Any) -> optax.GradientTransformation:
    """Paper rule 4 / Remark 1: weight decay as an L2 term added to the gradient
    (g + wd*w) *before* momentum and the rate, so scaling the loss does not scale it."""
    return optax.add_decayed_weights(weight_decay, mask)


class Caffe2MomentumState(NamedTuple):
    count: jax.Array
    velocity: Any
    last_lr: jax.Array


def caffe2_momentum(
    learning_rate: optax.Schedule,
    momentum: float,
    nesterov: bool,
    momentum_correction: bool,
) -> optax.GradientTransformation:
    """Paper Remark 2, momentum correction: in the Caffe2 form v = m*v + lr*g the buffer
    holds the rate, so when the rate changes v is rescaled by lr_new / lr_old.

    Without the correction (the ablation) the buffer keeps stale rates, which matters
    during warmup and at each decay.
    """

    def init_fn(params):
        return Caffe2MomentumState(
            count=jnp.zeros([], jnp.int32),
            velocity=jax.tree.map(jnp.zeros_like, params),
            last_lr=jnp.asarray(learning_rate(0), jnp.float32),
        )

    def update_fn(updates, state, params=None):
        del params
        lr = jnp.asarray(learning_rate(state.count), jnp.float32)
        ratio = lr / state.last_lr if momentum_correction else jnp.float32(1.0)
        prev = jax.tree.map(lambda v: v * ratio.astype(v.dtype), state.velocity)
        velocity = jax.tree.map(lambda v, g: momentum * v + lr.astype(g.dtype) * g, prev, updates)
        if nesterov:
            step = jax.tree.map(lambda v, p: (1 + momentum) * v - momentum * p, velocity, prev)
        else:
            step = velocity
        new_updates = jax.tree.map(jnp.negative, step)
        return new_updates, Caffe2MomentumState(state.count + 1, velocity, lr)

    return optax.GradientTransformation(init_fn, update_fn)


def create_optimizer(
    learning_rate: optax.Schedule,
    *,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    nesterov: bool = True,
    weight_decay: float = 1e-4,
    decay_batchnorm: bool = False,
    decay_bias: bool = False,
    update_form: str = "optax",
    momentum_correction: bool = True,
    lars_trust_coefficient: float = 0.001,
) -> optax.GradientTransformation:
    """SGD with (Nesterov) momentum and coupled, masked weight decay: paper rules 4-6.

    `optimizer='lars'` uses optax's LARS (You et al. 2017) for kn beyond 8k, with the
    same decay mask for the weight decay and the trust ratio.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {OPTIMIZERS}.")
    if update_form not in UPDATE_FORMS:
        raise ValueError(f"update_form={update_form!r} is not one of {UPDATE_FORMS}.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum={momentum} must be in [0, 1).")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0.")

    def mask(params):
        return weight_decay_mask(params, decay_batchnorm, decay_bias)

    if optimizer == "lars":
        return optax.lars(
            learning_rate,
            weight_decay=weight_decay,
            weight_decay_mask=mask,
            trust_coefficient=lars_trust_coefficient,
            trust_ratio_mask=mask,
            momentum=momentum,
            nesterov=nesterov,
        )
    if update_form == "caffe2":
        step: optax.GradientTransformation = caffe2_momentum(
            learning_rate, momentum, nesterov, momentum_correction
        )
    else:
        step = optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov)
    return optax.chain(coupled_weight_decay(weight_decay, mask), step)


def optimizer_from_config(
    config: Any, learning_rate: optax.Schedule
) -> optax.GradientTransformation:
    """`create_optimizer` with the config's fields (the one place that maps names)."""
    return create_optimizer(
        learning_rate,
        optimizer=config.optimizer,
        momentum=config.momentum,
        nesterov=config.nesterov,
        weight_decay=config.weight_decay,
        decay_batchnorm=config.decay_batchnorm,
        decay_bias=config.decay_bias,
        update_form=config.update_form,
        momentum_correction=config.momentum_correction,
        lars_trust_coefficient=config.lars_trust_coefficient,
    )
