"""The run's plan: every quantity the paper's recipe derives from the config and the facts
of the run (devices, processes, platform, the dataset's sizes), resolved once.

The ConfigDict is what the user writes and the workdir records; the `Plan` is what runs.
`resolve` makes every cross-field check (one line each, `ConfigError`), and everything
that trains, compiles or reports reads kn, n, k, the micro-batch, steps per epoch, the
schedule's steps and the peak rate from the Plan, never again from the config. The
docs/design.md table "The run's derived quantities" names each and where it is computed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import optax

from largebatch_jax import exact, grouped, parallel, schedules
from largebatch_jax.data import sources
from largebatch_jax.errors import ConfigError
from largebatch_jax.validate import validate_fields


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a run is resolved against besides its config.

    `train_images` / `eval_images`: the loaded splits' sizes; None for the dataset's known
    size (`sources.TRAIN_SIZES`, cut to `train_subset`), for tools that compile without
    the data. `dataset`: the loaded dataset's spec, checked against the config's classes,
    channels and image size where given. `environ`: this process's environment, for
    XLA:CPU's thread count in exact mode; None where the steps run on another machine
    (an ahead-of-time compile)."""

    devices: int
    platform: str
    processes: int = 1
    local_devices: int | None = None
    train_images: int | None = None
    eval_images: int | None = None
    dataset: sources.DatasetSpec | None = None
    environ: Mapping[str, str] | None = None

    @property
    def local(self) -> int:
        """This process's devices (all of them where not given)."""
        return self.devices if self.local_devices is None else self.local_devices

    @classmethod
    def of_this_process(
        cls,
        train_images: int | None = None,
        eval_images: int | None = None,
        dataset: sources.DatasetSpec | None = None,
    ) -> Facts:
        """The devices, processes, platform and environment of this process's run."""
        import jax

        return cls(
            devices=jax.device_count(),
            platform=jax.default_backend(),
            processes=jax.process_count(),
            local_devices=jax.local_device_count(),
            train_images=train_images,
            eval_images=eval_images,
            dataset=dataset,
            environ=os.environ,
        )


@dataclasses.dataclass(frozen=True)
class LearningRate:
    """Rules 1-3 resolved to iterations (one SGD update of kn images each): the rate
    starts at `base` (the rate of kn = base kn), reaches `peak` after `warmup_steps`
    (rule 2; 0 where warmup does not apply), and decays by `decay_factor` at each of
    `decay_steps` (rule 3), up to `total_steps`."""

    base: float
    peak: float
    warmup: str
    warmup_steps: int
    decay: str
    decay_steps: tuple[int, ...]
    decay_factor: float
    total_steps: int

    def schedule(self) -> optax.Schedule:
        """The optax schedule of these rates (`schedules.learning_rate_schedule`)."""
        return schedules.learning_rate_schedule(
            self.base,
            self.peak,
            self.warmup,
            self.warmup_steps,
            self.decay,
            self.decay_steps,
            self.decay_factor,
            self.total_steps,
        )


def learning_rate(config: Any, steps_per_epoch: int) -> LearningRate:
    """The config's schedule in iterations: rule 1's peak, rule 2's warmup where it
    applies, rule 3's decays, each epoch boundary converted once with `steps_per_epoch`."""
    c = config
    if steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch={steps_per_epoch} must be > 0.")
    try:
        peak = schedules.peak_learning_rate(
            c.base_lr, c.base_batch_size, c.batch_size, c.lr_scaling, c.lr_multiplier
        )
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    warms = warmup_applies(config)

    def steps(epochs: float) -> int:
        return schedules.epochs_to_steps(epochs, steps_per_epoch)

    return LearningRate(
        base=float(c.base_lr),
        peak=peak,
        warmup=c.warmup,
        warmup_steps=steps(c.warmup_epochs) if warms else 0,
        decay=c.lr_decay,
        decay_steps=tuple(steps(e) for e in c.decay_epochs),
        decay_factor=float(c.decay_factor),
        total_steps=steps(c.num_epochs),
    )


