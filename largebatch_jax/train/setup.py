"""Building a run: the checks (checks.py), the data, the step (builder.py), the newest
readable checkpoint and the loader at its position."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils

from largebatch_jax import exact, parallel, schedules
from largebatch_jax import record as run_record
from largebatch_jax import workdir as wd
from largebatch_jax.builder import build_training
from largebatch_jax.checkpoint import Checkpointer
from largebatch_jax.data import loader, sources
from largebatch_jax.metrics import filter_library_logs
from largebatch_jax.train import checks
from largebatch_jax.train.state import Data, Progress, Run
from largebatch_jax.train.teardown import Closer
from largebatch_jax.validate import ConfigError, validate_config


def load_data(config: Any) -> Data:
    """The config's train and eval sources, transforms and steps per epoch."""
    data_dir = sources.default_data_dir()
    if config.data_dir:
        data_dir = os.path.expanduser(config.data_dir)
    try:
        spec = sources.dataset_spec(config.dataset, data_dir)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    train_src = sources.load_source(config.dataset, spec.train_split, data_dir)
    eval_src = sources.load_source(config.dataset, spec.eval_split, data_dir)
    try:
        if config.train_subset:
            train_src = sources.Subset(train_src, config.train_subset)
        if config.eval_subset:
            eval_src = sources.Subset(eval_src, config.eval_subset)
    except ValueError as e:
        raise ConfigError(f"config.train_subset / eval_subset: {e}") from None
    checks.data_fits(config, spec, len(train_src))
    return Data(
        spec=spec,
        train=train_src,
        eval=eval_src,
        augment=loader.default_augmentation(spec, config.image_size, config.color_augment),
        steps_per_epoch=loader.steps_per_epoch(len(train_src), config.batch_size),
    )


def _restore(ckpt: Checkpointer, template: Any, workdir: Path) -> tuple[Any, Progress]:
    """The newest usable checkpoint (Checkpointer.restore_latest). Process 0 moves the
    newer ones it passed over aside, once every process has read its own, so that the
    run saves those steps anew; one warning line each, naming why."""
    found = ckpt.restore_latest(template)
    where = ckpt.directory
    if found.step is None:
        if found.rejected and jax.process_index() == 0:
            for step, why in sorted(found.rejected.items(), reverse=True):
                logging.warning("checkpoint at step %d %s (in %s)", step, why, where)
        if ckpt.steps():
            raise ConfigError(
                f"--workdir={workdir}: none of the checkpoints {ckpt.steps()} can be restored "
                "(each is named above, with why): use a new workdir, or move back a good "
                "checkpoint."
            )
        return template, Progress()
    if found.rejected:
        multihost_utils.sync_global_devices("checkpoints read")
        if jax.process_index() == 0:
            for step, why in sorted(found.rejected.items(), reverse=True):
                moved = ckpt.set_aside(step)
                logging.warning(
                    "checkpoint at step %d %s: moved to %s; resuming from step %d",
                    step,
                    why,
                    moved,
                    found.step,
                )
        multihost_utils.sync_global_devices("checkpoints set aside")
        ckpt.reload()
    return found.state, Progress.from_json(found.host)


def _train_loader(
    config: Any, data: Data, total: int, progress: Progress, workdir: Path
) -> loader.TrainLoader:
    train_loader = loader.TrainLoader(
        data.train,
        data.augment,
        config.batch_size,
        config.seed,
        total,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=config.workers,
        threads=config.threads,
    )
    if progress.data is not None:
        try:
            train_loader.set_state(progress.data)
        except ValueError as e:
            raise ConfigError(f"--workdir={workdir}: {e}") from None
    if train_loader.step != progress.step:
        raise RuntimeError(
            f"checkpoint step {progress.step} and loader step {train_loader.step} differ"
        )
    progress.data = train_loader.get_state()
    return train_loader


def _check_config(config: Any) -> None:
    checks.processes_agree(config)  # first: every process must then take the same path
    validate_config(config, jax.device_count(), jax.default_backend())
    if config.reduction == "exact":
        error = exact.check_cpu_threads(jax.default_backend(), jax.local_device_count())
        if error:
            raise ConfigError(error)


def build(config: Any, workdir: str | Path) -> tuple[Run, Any, Progress]:
    """Check the config, the processes and the workdir; load the data; wire the step
    (`build_training`); restore the newest readable checkpoint. Returns the run, its
    TrainState and its progress."""
    filter_library_logs()
    _check_config(config)
    engine = parallel.DataParallel(parallel.create_mesh(), config.parallelism)
    work = wd.resolve(workdir)
    wd.check_writable(work)
    lock = checks.lock_workdir(work)
    ckpt = None
    try:
        data = load_data(config)
        ckpt = Checkpointer(
            work / "checkpoints", config.keep_checkpoints, run_record.run_identity(config)
        )
        checks.against_record(
            config, work, ckpt.steps(), data.steps_per_epoch, ckpt.stamped_identity
        )
        training = build_training(config, engine, data.steps_per_epoch)
        state, progress = _restore(ckpt, training.state, work)
        total = schedules.epochs_to_steps(config.num_epochs, data.steps_per_epoch)
        run = Run(
            config=config,
            workdir=work,
            engine=engine,
            data=data,
            training=training,
            checkpointer=ckpt,
            lock=lock,
            train_loader=_train_loader(config, data, total, progress, work),
            total_steps=total,
            is_main=jax.process_index() == 0,
        )
    except BaseException:
        if ckpt is not None:  # its threads, left open, log an error at exit
            Closer(("checkpoints", ckpt.close)).close(quiet=True)
        if lock is not None:
            lock.release()
        raise
    if run.is_main:
        logging.info("%s", describe(run, progress.step))
    return run, state, progress


def describe(run: Run, start: int) -> str:
    """One line: the layout, the paper's quantities and where the run starts."""
    c, engine = run.config, run.engine
    micro = parallel.micro_batch_size(
        c.batch_size, engine.num_devices, c.accum_steps, c.bn_group_size
    )
    peak = schedules.peak_learning_rate(
        c.base_lr, c.base_batch_size, c.batch_size, c.lr_scaling, c.lr_multiplier
    )
    return (
        f"devices={engine.num_devices} (local {engine.num_local_devices}) "
        f"processes={jax.process_count()} | kn={c.batch_size} n={c.bn_group_size} "
        f"k={c.batch_size // c.bn_group_size} accum_steps={c.accum_steps} | "
        f"per device {micro} images/micro-step | local batch {run.train_loader.local_batch} | "
        f"peak lr {peak:.4g} | {run.data.steps_per_epoch} steps/epoch, {run.total_steps} "
        f"steps | {c.dataset}: {len(run.data.train)} train / {len(run.data.eval)} eval images"
        f" | " + (f"resuming at step {start}" if start else "starting")
    )
