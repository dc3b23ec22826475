"""The per-device train and eval steps: one paper worker's view of an SGD update.

A device holds `accum_steps * micro_batch` images of the global minibatch kn. For each
micro-step it runs the model with BatchNorm over groups of n, takes the mean
cross-entropy and its gradient; the gradients are averaged over micro-steps and then
`lax.pmean`-ed over devices, which is exactly the gradient of the loss averaged over all
kn images (paper Remark 3; README, "The engine"). With `reduction='exact'` the same sums
are made bit-identical across layouts: every group of n is one call of one compiled
body, and the k groups are summed in one fixed tree (`exact`).

This module never sees a config and imports only jax, flax, optax, numpy and the
project's parts, so the step compiles (and is benchmarked) wherever JAX runs: a GPU image
without tensorflow, grain or clu, or a CPU host compiling for a TPU slice.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.flatten_util import ravel_pytree

from largebatch_jax import exact, grouped, parallel
from largebatch_jax.parallel import AXIS

REDUCTIONS = ("fast", "exact")


@flax.struct.dataclass
class TrainState:
    """Everything an SGD update changes; a plain pytree (checkpointable as is)."""

    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any


def create_train_state(
    rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation, image_shape: tuple
) -> TrainState:
    """Initialise parameters (the paper's init lives in the model), BN statistics
    (mean 0, var 1) and the optimizer state, on the host's default device."""
    with one_random_stream():
        return jax.jit(functools.partial(_init_state, model, tx, image_shape))(rng)


def abstract_train_state(
    model: nn.Module, tx: optax.GradientTransformation, image_shape: tuple
) -> TrainState:
    """The shapes and dtypes of `create_train_state`'s result, computing nothing (for
    compiling ahead of time on a host that does not hold the target's devices)."""
    with one_random_stream():
        return jax.eval_shape(
            functools.partial(_init_state, model, tx, image_shape), jax.random.key(0)
        )


def one_random_stream():
    """The random stream every initialisation draws from, whatever the process's JAX
    settings, so that a seed gives the same initial weights everywhere: the
    non-partitionable threefry. The partitionable one (JAX's default) compiles
    pathologically slowly on XLA:CPU for some shapes (measured: 5.8 s vs 0.4 s for a
    3x3x8x16 kernel; ResNet-50 init 16 s vs 10 s); only sharded random generation would
    need it, and the project does none. A context manager (the setting is read when the
    initialisation is traced)."""
    return jax.threefry_partitionable(False)


def _init_state(model, tx, image_shape, rng) -> TrainState:
    variables = model.init(rng, jnp.zeros((1, *image_shape), jnp.float32), train=False)
    params = variables["params"]
    return TrainState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        batch_stats=variables["batch_stats"],
        opt_state=tx.init(params),
    )