def warmup_applies(config: Any) -> bool:
    """Rule 2 for this config: a warmup is run (kn > base kn, and one is asked for)."""
    return (
        schedules.warmup_applies(config.batch_size, config.base_batch_size)
        and config.warmup != "none"
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's derived quantities, in the paper's names: kn images per update in k groups
    of n (per-worker BN, rule 9), each device taking `micro_batch` images per micro-step
    in `groups_per_device` groups, `accum_steps` micro-steps per update (rule 15)."""

    kn: int
    n: int
    k: int
    devices: int
    local_devices: int
    processes: int
    platform: str
    accum_steps: int
    accum_loop: str  # resolved for the platform: 'scan' or 'unroll'
    micro_batch: int
    groups_per_device: int
    local_batch: int  # images of each update this process loads
    eval_batch: int
    eval_batch_per_device: int
    dataset: str
    train_images: int
    eval_images: int | None
    steps_per_epoch: int
    learning_rate: LearningRate
    log_every_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    reduction: str
    dtype: str
    parallelism: str

    @property
    def total_steps(self) -> int:
        return self.learning_rate.total_steps

    @property
    def warmup_steps(self) -> int:
        return self.learning_rate.warmup_steps

    @property
    def decay_steps(self) -> tuple[int, ...]:
        return self.learning_rate.decay_steps

    @property
    def peak_lr(self) -> float:
        """eta after warmup: rule 1's, times lr_multiplier."""
        return self.learning_rate.peak

    def epoch(self, step: int) -> float:
        """The epoch a step ends at (fractional)."""
        return step / self.steps_per_epoch

    def describe(self) -> str:
        """The run's header line: the layout, the paper's quantities, the data."""
        images = f"{self.train_images} train" + (
            f" / {self.eval_images} eval" if self.eval_images is not None else ""
        )
        return (
            f"devices={self.devices} (local {self.local_devices}) processes={self.processes} "
            f"| kn={self.kn} n={self.n} k={self.k} accum_steps={self.accum_steps} | "
            f"per device {self.micro_batch} images/micro-step | local batch {self.local_batch} "
            f"| peak lr {self.peak_lr:.4g} | {self.steps_per_epoch} steps/epoch, "
            f"{self.total_steps} steps | {self.dataset}: {images} images"
        )


def resolve(config: Any, facts: Facts) -> Plan:
    """The Plan of `config` run as `facts` say, after every check of the config: the
    fields (`check_fields`), the minibatch's layout on the devices (`check_layout`), the
    processes and XLA:CPU's threads (`check`), the data (`_check_data`). Raises
    ConfigError with one line."""
    micro = check(config, facts)
    train_images = facts.train_images
    if train_images is None:
        train_images = known_train_images(config)
    _check_data(config, facts.dataset, train_images)
    spe = sources.steps_per_epoch(train_images, config.batch_size)
    return Plan(
        kn=config.batch_size,
        n=config.bn_group_size,
        k=config.batch_size // config.bn_group_size,
        devices=facts.devices,
        local_devices=facts.local,
        processes=facts.processes,
        platform=facts.platform,
        accum_steps=config.accum_steps,
        accum_loop=parallel.resolve_accum_loop(config.accum_loop, facts.platform),
        micro_batch=micro,
        groups_per_device=micro // config.bn_group_size,
        local_batch=config.batch_size // facts.processes,
        eval_batch=config.eval_batch_size,
        eval_batch_per_device=config.eval_batch_size // facts.devices,
        dataset=config.dataset,
        train_images=train_images,
        eval_images=facts.eval_images,
        steps_per_epoch=spe,
        learning_rate=learning_rate(config, spe),
        log_every_steps=config.log_every_steps,
        eval_every_steps=max(1, schedules.epochs_to_steps(config.eval_every_epochs, spe)),
        checkpoint_every_steps=config.checkpoint_every_steps,
        reduction=config.reduction,
        dtype=config.dtype,
        parallelism=config.parallelism,
    )


def check(config: Any, facts: Facts) -> int:
    """The checks of `resolve` that need no data (main.py makes them before it touches
    the workdir); returns the per-device micro-batch."""
    micro = check_layout(config, facts.devices, facts.platform)
    if config.reduction == "exact" and facts.environ is not None:
        error = exact.check_cpu_threads(facts.platform, facts.local, facts.environ)
        if error:
            raise ConfigError(error)
    if facts.processes <= 0 or config.batch_size % facts.processes:
        raise ConfigError(
            f"config.batch_size={config.batch_size} is not divisible by the "
            f"{facts.processes} processes."
        )
    return micro


def known_train_images(config: Any) -> int:
    """The training images of a config's dataset from its known size (`train_subset` cut
    to it), for tools that compile without loading the data; a run counts the loaded
    split, which gives the same number."""
    if config.dataset not in sources.TRAIN_SIZES:
        raise ConfigError(
            f"config.dataset={config.dataset!r} has no known size: a tool that compiles "
            "without the data needs one of " + ", ".join(map(repr, sources.TRAIN_SIZES)) + "."
        )
    size = sources.TRAIN_SIZES[config.dataset]
    return min(size, config.train_subset or size)


def check_fields(config: Any) -> None:
    """What does not depend on the devices: every field (validate.validate_fields) and the
    schedule's boundaries against each other (a sweep checks its runs with this before
    training any)."""
    validate_fields(config)
    if any(e > config.num_epochs for e in config.decay_epochs):
        raise ConfigError(
            f"config.decay_epochs={tuple(config.decay_epochs)} go past "
            f"num_epochs={config.num_epochs}: lower them or raise num_epochs."
        )
    if warmup_applies(config) and config.decay_epochs:
        first = min(config.decay_epochs)
        if config.warmup_epochs > first:
            raise ConfigError(
                f"config.warmup_epochs={config.warmup_epochs} runs past the first decay at "
                f"epoch {first}: shorten the warmup."
            )


def check_layout(config: Any, devices: int, platform: str | None = None) -> int:
    """The fields (`check_fields`), then the minibatch on `devices` devices, and what
    depends on the `platform` the steps compile for where it is given; returns the
    per-device micro-batch. Raises ConfigError with one line."""
    check_fields(config)
    micro = micro_batch(config.batch_size, devices, config.accum_steps, config.bn_group_size)
    if config.eval_batch_size % devices:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} is not divisible by the "
            f"{devices} devices."
        )
    if config.reduction == "exact":
        _check_exact(config, devices)
        if platform and parallel.is_gpu(platform) and config.parallelism == "pmap":
            raise ConfigError(
                "config.reduction='exact' on GPU compiles with XLA's determinism option, "
                "which parallelism='pmap' cannot pass: set parallelism='shard_map'."
            )
    return micro


