"""The training loop of one run: build (checks, data, the shared builder, restore), run
(steps, logs, evaluation, checkpoints, preemption) and finish (the result).

The step itself lives in step.py and is wired by builder.py; this module adds what only
a real run needs (data, checkpoints, writers, the clock). What the host carries between
steps is one `RunState`, saved with every checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from largebatch_jax import exact, parallel, schedules
from largebatch_jax import workdir as wd
from largebatch_jax.builder import Training, build_training
from largebatch_jax.checkpoint import Checkpointer, tree_digest
from largebatch_jax.data import loader, sources
from largebatch_jax.lock import WorkdirLock, read_lock_token
from largebatch_jax.metrics import (
    TrainClock,
    create_writer,
    filter_library_logs,
    format_eta,
    read_metrics,
)
from largebatch_jax.validate import ConfigError, validate_config


class NonFiniteLossError(RuntimeError):
    """An update was not finite (loss, gradient or updated state) and skip_nonfinite is
    off; the message (trainer._one_line_error) names the step and the checkpoints kept."""

    def __init__(self, step: int, epoch: float, message: str = ""):
        super().__init__(message or f"non-finite loss, gradient or update at step {step}")
        self.step, self.epoch = step, epoch


class RunInterruptedError(Exception):
    """SIGINT (Ctrl-C) stopped the run; the in-flight checkpoint save was finished first.
    The message is one line naming the checkpoints kept."""


@dataclasses.dataclass
class RunState:
    """The host side of a run, saved with every checkpoint as one JSON: the step, the
    partial sums of the epoch's training metrics, the loader's position after the last
    trained batch, the skipped (non-finite) updates and the training seconds so far."""

    step: int = 0
    epoch_sums: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    data: dict | None = None
    skipped: int = 0
    train_seconds: float = 0.0

    def to_json(self) -> dict:
        # A copy: orbax may serialise it after save() returns, while the loop goes on.
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, blob: dict) -> RunState:
        """Tolerates checkpoints written before a field existed (it keeps its default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in blob.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Data:
    spec: sources.DatasetSpec
    train: Any
    eval: Any
    augment: loader.Augmentation
    steps_per_epoch: int


@dataclasses.dataclass
class Run:
    """Everything `build` sets up for the loop; `state` and `host` advance with it."""

    config: Any
    workdir: Path
    engine: parallel.DataParallel
    data: Data
    training: Training
    checkpointer: Checkpointer
    lock: WorkdirLock | None
    train_loader: loader.TrainLoader
    state: Any
    host: RunState
    total_steps: int
    is_main: bool


# ----------------------------------------------------------------------------- build

# Fields that may differ between hosts (paths, host CPU threads): not part of the run.
HOST_LOCAL_FIELDS = ("data_dir", "workers")


def _check_processes_agree(config: Any) -> None:
    values = {f"config.{k}": v for k, v in config.to_dict().items() if k not in HOST_LOCAL_FIELDS}
    values["local devices"] = jax.local_device_count()
    # This process's own devices (jax.devices()[0] is process 0's in every process).
    values["platform"] = jax.local_devices()[0].platform
    values["jax version"] = jax.__version__
    if config.reduction == "exact":  # the bits depend on the device model's kernels too
        values["device kind"] = jax.local_devices()[0].device_kind
    try:
        parallel.check_processes_agree(values)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _lock_workdir(work: Path) -> WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole run; every process learns whether
    it did, so that all stop together when another run holds it."""
    lock, error = None, ""
    if jax.process_index() == 0:
        try:
            lock = WorkdirLock(work)
            note = lock.acquire()
            if note:
                logging.warning("%s", note)
        except wd.WorkdirError as e:
            lock, error = None, str(e)
    if jax.process_count() > 1:
        held = multihost_utils.broadcast_one_to_all(np.int32(lock is not None or not error))
        if not held and not error:
            error = f"--workdir={work} is in use by another run (process 0 found its lock)."
        if held:
            error = error or _check_workdir_shared(work, lock)
    if error:
        if lock is not None:
            lock.release()
        raise wd.WorkdirError(error)
    return lock


def _token_word(token: str | None) -> np.ndarray:
    """A lock's token (16 hex digits) as two int32 for a collective (JAX's default
    integers are 32-bit); zeros for none."""
    try:
        return np.frombuffer(bytes.fromhex(str(token)[:16].rjust(16, "0")), np.int32).copy()
    except ValueError:
        return np.zeros(2, np.int32)


def _check_workdir_shared(work: Path, lock: WorkdirLock | None) -> str:
    """Every process must see the one workdir: each reads the token of the lock that
    process 0 has just written and all compare it with process 0's. A folder on each
    host's own disk would otherwise leave process 0 waiting for the others' part of the
    first checkpoint forever. Returns the error, or "" when the workdir is shared."""
    expected = multihost_utils.broadcast_one_to_all(_token_word(lock.token() if lock else None))
    seen = _token_word(read_lock_token(work))
    ok = multihost_utils.process_allgather(np.int32(np.array_equal(seen, expected)))
    blind = [i for i, good in enumerate(np.ravel(ok)) if not good]
    if not blind:
        return ""
    return (
        f"--workdir={work} is not one folder that every process sees: process"
        f"{'es' if len(blind) > 1 else ''} {', '.join(map(str, blind))} of "
        f"{jax.process_count()} cannot see the lock process 0 wrote there: give every "
        "process the same workdir on a file system they share (NFS, Lustre, GPFS), "
        "not a folder on each host's disk."
    )


def _check_record(config: Any, work: Path, checkpoints: list[int], steps_per_epoch: int) -> None:
    """The workdir's record of the config that defines its run, against this config
    (workdir.check_resume); a fresh workdir records this one."""
    recorded = wd.read_record(work)
    if checkpoints and recorded is not None:
        wd.check_resume(recorded, config, max(checkpoints), steps_per_epoch)
    elif checkpoints:
        logging.warning(
            "%s has checkpoints but no %s (written since issue 16): recording this config",
            work,
            wd.RECORD,
        )
    if jax.process_index() == 0:
        wd.write_record(work, config)


def _check_data_fits(config: Any, spec: sources.DatasetSpec, num_train: int) -> None:
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
            f"config.image_size={config.image_size} must divide {config.dataset}'s native size "
            f"{spec.native_size} (images are downscaled by box averaging)."
        )
    if config.batch_size > num_train:
        raise ConfigError(
            f"config.batch_size={config.batch_size} is larger than the training set "
            f"({num_train} images)."
        )


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
    _check_data_fits(config, spec, len(train_src))
    return Data(
        spec=spec,
        train=train_src,
        eval=eval_src,
        augment=loader.default_augmentation(spec, config.image_size, config.color_augment),
        steps_per_epoch=loader.steps_per_epoch(len(train_src), config.batch_size),
    )


def _restore(ckpt: Checkpointer, template: Any, workdir: Path) -> tuple[Any, RunState]:
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
        return template, RunState()
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
    return found.state, RunState.from_json(found.host)


def _train_loader(config: Any, data: Data, total: int, host: RunState, workdir: Path):
    train_loader = loader.TrainLoader(
        data.train,
        data.augment,
        config.batch_size,
        config.seed,
        total,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=config.workers,
    )
    if host.data is not None:
        try:
            train_loader.set_state(host.data)
        except ValueError as e:
            raise ConfigError(f"--workdir={workdir}: {e}") from None
    if train_loader.step != host.step:
        raise RuntimeError(
            f"checkpoint step {host.step} and loader step {train_loader.step} differ"
        )
    host.data = train_loader.get_state()
    return train_loader


def build(config: Any, workdir: str | Path) -> Run:
    """Check the config, the processes and the workdir; load the data; wire the step
    (`build_training`); restore the newest readable checkpoint."""
    filter_library_logs()
    _check_processes_agree(config)  # first: every process must then take the same path
    validate_config(config, jax.device_count(), jax.default_backend())
    if config.reduction == "exact":
        error = exact.check_cpu_threads(jax.default_backend(), jax.local_device_count())
        if error:
            raise ConfigError(error)
    engine = parallel.DataParallel(parallel.create_mesh(), config.parallelism)
    work = wd.resolve(workdir)
    wd.check_writable(work)
    lock = _lock_workdir(work)
    ckpt = None
    try:
        data = load_data(config)
        ckpt = Checkpointer(work / "checkpoints", config.keep_checkpoints, wd.run_identity(config))
        _check_record(config, work, ckpt.steps(), data.steps_per_epoch)
        training = build_training(config, engine, data.steps_per_epoch)
        state, host = _restore(ckpt, training.state, work)
        total = schedules.epochs_to_steps(config.num_epochs, data.steps_per_epoch)
        run = Run(
            config=config,
            workdir=work,
            engine=engine,
            data=data,
            training=training,
            checkpointer=ckpt,
            lock=lock,
            train_loader=_train_loader(config, data, total, host, work),
            state=state,
            host=host,
            total_steps=total,
            is_main=jax.process_index() == 0,
        )
    except BaseException:
        if ckpt is not None:  # its threads, left open, log an error at exit
            _Closer(("checkpoints", ckpt.close)).close(quiet=True)
        if lock is not None:
            lock.release()
        raise
    if run.is_main:
        logging.info("%s", describe(run))
    return run


def describe(run: Run) -> str:
    """One line: the layout, the paper's quantities and where the run starts."""
    c, engine = run.config, run.engine
    micro = parallel.micro_batch_size(
        c.batch_size, engine.num_devices, c.accum_steps, c.bn_group_size
    )
    peak = schedules.peak_learning_rate(
        c.base_lr, c.base_batch_size, c.batch_size, c.lr_scaling, c.lr_multiplier
    )
    start = run.host.step
    return (
        f"devices={engine.num_devices} (local {engine.num_local_devices}) "
        f"processes={jax.process_count()} | kn={c.batch_size} n={c.bn_group_size} "
        f"k={c.batch_size // c.bn_group_size} accum_steps={c.accum_steps} | "
        f"per device {micro} images/micro-step | local batch {run.train_loader.local_batch} | "
        f"peak lr {peak:.4g} | {run.data.steps_per_epoch} steps/epoch, {run.total_steps} "
        f"steps | {c.dataset}: {len(run.data.train)} train / {len(run.data.eval)} eval images"
        f" | " + (f"resuming at step {start}" if start else "starting")
    )


