"""The loop: steps from the restored one to the last, with logging, evaluation and
checkpoints at the points `Triggers` names, and a preemption notice answered between
steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from absl import logging

from largebatch_jax import schedules
from largebatch_jax.metrics import TrainClock
from largebatch_jax.train.reporting import MetricLog, evaluate_and_log
from largebatch_jax.train.signals import DeferredInterrupt, Preemption
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


def run_steps(
    run: Run, state: Any, progress: Progress, writer: Any, clock: TrainClock
) -> tuple[Any, int | None]:
    """Run the steps from `progress.step` to the last. Returns the state and the step a
    preemption notice stopped at (its checkpoint saved), or None when the run finished."""
    stop_on_nonfinite = not run.config.skip_nonfinite  # the NaN policy
    triggers = Triggers.of(run.config, run.data.steps_per_epoch, run.total_steps)
    log = MetricLog(run, progress, writer, clock)
    batches = device_batches(run)
    step_fn = None
    with Preemption() as preemption, DeferredInterrupt() as interrupts:
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