@dataclasses.dataclass(frozen=True)
class PixelNormalization:
    """Paper rule 13's per-channel mean/std normalisation, on the device: the host hands
    out uint8 pixels (4x fewer bytes than float32), the step makes them float32 here.
    `downscale` > 1 first box-averages f x f pixels (small datasets shipped at their
    native size, e.g. Fashion-MNIST 28 -> 14). The same float32 operations as a
    host-side normalisation, element by element: (x - mean) * (1 / std)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    downscale: int = 1

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.astype(jnp.float32)
        f = self.downscale
        if f > 1:
            b, h, w, c = x.shape
            x = x.reshape(b, h // f, f, w // f, f, c).mean(axis=(2, 4))
        mean = np.asarray(self.mean, np.float32)
        inv_std = np.asarray([1.0 / s for s in self.std], np.float32)
        return (x - mean) * inv_std


def cross_entropy(logits: jax.Array, labels: jax.Array, scatter_free: bool = False) -> jax.Array:
    """Per-example softmax cross-entropy with integer labels (optax's). `scatter_free`:
    the same formula, logsumexp(logits) minus the label's logit, with the label's logit
    picked by a one-hot select and a sum instead of a gather, so that its gradient is a
    select, not a scatter-add (on GPU a scatter, made deterministic there only by a
    sort). The loss is the same to the bit (the sum adds zeros to the one picked value);
    the gradient's values are the same, but the program differs, so XLA may fuse the
    rest differently (on XLA:CPU: 1e-9 apart). Used on GPU only (`make_train_step`)."""
    if not scatter_free:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    picked = jnp.arange(logits.shape[-1]) == labels[..., None]
    label_logits = jnp.sum(jnp.where(picked, logits, jnp.zeros((), logits.dtype)), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def mean_cross_entropy(
    logits: jax.Array, labels: jax.Array, scatter_free: bool = False
) -> jax.Array:
    """Paper rule 7 (Remark 3): the loss is normalised by the number of images it sums
    over.

    Per micro-batch mean here; the mean over micro-steps and devices (all of equal size)
    then normalises by the whole minibatch kn.
    """
    return cross_entropy(logits, labels, scatter_free).mean()


def topk_errors(logits: jax.Array, labels: jax.Array, k: int, sort_free: bool = False) -> jax.Array:
    """1.0 where the label is not among the k highest logits, per example. `sort_free`
    with k=1: an argmax (ties to the lower index, as `lax.top_k`), which on GPU needs no
    sort; the same 0s and 1s."""
    k = min(k, logits.shape[-1])
    if k == 1 and sort_free:
        return (jnp.argmax(logits, axis=-1) != labels).astype(jnp.float32)
    _, top = jax.lax.top_k(logits, k)
    return 1.0 - jnp.any(top == labels[:, None], axis=-1).astype(jnp.float32)


def _varying(tree: Any) -> Any:
    """Mark a fresh value as differing per device (the scan carry of per-device sums)."""
    return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), tree)


def _keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the update was finite, else `old`. Integer leaves are counters (the
    schedule's step inside optax): they advance either way, so the rate applied stays the
    one of the state's step."""
    return jax.tree.map(
        lambda n, o: jnp.where(finite, n, o) if jnp.issubdtype(n.dtype, jnp.inexact) else n,
        new,
        old,
    )


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    learning_rate_fn: optax.Schedule,
    accum_steps: int = 1,
    accum_loop: str = "auto",
    platform: str | None = None,
    normalize: Callable[[jax.Array], jax.Array] | None = None,
    reduction: str = "fast",
    bn_group_size: int | None = None,
    bn_momentum: float = 0.9,
) -> parallel.Chain:
    """The per-device SGD update (paper rules 7, 9, 15); map it with `DataParallel.map`.

    batch: {'image': [accum_steps * micro, H, W, C], 'label': [accum_steps * micro]}.
    A step of one program, or a chain of programs (exact mode), as `parallel.Chain`; its
    runs return the new state (identical on every device) and metrics averaged over kn.
    `accum_loop`: the micro-steps of rule 15 (gradient accumulation, BN still per group of
    n) as one `lax.scan` ('scan': one copy of the model in the program, whatever
    accum_steps is) or as a Python loop ('unroll': accum_steps copies). Same sums in the
    same order; 'auto' picks the faster for `platform` (the backend the step will run
    on; default: this process's), see `parallel.resolve_accum_loop`; on GPU the loss and the
    training error are computed without a scatter or a sort. `normalize` maps the
    batch's pixels to the model's input (a `PixelNormalization`); None: used as given.
    `reduction='exact'` (needs `bn_group_size` and the model's `bn_momentum`): a chain
    of programs (`grouped.grouped_step`) instead of the micro-steps and `pmean`: a
    program run per BN group of n (`exact_group`), one that sums the groups in the fixed tree
    (`exact_mean`) and one that updates (`exact_update`), bit-identical for every layout
    of the same kn and n; accum_steps and accum_loop then change nothing.
    """
    platform = platform or jax.default_backend()
    accum_loop = parallel.resolve_accum_loop(accum_loop, platform)
    if accum_loop not in parallel.ACCUM_LOOPS:
        raise ValueError(f"accum_loop={accum_loop!r} is not one of {parallel.ACCUM_LOOPS}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}.")
    if reduction == "exact" and not bn_group_size:
        raise ValueError("reduction='exact' needs bn_group_size.")
    # No scatter or sort on GPU (`cross_entropy`).
    parts = _StepParts(model, tx, learning_rate_fn, parallel.is_gpu(platform), normalize)
    if reduction == "exact":
        exact_parts = _ExactParts(parts, bn_momentum)
        return grouped.grouped_step(
            bn_group_size, exact_parts.group, exact_parts.mean, exact_parts.update
        )
    return parallel.Chain.of(functools.partial(_fast_step, parts, accum_steps, accum_loop))


