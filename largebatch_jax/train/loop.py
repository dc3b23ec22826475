"""The loop: steps from the restored one to the last, with logging, evaluation and
checkpoints at the points `Triggers` names, and a preemption notice answered between
steps."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
from absl import logging

from largebatch_jax import lock, schedules
from largebatch_jax.metrics import TrainClock
from largebatch_jax.train.errors import LOST_PROCESS_EXIT, first_line, lost_processes
from largebatch_jax.train.reporting import MetricLog, evaluate_and_log
from largebatch_jax.train.signals import AGREEMENT_SECONDS, DeferredInterrupt, Preemption
from largebatch_jax.train.state import Progress, Run


@dataclasses.dataclass(frozen=True)
class Due:
    report: bool  # fetch the pending metrics and write a row
    epoch_end: bool
    evaluate: bool
    checkpoint: bool


@dataclasses.dataclass(frozen=True)
class Triggers:
    """Which of logging, an epoch's end, evaluation and a checkpoint fall on a step. The
    last step has all but the epoch's end, which it has when the epochs are whole."""

    log_every: int
    steps_per_epoch: int
    eval_every: int
    checkpoint_every: int
    last: int

    @classmethod
    def of(cls, config: Any, steps_per_epoch: int, total_steps: int) -> Triggers:
        eval_every = max(1, schedules.epochs_to_steps(config.eval_every_epochs, steps_per_epoch))
        return cls(
            config.log_every_steps,
            steps_per_epoch,
            eval_every,
            config.checkpoint_every_steps,
            total_steps,
        )

    def at(self, step: int) -> Due:
        last = step == self.last
        epoch_end = step % self.steps_per_epoch == 0
        evaluate = step % self.eval_every == 0 or last
        checkpoint = step % self.checkpoint_every == 0 or last
        log = step % self.log_every == 0 or epoch_end or last
        return Due(log or evaluate or checkpoint, epoch_end, evaluate, checkpoint)


def device_batches(run: Run) -> Iterator[tuple[Any, dict]]:
    """(global batch on the devices, the loader's position after it), in step order."""

    def local_batches():
        for batch in run.train_loader:
            del batch["index"]  # record ids: for tests and debugging, not for the devices
            yield batch, run.train_loader.get_state()

    if run.config.prefetch_batches:
        return run.engine.prefetch(local_batches(), run.config.prefetch_batches)
    return ((run.engine.shard_batch(b), s) for b, s in local_batches())


def compile_train_step(run: Run, clock: TrainClock, state: Any, batch: Any):
    """The train step compiled for this state and batch; its time is reported on its own
    and is not training time."""
    with clock.paused("compile"):
        compiled = run.training.train_step.lower(state, batch).compile()
    if run.is_main:
        logging.info("compiled the train step in %.1f s", clock.paused_seconds["compile"])
    return compiled


def save(
    run: Run,
    state: Any,
    progress: Progress,
    clock: TrainClock,
    interrupts: DeferredInterrupt,
    step: int,
) -> None:
    with clock.paused("checkpoint"), interrupts.deferred():
        progress.step = step
        progress.train_seconds = clock.total_seconds()
        run.checkpointer.save(step, state, progress.to_json())


def stop_for_lost_processes(run: Run, silent: list[int], answered: list[int]) -> None:
    """A preemption notice that some processes did not answer: they have died, and this
    process can neither save with them nor go on (its next collective waits for them).
    The first process that answered says so in one line; every one that answered exits
    now (from the agreement's thread: the main thread may be waiting in a collective),
    its workdir lock released, the checkpoints saved so far untouched."""
    if jax.process_index() == min(answered):
        line = lost_processes(
            silent,
            jax.process_count(),
            AGREEMENT_SECONDS,
            run.checkpointer.steps(),
            run.checkpointer.directory,
        )
        print(f"error: {line}", file=sys.stderr, flush=True)
    lock.release_held()
    os._exit(LOST_PROCESS_EXIT)


def run_steps(
    run: Run, state: Any, progress: Progress, writer: Any, clock: TrainClock
) -> tuple[Any, int | None]:
    """Run the steps from `progress.step` to the last. Returns the state and the step a
    preemption notice stopped at (its checkpoint saved), or None when the run finished.
    A runtime error of a run of several processes (a collective whose peer is gone)
    first asks whether every process is still there (`Preemption.check_peers`)."""
    lost = functools.partial(stop_for_lost_processes, run)
    with Preemption(progress.step, lost) as preemption, DeferredInterrupt() as interrupts:
        try:
            return _steps(run, state, progress, writer, clock, preemption, interrupts)
        except jax.errors.JaxRuntimeError as e:
            preemption.check_peers(first_line(e))
            raise


def _steps(
    run: Run,
    state: Any,
    progress: Progress,
    writer: Any,
    clock: TrainClock,
    preemption: Preemption,
    interrupts: DeferredInterrupt,
) -> tuple[Any, int | None]:
    stop_on_nonfinite = not run.config.skip_nonfinite  # the NaN policy
    triggers = Triggers.of(run.config, run.data.steps_per_epoch, run.total_steps)
    log = MetricLog(run, progress, writer, clock)
    batches = device_batches(run)
    step_fn = None
    if progress.step == 0:
        save(run, state, progress, clock, interrupts, 0)  # a state to fall back to
    clock.start()
    for step in range(progress.step + 1, run.total_steps + 1):
        if preemption.reached(step - 1):
            # Every row of step - 1 is written: count its steps into the checkpoint.
            log.flush(step - 1, stop_on_nonfinite, write=False)
            save(run, state, progress, clock, interrupts, step - 1)
            return state, step - 1
        batch, progress.data = next(batches)
        if step_fn is None:
            step_fn = compile_train_step(run, clock, state, batch)
        state, metrics = step_fn(state, batch)
        log.add(step, metrics)
        due = triggers.at(step)
        if due.report:
            log.flush(step, stop_on_nonfinite)
        if due.epoch_end:
            log.end_epoch(step)
        if due.evaluate:
            evaluate_and_log(run, state, writer, clock, step)
        if due.checkpoint:
            save(run, state, progress, clock, interrupts, step)
    clock.stop()
    return state, None