def micro_batch(batch_size: int, devices: int, accum_steps: int, bn_group_size: int) -> int:
    """Images per device per micro-step: kn / (devices x accum_steps), in whole BN groups
    of n (rules 9 and 15). Raises ConfigError naming the field and the numbers."""
    for field, value in (
        ("batch_size", batch_size),
        ("num_devices", devices),
        ("accum_steps", accum_steps),
        ("bn_group_size", bn_group_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config.{field}={value!r} must be a positive integer.")
    per_step = devices * accum_steps
    if batch_size % per_step:
        raise ConfigError(
            f"config.batch_size={batch_size} is not divisible by devices x accum_steps = "
            f"{devices} x {accum_steps} = {per_step}."
        )
    micro = batch_size // per_step
    if bn_group_size > micro:
        raise ConfigError(
            f"config.bn_group_size={bn_group_size} is larger than the per-device micro-batch "
            f"{micro} (batch_size={batch_size} / ({devices} devices x {accum_steps} "
            "accum_steps)): lower bn_group_size or accum_steps."
        )
    if micro % bn_group_size:
        raise ConfigError(
            f"config.batch_size={batch_size} is not divisible by devices x accum_steps x "
            f"bn_group_size = {devices} x {accum_steps} x {bn_group_size}."
        )
    return micro


def _check_exact(config: Any, devices: int) -> None:
    """Where reduction='exact' can keep its promise (grouped.py, exact.py): the tree of
    the k groups splits into the devices' blocks only for a power-of-two number of
    groups per device; per-worker BN; exact evaluation runs n images at a time."""
    kn, n = config.batch_size, config.bn_group_size
    if not grouped.whole_power_of_two_groups(kn // devices, n):
        raise ConfigError(
            f"config.reduction='exact' needs a power-of-two number of BN groups per device, "
            f"but batch_size={kn} / {devices} devices / bn_group_size={n} = "
            f"{kn // devices // n}: change batch_size or the number of devices, or set "
            "reduction='fast'."
        )
    if config.bn_sync:
        raise ConfigError(
            "config.reduction='exact' sums per-worker BN groups and does not apply with "
            "bn_sync=True: set reduction='fast'."
        )
    per_device = config.eval_batch_size // devices
    if per_device % n:
        raise ConfigError(
            f"config.eval_batch_size={config.eval_batch_size} gives {per_device} images per "
            f"device, not a multiple of bn_group_size={n} (exact evaluation runs n images "
            "at a time): change eval_batch_size, or set reduction='fast'."
        )


def _check_data(config: Any, spec: sources.DatasetSpec | None, train_images: int) -> None:
    """The config against its dataset: classes, channels, the downscale of small images,
    and a minibatch no larger than the training set."""
    if spec is not None:
        if config.num_classes != spec.num_classes:
            raise ConfigError(
                f"config.num_classes={config.num_classes} but {config.dataset} has "
                f"{spec.num_classes} classes: set num_classes={spec.num_classes}."
            )
        if config.channels != len(spec.mean):
            raise ConfigError(
                f"config.channels={config.channels} but {config.dataset} images have "
                f"{len(spec.mean)}: set channels={len(spec.mean)}."
            )
        if not spec.large_images and spec.native_size % config.image_size:
            raise ConfigError(
                f"config.image_size={config.image_size} must divide {config.dataset}'s "
                f"native size {spec.native_size} (images are downscaled by box averaging)."
            )
    if config.batch_size > train_images:
        raise ConfigError(
            f"config.batch_size={config.batch_size} is larger than the training set "
            f"({train_images} images)."
        )


__all__ = [
    "Facts",
    "LearningRate",
    "Plan",
    "check",
    "check_fields",
    "check_layout",
    "known_train_images",
    "learning_rate",
    "micro_batch",
    "resolve",
]
