"""The loop: steps from the restored one to the last, with logging, evaluation and
checkpoints at the points `Triggers` names, and a preemption notice answered between
steps."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
from absl import logging

from largebatch_jax import errors, lock
from largebatch_jax.metrics import TrainClock
from largebatch_jax.plan import Plan
from largebatch_jax.train.faults import LOST_PROCESS_EXIT, first_line, lost_processes
from largebatch_jax.train.feed import InputFeed
from largebatch_jax.train.profile import StepProfile
from largebatch_jax.train.reporting import MetricLog, evaluate_and_log
from largebatch_jax.train.signals import AGREEMENT_SECONDS, DeferredInterrupt, Preemption
from largebatch_jax.train.state import Progress, Run
from largebatch_jax.utilization import Hardware, counts_every_micro_step, step_flops


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
    def of(cls, plan: Plan) -> Triggers:
        return cls(
            plan.log_every_steps,
            plan.steps_per_epoch,
            plan.eval_every_steps,
            plan.checkpoint_every_steps,
            plan.total_steps,
        )

    def at(self, step: int) -> Due:
        last = step == self.last
        epoch_end = step % self.steps_per_epoch == 0
        evaluate = step % self.eval_every == 0 or last
        checkpoint = step % self.checkpoint_every == 0 or last
        log = step % self.log_every == 0 or epoch_end or last
        return Due(log or evaluate or checkpoint, epoch_end, evaluate, checkpoint)


def compile_train_step(run: Run, clock: TrainClock, state: Any, batch: Any) -> tuple:
    """The train step compiled for this state and batch (its time is reported on its own
    and is not training time), and what a log point compares it with (`Hardware`)."""
    with clock.paused("compile"):
        lowered = run.training.train_step.lower(state, batch)
        compiled = lowered.compile()
    plan = run.plan
    counted = counts_every_micro_step(plan.reduction, plan.accum_steps, plan.accum_loop)

    def flops() -> float | None:
        return step_flops(lowered, compiled, plan.platform) if counted else None

    hardware = Hardware.of(jax.local_devices(), flops)
    if run.is_main:
        logging.info(
            "compiled the train step in %.1f s%s",
            clock.paused_seconds["compile"],
            describe_hardware(hardware, counted),
        )
    return compiled, hardware


def describe_hardware(hardware: Hardware, counted: bool) -> str:
    if hardware.chip is None:
        return ""  # CPU: no peak to compare with
    if hardware.flops_per_step is None:
        return (
            f"; {hardware.chip.name}: no MFU (XLA counts the lax.scan over the micro-steps "
            "once; accum_loop='unroll' or reduction='exact' count them all)"
        )
    return (
        f"; {hardware.flops_per_step / 1e9:,.1f} GFLOP per device per step, against "
        f"{hardware.chip.name}'s dense bf16 peak of {hardware.chip.peak_bf16_flops / 1e12:.0f} "
        "TFLOP/s"
    )


def no_host_sync() -> Any:
    """Between log points the loop fetches nothing from the devices: on GPU and TPU any
    device-to-host transfer there raises (JAX's transfer guard; on CPU devices the
    arrays are on the host and JAX guards nothing). Log points, evaluations and
    checkpoints lift it (`host_sync`)."""
    return jax.transfer_guard_device_to_host("disallow_explicit")


def host_sync() -> Any:
    return jax.transfer_guard_device_to_host("allow")


def save(
    run: Run,
    state: Any,
    progress: Progress,
    clock: TrainClock,
    interrupts: DeferredInterrupt,
    step: int,
) -> None:
    with clock.paused("checkpoint"), interrupts.deferred(), host_sync():
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
        errors.print_error(line)
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
    c = run.config
    stop_on_nonfinite = not c.skip_nonfinite  # the NaN policy
    triggers = Triggers.of(run.plan)
    feed = InputFeed(run.train_loader, run.engine, c.prefetch_batches)
    log = MetricLog(run, progress, writer, clock, feed)
    profile = StepProfile.of(
        run.workdir,
        c.profile_steps,
        c.profile_after_steps,
        c.profile_processes,
        progress.step,
        jax.process_index(),
        jax.process_count(),
    )
    step_fn = None
    if progress.step == 0:
        save(run, state, progress, clock, interrupts, 0)  # a state to fall back to
    clock.start()
    try:
        with no_host_sync():
            for step in range(progress.step + 1, run.plan.total_steps + 1):
                if preemption.reached(step - 1):
                    # Every row of step - 1 is written: count its steps into the checkpoint.
                    with host_sync():
                        log.flush(step - 1, stop_on_nonfinite, write=False)
                    save(run, state, progress, clock, interrupts, step - 1)
                    return state, step - 1
                profile.before(step)
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    batch, progress.data = next(feed)
                    if step_fn is None:
                        step_fn, log.hardware = compile_train_step(run, clock, state, batch)
                    state, metrics = step_fn(state, batch)
                    log.add(step, metrics)
                profile.after(step, state, clock)
                due = triggers.at(step)
                if due.report:
                    with host_sync():
                        log.flush(step, stop_on_nonfinite)
                if due.epoch_end:
                    log.end_epoch(step)
                if due.evaluate:
                    with host_sync():
                        evaluate_and_log(run, state, writer, clock, step)
                if due.checkpoint:
                    save(run, state, progress, clock, interrupts, step)
    finally:
        profile.stop()
    clock.stop()
    return state, None
