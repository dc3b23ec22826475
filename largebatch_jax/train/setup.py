"""Building a run: the checks (checks.py), the data, the plan (plan.py), the step
(builder.py), the newest readable checkpoint and the loader at its position."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
from absl import logging
from jax.experimental import multihost_utils

from largebatch_jax import parallel
from largebatch_jax import record as run_record
from largebatch_jax import workdir as wd
from largebatch_jax.builder import build_training
from largebatch_jax.checkpoint import Checkpointer
from largebatch_jax.data import loader, sources
from largebatch_jax.errors import ConfigError
from largebatch_jax.metrics import filter_library_logs
from largebatch_jax.plan import Facts, Plan, check, resolve
from largebatch_jax.train import checks
from largebatch_jax.train.state import Data, Progress, Run
from largebatch_jax.train.teardown import Closer


def load_data(config: Any) -> Data:
    """The config's train and eval sources and transforms."""
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
    return Data(
        spec=spec,
        train=train_src,
        eval=eval_src,
        augment=loader.default_augmentation(spec, config.image_size, config.color_augment),
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
    config: Any, plan: Plan, data: Data, progress: Progress, workdir: Path
) -> loader.TrainLoader:
    train_loader = loader.TrainLoader(
        data.train,
        data.augment,
        plan.kn,
        config.seed,
        plan.total_steps,
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


def resolve_plan(config: Any, data: Data) -> Plan:
    """The run's plan (plan.resolve) on this process's devices and the loaded data."""
    facts = Facts.of_this_process(len(data.train), len(data.eval), data.spec)
    return resolve(config, facts)


def build(config: Any, workdir: str | Path) -> tuple[Run, Any, Progress]:
    """Check the processes and the config; check and lock the workdir; load the data;
    resolve the run's plan (every cross-field check: those without data first, above);
    wire the step (`build_training`); restore the newest readable checkpoint. Returns the
    run, its TrainState and its progress."""
    filter_library_logs()
    checks.processes_agree(config)  # first: every process must then take the same path
    check(config, Facts.of_this_process())  # the config, before the workdir is touched
    engine = parallel.DataParallel(parallel.create_mesh(), config.parallelism)
    work = wd.resolve(workdir)
    wd.check_writable(work)
    lock = checks.lock_workdir(work)
    ckpt = None
    try:
        data = load_data(config)
        plan = resolve_plan(config, data)
        ckpt = Checkpointer(
            work / "checkpoints", config.keep_checkpoints, run_record.run_identity(config)
        )
        checks.against_record(config, plan, work, ckpt.steps(), ckpt.stamped_identity)
        training = build_training(config, plan, engine)
        state, progress = _restore(ckpt, training.state, work)
        run = Run(
            config=config,
            plan=plan,
            workdir=work,
            engine=engine,
            data=data,
            training=training,
            checkpointer=ckpt,
            lock=lock,
            train_loader=_train_loader(config, plan, data, progress, work),
            is_main=jax.process_index() == 0,
        )
    except BaseException:
        if ckpt is not None:  # its threads, left open, log an error at exit
            Closer(("checkpoints", ckpt.close)).close(quiet=True)
        if lock is not None:
            lock.release()
        raise
    if run.is_main:
        start = f"resuming at step {progress.step}" if progress.step else "starting"
        logging.info("%s | %s", plan.describe(), start)
    return run, state, progress