@dataclasses.dataclass(frozen=True, eq=False)
class _StepParts:
    """What every form of the train step shares: one group's gradient and the update."""

    model: nn.Module
    tx: optax.GradientTransformation
    learning_rate_fn: optax.Schedule
    gpu: bool
    normalize: Callable[[jax.Array], jax.Array] | None

    def loss(self, params, batch_stats, images, labels):
        logits, updated = self.model.apply(
            {"params": params, "batch_stats": batch_stats},
            images,
            train=True,
            mutable=["batch_stats"],
        )
        return mean_cross_entropy(logits, labels, self.gpu), (logits, updated["batch_stats"])

    def group_step(self, params, batch_stats, x, y):
        # Each micro-step or group normalises its own pixels: normalising the device's
        # whole batch first would hold all of it as float32 at once (kn=8192 on 8 GPUs: 1024
        # images, 588 MiB, which XLA's GPU compiler keeps live across the loop).
        if self.normalize is not None:
            x = self.normalize(x)
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        (loss, (logits, stats)), grads = grad_fn(params, batch_stats, x, y)
        return grads, stats, loss, topk_errors(logits, y, 1, self.gpu).mean()

    def update(self, state: TrainState, grads, batch_stats, loss, error):
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss, gradient or updated state (a finite gradient times an
        # overflowing learning rate; the norms overflow once a value passes ~1e19, which
        # only a diverged run reaches) leaves the state as it was (the step still counts),
        # so the state in memory, and every checkpoint, is a good one; the loop stops or
        # skips on the flag.
        grad_norm, new_norm = optax.tree.norm(grads), optax.tree.norm(params)
        finite = (
            jnp.isfinite(loss)
            & jnp.isfinite(grad_norm)
            & jnp.isfinite(new_norm)
            & jnp.isfinite(optax.tree.norm(batch_stats))
        )
        new_state = state.replace(
            step=state.step + 1,
            params=_keep_if_finite(finite, params, state.params),
            batch_stats=_keep_if_finite(finite, batch_stats, state.batch_stats),
            opt_state=_keep_if_finite(finite, opt_state, state.opt_state),
        )
        metrics = {
            "nonfinite": 1.0 - finite.astype(jnp.float32),
            "train_loss": loss,
            "train_error": error,
            "learning_rate": jnp.asarray(self.learning_rate_fn(state.step), jnp.float32),
            "grad_norm": grad_norm,
            "param_norm": new_norm,  # of the update's parameters (not finite when skipped)
        }
        return new_state, metrics


def _fast_step(
    parts: _StepParts, accum_steps: int, accum_loop: str, state: TrainState, batch: dict
) -> tuple[TrainState, dict]:
    """reduction='fast': the micro-steps' sums, one `pmean` over the devices, the update."""
    images, labels = batch["image"], batch["label"]
    if images.shape[0] % accum_steps:
        raise ValueError(
            f"accum_steps={accum_steps} does not divide the per-device batch {images.shape[0]}."
        )
    micro = images.shape[0] // accum_steps
    images = images.reshape(accum_steps, micro, *images.shape[1:])
    labels = labels.reshape(accum_steps, micro)

    # Differentiate a per-device copy of the parameters: the gradient is then this
    # device's own, and the explicit pmean below is the only reduction. (Taken w.r.t.
    # the replicated value, shard_map would psum it implicitly.)
    local_params = _varying(state.params)

    def micro_step(x, y):
        # Every micro-step starts from the same BN statistics: each group is one
        # worker's update of the old running averages, later averaged (rule 9).
        return parts.group_step(local_params, state.batch_stats, x, y)

    if accum_loop == "unroll":
        sums = micro_step(images[0], labels[0])
        for i in range(1, accum_steps):
            sums = jax.tree.map(jnp.add, sums, micro_step(images[i], labels[i]))
    else:
        zeros = jax.tree.map(
            jnp.zeros_like, (state.params, state.batch_stats, jnp.float32(0), jnp.float32(0))
        )
        sums, _ = jax.lax.scan(
            lambda sums, xy: (jax.tree.map(jnp.add, sums, micro_step(*xy)), None),
            _varying(zeros),
            (images, labels),
        )
    means = jax.lax.pmean(jax.tree.map(lambda s: s / accum_steps, sums), AXIS)
    return parts.update(state, *means)


@dataclasses.dataclass(frozen=True, eq=False)
class _ExactParts:
    """reduction='exact': the three programs of `grouped.grouped_step`."""

    parts: _StepParts
    bn_momentum: float

    def group(self, state: TrainState, batch: dict):
        """One BN group's gradient, BN statistics update, loss and error (a program of its
        own: `grouped`). The group sees running statistics of zero, so it returns
        (1 - momentum) x its batch statistics; momentum x the old ones is added once, after
        the sum (`update`)."""
        zero_stats = jax.tree.map(jnp.zeros_like, state.batch_stats)
        params = _varying(state.params)
        results = self.parts.group_step(params, zero_stats, batch["image"], batch["label"])
        return jax.tree.map(lambda r: r[None], results)

    def mean(self, results: tuple) -> jax.Array:
        """The mean over the kn images of every group's results, bit-identical on every
        layout: the k groups summed in the fixed tree of `exact` (this device's groups in
        order, then the devices in order) and divided by k. Returned flat, as
        `ravel_pytree` flattens (gradients, statistics, loss, error): cut into leaves here,
        each leaf's slice counted as a read of the whole vector on the TPU compile
        (v5e-256: 2.98 + 3.13 GB for this program and the update, 2.48 + 2.48 GB flat)."""
        stacked = jax.tree.map(lambda *r: jnp.concatenate(r), *results)
        flat, _ = ravel_pytree(exact.tree_sum_leaves(stacked))
        devices = jax.lax.axis_size(AXIS)
        return exact.flat_device_sum(flat, AXIS, devices, len(results) * devices)

    def update(self, state: TrainState, means: jax.Array):
        """The update from the means (a program of its own, the same in every layout, so
        its reductions, the norms, round the same way everywhere)."""
        like = (state.params, state.batch_stats, jnp.float32(0), jnp.float32(0))
        grads, stats, loss, error = ravel_pytree(like)[1](means)
        momentum = self.bn_momentum
        stats = jax.tree.map(lambda old, new: momentum * old + new, state.batch_stats, stats)
        return self.parts.update(state, grads, stats, loss, error)


def make_eval_step(
    model: nn.Module,
    normalize: Callable[[jax.Array], jax.Array] | None = None,
    reduction: str = "fast",
    chunk: int | None = None,
) -> parallel.Chain:
    """Per-device evaluation with the running BN statistics (pixels through `normalize`,
    as in training).

    batch: {'image', 'label', 'mask'}; padded examples have mask 0. Returns sums over all
    devices (`count`, `loss_sum`, `top1_errors`, `top5_errors`) so that the host can add
    batches and divide once: every real image counts exactly once. `reduction='exact'`:
    the model runs on `chunk` images at a time (`lax.map`, one compiled body whatever the
    per-device batch), and the per-image values of the whole batch, gathered in batch
    order, are summed in the fixed tree: the same bits on every layout.
    """

    def per_image(state: TrainState, images, labels, mask):
        logits = model.apply(
            {"params": state.params, "batch_stats": state.batch_stats},
            images,
            train=False,
        )
        loss = cross_entropy(logits, labels)
        return {
            "count": mask,
            "loss_sum": loss * mask,
            "top1_errors": topk_errors(logits, labels, 1) * mask,
            "top5_errors": topk_errors(logits, labels, 5) * mask,
        }

    def eval_step(state: TrainState, batch: dict) -> dict:
        images = batch["image"] if normalize is None else normalize(batch["image"])
        labels, mask = batch["label"], batch["mask"].astype(jnp.float32)
        if reduction != "exact":
            values = per_image(state, images, labels, mask)
            return jax.lax.psum(jax.tree.map(jnp.sum, values), AXIS)
        if images.shape[0] % chunk:
            raise ValueError(
                f"the per-device eval batch {images.shape[0]} is not whole chunks of {chunk}."
            )
        chunks = images.shape[0] // chunk
        values = exact.map_groups(
            lambda xym: per_image(state, *xym),
            (
                images.reshape(chunks, chunk, *images.shape[1:]),
                labels.reshape(chunks, chunk),
                mask.reshape(chunks, chunk),
            ),
            AXIS,
        )
        flat = jax.tree.map(lambda v: v.reshape(-1), values)  # batch order
        gathered = exact.all_gather_invariant(flat, AXIS, tiled=True)
        return jax.tree.map(exact.vector_sum, gathered)

    return parallel.Chain.of(eval_step, takes_state=False)