# ----------------------------------------------------------------------------- run


class _Preemption:
    """A scheduler's preemption notice (SIGTERM), read by the loop between steps.

    One process: our handler sets a flag. Several: JAX's preemption sync service catches
    SIGTERM on any process and makes all of them agree on the step to stop at, so they
    save the same checkpoint together (a process stopping alone would hang the others).
    """

    def __init__(self):
        self.requested = False
        self._previous = None
        self._multi = jax.process_count() > 1

    def __enter__(self):
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        del signum, frame
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (called once per step, on every process)."""
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


class _DeferredInterrupt:
    """SIGINT raises KeyboardInterrupt as usual, except while a checkpoint save is being
    started (`deferred()`): then it is raised as soon as that part is done, so a Ctrl-C
    never leaves a half-started save behind (train_and_evaluate then waits for the
    save's background part before it exits)."""

    def __init__(self):
        self._deferring, self._pending, self._previous = False, False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        del signum, frame
        if self._deferring:
            self._pending = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


_INTERRUPTS = _DeferredInterrupt()


class MetricBuffer:
    """The training metrics of the steps since the last log point, left on the devices;
    `flush` fetches them all in one host sync (the loop's only one outside evaluation),
    checks them for non-finite updates, adds them to the epoch sums and writes a line."""

    def __init__(self, run: Run, writer: Any, clock: TrainClock):
        self.run, self.writer, self.clock = run, writer, clock
        self.pending: list[tuple[int, dict]] = []

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def flush(self, step: int, write: bool = True) -> None:
        """`write=False`: count the pending steps (the epoch sums a checkpoint carries)
        without a metrics row, at a step where an uninterrupted run writes none."""
        if not self.pending:
            return
        steps = [s for s, _ in self.pending]
        fetched = jax.device_get([m for _, m in self.pending])
        self.pending.clear()
        skipped = self.run.host.skipped
        for s, m in zip(steps, fetched, strict=True):
            self._count(s, m)
        if self.run.host.skipped > skipped and self.run.is_main:
            logging.warning(
                "step %d: %d of %d updates skipped so far (non-finite loss, gradient or "
                "update; skip_nonfinite=True)",
                step,
                self.run.host.skipped,
                step,
            )
        if write:
            self._write(step, fetched[-1])

    def _count(self, step: int, m: dict) -> None:
        run, spe = self.run, self.run.data.steps_per_epoch
        if m["nonfinite"]:
            if not run.config.skip_nonfinite:
                raise NonFiniteLossError(step, step / spe)
            run.host.skipped += 1
            return
        sums = run.host.epoch_sums.setdefault(str((step - 1) // spe), [0.0, 0.0, 0])
        sums[0] += float(m["train_error"])
        sums[1] += float(m["train_loss"])
        sums[2] += 1

    def _write(self, step: int, last: dict) -> None:
        run = self.run
        images_per_sec, eta = self.clock.progress(step, run.config.batch_size)
        keys = ("train_loss", "train_error", "learning_rate", "grad_norm", "param_norm")
        scalars = {
            "epoch": step / run.data.steps_per_epoch,
            **{k: last[k] for k in keys},
            "images_per_sec": images_per_sec,
            "skipped_steps": run.host.skipped,
        }
        self.writer.write_scalars(step, scalars)
        if run.is_main:  # every scalar is in metrics.jsonl and TensorBoard
            logging.info(
                "step %d/%d epoch %.2f | loss %.4g error %.4f lr %.4g | %.0f img/s | ETA %s "
                "(training time only)",
                step,
                run.total_steps,
                scalars["epoch"],
                last["train_loss"],
                last["train_error"],
                last["learning_rate"],
                images_per_sec,
                format_eta(eta),
            )

    def end_epoch(self, step: int) -> None:
        """The epoch's mean training error and loss, over its finite updates."""
        err, loss, count = self.run.host.epoch_sums.pop(
            str(step // self.run.data.steps_per_epoch - 1), [0.0, 0.0, 0]
        )
        if count:
            self.writer.write_scalars(
                step,
                {
                    "epoch": step / self.run.data.steps_per_epoch,
                    "epoch_train_error": err / count,
                    "epoch_train_loss": loss / count,
                },
            )


def evaluate(run: Run) -> dict:
    """Every validation image once (padded, masked); returns error rates and loss."""
    totals: dict[str, float] = {}
    batches = loader.eval_batches(
        run.data.eval,
        run.data.augment,
        run.config.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=run.config.workers,
    )
    try:
        for batch in batches:
            sums = jax.device_get(run.training.eval_step(run.state, run.engine.shard_batch(batch)))
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + float(v)
    finally:
        loader.close_iterator(batches)  # its worker processes now, not at exit
    n = totals["count"]
    return {
        "val_error_top1": totals["top1_errors"] / n,
        "val_error_top5": totals["top5_errors"] / n,
        "val_loss": totals["loss_sum"] / n,
        "val_count": n,
    }


def _device_batches(run: Run) -> Iterator[tuple[Any, dict]]:
    """(global batch on the devices, the loader's position after it), in step order."""

    def local_batches():
        for batch in run.train_loader:
            del batch["index"]  # record ids: for tests and debugging, not for the devices
            yield batch, run.train_loader.get_state()

    if run.config.prefetch_batches:
        return run.engine.prefetch(local_batches(), run.config.prefetch_batches)
    return ((run.engine.shard_batch(b), s) for b, s in local_batches())


def _save(run: Run, clock: TrainClock, step: int) -> None:
    with clock.paused("checkpoint"), _INTERRUPTS.deferred():
        run.host.step = step
        run.host.train_seconds = clock.total_seconds()
        run.checkpointer.save(step, run.state, run.host.to_json())


def _evaluate_and_log(run: Run, writer: Any, clock: TrainClock, step: int) -> None:
    with clock.paused("eval"):
        result = evaluate(run)
    writer.write_scalars(step, {"epoch": step / run.data.steps_per_epoch, **result})
    if run.is_main:
        logging.info(
            "eval at epoch %.2f: top-1 error %.4f top-5 %.4f",
            step / run.data.steps_per_epoch,
            result["val_error_top1"],
            result["val_error_top5"],
        )


def _compile_train_step(run: Run, clock: TrainClock, batch: Any):
    """The train step compiled for this state and batch; its time is reported on its own
    and is not training time."""
    with clock.paused("compile"):
        compiled = run.training.train_step.lower(run.state, batch).compile()
    if run.is_main:
        logging.info("compiled the train step in %.1f s", clock.paused_seconds["compile"])
    return compiled


def train(run: Run, writer: Any, clock: TrainClock) -> int | None:
    """Run the steps from the restored one to the last; returns the step a preemption
    notice stopped at (its checkpoint saved), or None when the run finished."""
    c, spe = run.config, run.data.steps_per_epoch
    eval_every = max(1, schedules.epochs_to_steps(c.eval_every_epochs, spe))
    buffer = MetricBuffer(run, writer, clock)
    batches = _device_batches(run)
    step_fn = None
    with _Preemption() as preemption, _INTERRUPTS:
        if run.host.step == 0:
            _save(run, clock, 0)  # a good state to fall back to from step 1
        clock.start()
        for step in range(run.host.step + 1, run.total_steps + 1):
            if preemption.reached(step - 1):
                # Every flush step of step - 1 has run: a row here would be one that the
                # uninterrupted run does not have.
                buffer.flush(step - 1, write=False)
                _save(run, clock, step - 1)
                return step - 1
            batch, run.host.data = next(batches)
            if step_fn is None:
                step_fn = _compile_train_step(run, clock, batch)
            run.state, metrics = step_fn(run.state, batch)
            buffer.add(step, metrics)
            last = step == run.total_steps
            if step % c.log_every_steps == 0 or step % spe == 0 or last:
                buffer.flush(step)
            if step % spe == 0:
                buffer.end_epoch(step)
            if step % eval_every == 0 or last:
                buffer.flush(step)
                _evaluate_and_log(run, writer, clock, step)
            if step % c.checkpoint_every_steps == 0 or last:
                buffer.flush(step)
                _save(run, clock, step)
        clock.stop()
    return None


# ----------------------------------------------------------------------------- finish


def paper_metric(evals: list[dict], num_epochs: float, last_epochs: float) -> dict:
    """Paper rule 14: a run's error is the median top-1 validation error of the
    evaluations made in its last `last_epochs` epochs (5 in the paper)."""
    used = [e for e in evals if e["epoch"] > num_epochs - last_epochs + 1e-9]
    return {
        "val_error_top1_median_last_epochs": (
            float(np.median([e["val_error_top1"] for e in used])) if used else None
        ),
        "last_epochs": last_epochs,
        "evaluations_used": [
            {"epoch": e["epoch"], "val_error_top1": e["val_error_top1"]} for e in used
        ],
    }


def finish(run: Run, clock: TrainClock) -> dict:
    """The run's result from its metrics.jsonl and final state; written to result.json."""
    c = run.config
    evals = [r for r in read_metrics(run.workdir) if "val_error_top1" in r]
    final = evals[-1] if evals else {}
    result = {
        **paper_metric(evals, c.num_epochs, c.result_last_epochs),
        "final_val_error_top1": final.get("val_error_top1"),
        "final_val_error_top5": final.get("val_error_top5"),
        "steps": run.total_steps,
        "epochs": c.num_epochs,
        "skipped_steps": run.host.skipped,
        # Training time only (no evaluation, checkpoints or compiles), every session.
        "train_seconds": clock.total_seconds(),
        "train_seconds_this_session": clock.session_seconds(),
        "wall_seconds_this_session": clock.wall_seconds(),
        "paused_seconds_this_session": dict(clock.paused_seconds),
        "params_sha256": tree_digest(run.state.params),
        "batch_size": c.batch_size,
        "bn_group_size": c.bn_group_size,
        "peak_learning_rate": schedules.peak_learning_rate(
            c.base_lr, c.base_batch_size, c.batch_size, c.lr_scaling, c.lr_multiplier
        ),
        "config": c.to_dict(),
    }
    if run.is_main:
        wd.atomic_write_text(run.workdir / RESULT, json.dumps(result, indent=2, default=str) + "\n")
    return result


RESULT = "result.json"


def _finished_result(run: Run) -> dict | None:
    """A finished run's stored result: rerunning it trains nothing and rewrites nothing."""
    path = run.workdir / RESULT
    if run.host.step < run.total_steps or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # torn by a crash before it was written atomically: write it again


class _Closer:
    """Closes the run's parts once each, in order: the checkpoint manager first (waiting
    for the save in flight, so every good checkpoint stays), then the loader and the
    writers. `close(quiet=True)`, after a failure, logs what fails on the way instead of
    raising it over the error that stopped the run."""

    def __init__(self, *parts: tuple[str, Any]):
        self.parts = list(parts)

    def close(self, quiet: bool = False) -> None:
        while self.parts:
            what, close = self.parts.pop(0)
            try:
                close()
            except Exception as e:
                if not quiet:
                    raise
                logging.warning("while stopping, closing %s failed: %s", what, _first_line(e))


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0]


def _one_line_error(run: Run, error: BaseException) -> BaseException | None:
    """The one-line error a known fault becomes (non-finite update, SIGINT, disk full),
    or None. Called after the checkpointer has closed: every save has finished."""
    kept = run.checkpointer.steps()
    where = f"checkpoints at steps {kept} in {run.checkpointer.directory} are intact"
    if isinstance(error, NonFiniteLossError):
        return NonFiniteLossError(
            error.step,
            error.epoch,
            f"non-finite loss, gradient or update at step {error.step} (epoch "
            f"{error.epoch:.2f}): {where}; rerun the same command with "
            f"--config.skip_nonfinite=True to resume from step {max(kept, default=0)} "
            "skipping such updates, or lower the learning rate in a new workdir.",
        )
    if isinstance(error, KeyboardInterrupt):
        return RunInterruptedError(
            f"interrupted (SIGINT): {where}; rerun the same command to resume from step "
            f"{max(kept, default=0)}."
        )
    if wd.is_disk_full(error):
        return wd.WorkdirError(
            f"no space left on the device of --workdir={run.workdir}: {where}; free space "
            "and rerun the same command to resume."
        )
    return None


def train_and_evaluate(config: Any, workdir: str) -> dict:
    """Train and evaluate one run of the paper's recipe; resumes from `workdir`.

    Returns the result (also written to workdir/result.json), or {'preempted': step,
    'checkpoints': directory} after a SIGTERM, with that step's checkpoint saved.
    """
    started = time.perf_counter()
    run = build(config, workdir)
    closer = _Closer(("checkpoints", run.checkpointer.close), ("loader", run.train_loader.close))
    try:
        done = _finished_result(run)
        if done is not None:
            logging.info("the run in %s is finished: its %s stays as it is", run.workdir, RESULT)
            closer.close()
            return done
        clock = TrainClock(
            run.total_steps, run.host.step, run.host.train_seconds, started_at=started
        )
        writer = create_writer(run.workdir, run.is_main)
        closer.parts.append(("metric writers", writer.close))
        preempted = train(run, writer, clock)
        closer.close()
        if preempted is not None:
            return {"preempted": preempted, "checkpoints": str(run.checkpointer.directory)}
        return finish(run, clock)
    except BaseException as e:
        closer.close(quiet=True)
        known = _one_line_error(run, e)
        if known is None:
            raise
        raise known from None
    finally:
        if run.lock is not None:
            run.lock.release()
