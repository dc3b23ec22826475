"""One wiring from a config and its plan (plan.py) to what a run compiles: schedule ->
optimizer -> model -> state -> mapped train and eval steps.

Every caller (the trainer behind main.py, experiments/benchmark.py, the ahead-of-time
compile, the GPU check, the tests) builds through `build_training`, so each compiles
exactly the program main.py runs for that config. Like the step, it imports no
tensorflow, tfds, grain, clu or orbax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import linen as nn

from largebatch_jax import exact, optim, parallel
from largebatch_jax.data import sources
from largebatch_jax.models import create_model
from largebatch_jax.parallel import AXIS
from largebatch_jax.plan import Plan
from largebatch_jax.step import (
    PixelNormalization,
    TrainState,
    abstract_train_state,
    create_train_state,
    make_eval_step,
    make_train_step,
)


def model_from_config(config: Any, platform: str | None = None) -> nn.Module:
    """The model named by the config, with per-worker BN of `bn_group_size` (rule 9), or
    BN synchronised over all devices when `bn_sync` (the Flax-example ablation); its
    max-pool differentiated as suits `platform` (default: this process's backend): on
    GPU without a scatter (models/pool.py)."""
    return create_model(
        config.model,
        config.num_classes,
        config.bn_group_size,
        config.zero_init_residual,
        config.dtype,
        width=config.width,
        bn_momentum=config.bn_momentum,
        bn_epsilon=config.bn_epsilon,
        bn_axis_name=AXIS if config.bn_sync else None,
        conv_impl=config.conv_impl,
        pool_impl="slices" if parallel.is_gpu(platform or jax.default_backend()) else "xla",
    )


def image_shape(config: Any) -> tuple[int, int, int]:
    """The model's input: image_size x image_size x channels."""
    return (config.image_size, config.image_size, config.channels)


def pixel_normalization(config: Any) -> PixelNormalization:
    """Rule 13's normalisation of the config's dataset, run on the device. Small datasets
    come at their native size and are box-averaged to image_size there."""
    mean, std, native = sources.pixel_statistics(config.dataset)
    return PixelNormalization(mean, std, native // config.image_size if native else 1)


def input_shape(config: Any) -> tuple[int, int, int]:
    """One image of a host batch (uint8): the model's input, or the native size of a
    small dataset that the step downscales."""
    size = config.image_size * pixel_normalization(config).downscale
    return (size, size, config.channels)


@dataclasses.dataclass(frozen=True)
class Training:
    """What `build_training` wires. `state` is the initial state on the mesh (replicated),
    or its shapes only (`jax.ShapeDtypeStruct`s) when built with `abstract=True`."""

    model: nn.Module
    tx: optax.GradientTransformation
    learning_rate_fn: optax.Schedule
    image_shape: tuple[int, int, int]  # the model's input
    input_shape: tuple[int, int, int]  # one image of a host batch (uint8 pixels)
    state: TrainState
    train_step: Callable[[TrainState, Any], tuple[TrainState, dict]]
    eval_step: Callable[[TrainState, Any], dict]


def build_training(
    config: Any,
    plan: Plan,
    engine: parallel.DataParallel,
    *,
    abstract: bool = False,
) -> Training:
    """The model, optimizer, schedule, initial state and mapped steps of a config, laid
    out as its `plan` says.

    The plan's schedule places the epoch boundaries (rules 2, 3); its platform (the
    backend the steps will run on, which may not be this process's: an ahead-of-time
    compile for a TPU on a CPU host) picks the accumulation loop, the max-pool's
    gradient and XLA's determinism options for the exact mode on GPU. `abstract`: the
    state as shapes only, placed like the real one, for lowering without materialising.
    """
    learning_rate_fn = plan.learning_rate.schedule()
    tx = optim.optimizer_from_config(config, learning_rate_fn)
    model = model_from_config(config, plan.platform)
    shape = image_shape(config)
    if abstract:
        state = engine.abstract_replicated(abstract_train_state(model, tx, shape))
    else:
        state = engine.replicate(create_train_state(jax.random.key(config.seed), model, tx, shape))
    normalize = pixel_normalization(config)
    options = exact.compiler_options(plan.platform) if plan.reduction == "exact" else {}
    train_step = engine.map(
        make_train_step(
            model,
            tx,
            learning_rate_fn,
            plan.accum_steps,
            plan.accum_loop,
            plan.platform,
            normalize,
            reduction=plan.reduction,
            bn_group_size=plan.n,
            bn_momentum=config.bn_momentum,
        ),
        donate_state=True,
        compiler_options=options,
    )
    return Training(
        model=model,
        tx=tx,
        learning_rate_fn=learning_rate_fn,
        image_shape=shape,
        input_shape=input_shape(config),
        state=state,
        train_step=train_step,
        eval_step=engine.map(
            make_eval_step(model, normalize, plan.reduction, plan.n),
            compiler_options=options,
        ),
    )
