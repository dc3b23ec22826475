"""What a run reports: the training metrics of the steps since the last log point (one
host sync per log point), the epochs' mean training error, and the evaluations."""

from __future__ import annotations

from typing import Any

import jax
from absl import logging

from largebatch_jax.data import loader
from largebatch_jax.errors import NonFiniteLossError
from largebatch_jax.metrics import TrainClock, format_eta, rate_and_eta
from largebatch_jax.plan import Plan
from largebatch_jax.train.feed import InputFeed
from largebatch_jax.train.state import Progress, Run
from largebatch_jax.utilization import Hardware

TRAIN_SCALARS = ("train_loss", "train_error", "learning_rate", "grad_norm", "param_norm")


# The figures of each log point that time the run rather than train it: they differ
# from run to run and layout to layout, every other scalar is the same bits.
TIMING_SCALARS = (
    "images_per_sec",
    "images_per_sec_per_device",
    "step_ms",
    "input_wait",
    "tflops_per_device",
    "mfu",
    "peak_memory_gib",
    "memory_limit_gib",
)

# The share of a log interval's training time spent waiting for the input above which
# the log says once what to change (the first interval of a session, which starts the
# loader's workers, is not judged).
INPUT_WAIT_WARNING = 0.5


class MetricLog:
    """The training metrics of the steps since the last log point, left on the devices.
    `flush` fetches them all in one host sync (the loop's only one outside evaluation),
    counts each finite update into `progress`'s epoch sums and writes a row, with the
    interval's step time, input wait and, on GPU and TPU, TFLOP/s, MFU and memory."""

    def __init__(
        self,
        run: Run,
        progress: Progress,
        writer: Any,
        clock: TrainClock,
        feed: InputFeed,
        hardware: Hardware | None = None,
    ):
        self.run, self.progress, self.writer, self.clock = run, progress, writer, clock
        self.feed, self.hardware = feed, hardware
        self.pending: list[tuple[int, dict]] = []
        self._intervals = 0
        self._warned = False
        self._input_bound: tuple | None = None  # the interval to judge, once it is logged

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def flush(self, step: int, stop_on_nonfinite: bool, write: bool = True) -> None:
        """`stop_on_nonfinite`: a non-finite update raises NonFiniteLossError; else it is
        counted as skipped (the step left the state as it was). `write=False`: count the
        pending steps (the epoch sums a checkpoint carries) without a metrics row, at a
        step where an uninterrupted run writes none."""
        if not self.pending:
            return
        steps = [s for s, _ in self.pending]
        fetched = jax.device_get([m for _, m in self.pending])
        self.pending.clear()
        skipped = self.progress.skipped
        spe = self.run.plan.steps_per_epoch
        for s, m in zip(steps, fetched, strict=True):
            if m["nonfinite"] and stop_on_nonfinite:
                raise NonFiniteLossError(s, s / spe)
            self._count(s, m)
        if self.progress.skipped > skipped and self.run.is_main:
            logging.warning(
                "step %d: %d of %d updates skipped so far (non-finite loss, gradient or "
                "update; skip_nonfinite=True)",
                step,
                self.progress.skipped,
                step,
            )
        if write:
            self._write(step, fetched[-1])

    def _count(self, step: int, m: dict) -> None:
        if m["nonfinite"]:
            self.progress.skipped += 1
            return
        epoch = str((step - 1) // self.run.plan.steps_per_epoch)
        sums = self.progress.epoch_sums.setdefault(epoch, [0.0, 0.0, 0])
        sums[0] += float(m["train_error"])
        sums[1] += float(m["train_loss"])
        sums[2] += 1

    def _write(self, step: int, last: dict) -> None:
        run = self.run
        timing, eta = self._timing(step)
        scalars = {
            "epoch": run.plan.epoch(step),
            **{k: last[k] for k in TRAIN_SCALARS},
            "skipped_steps": self.progress.skipped,
            **timing,
        }
        self.writer.write_scalars(step, scalars)
        if run.is_main:  # every scalar is in metrics.jsonl and TensorBoard
            logging.info(
                "step %d/%d epoch %.2f | loss %.4g error %.4f lr %.4g | %s | ETA %s "
                "(training time only)",
                step,
                run.plan.total_steps,
                scalars["epoch"],
                last["train_loss"],
                last["train_error"],
                last["learning_rate"],
                describe_timing(timing),
                format_eta(eta),
            )
        if self._input_bound is not None:  # after the line it is about
            self._warn_if_input_bound(*self._input_bound)
            self._input_bound = None

    def _timing(self, step: int) -> tuple[dict[str, float], float]:
        """The interval's timing scalars (TIMING_SCALARS), and the ETA at its pace."""
        run = self.run
        steps, seconds = self.clock.interval(step)
        waited, fed = self.feed.take_wait()
        rate, eta = rate_and_eta(steps, seconds, run.plan.kn, run.plan.total_steps - step)
        timing = {
            "images_per_sec": rate,
            "images_per_sec_per_device": rate / run.engine.num_devices,
            "step_ms": 1000 * seconds / steps if steps > 0 else 0.0,
            "input_wait": min(1.0, waited / seconds) if seconds > 0 else 0.0,
        }
        hw = self.hardware
        use = hw.tflops_and_mfu(steps, seconds) if hw is not None else None
        if use is not None:
            timing["tflops_per_device"], timing["mfu"] = use
        memory = hw.memory() if hw is not None else None
        if memory is not None:
            timing["peak_memory_gib"] = memory[0] / 2**30
            timing["memory_limit_gib"] = memory[1] / 2**30
        self._intervals += 1
        if self._intervals > 1 and not self._warned and run.is_main:
            self._input_bound = (step, steps, timing["input_wait"], waited, fed)
        return timing, eta

    def _warn_if_input_bound(
        self, step: int, steps: int, share: float, waited: float, fed: int
    ) -> None:
        if share <= INPUT_WAIT_WARNING or waited <= 0:
            return
        self._warned = True
        c, local = self.run.config, self.run.train_loader.local_batch
        logging.warning(
            "step %d: the loop waited for its input %.0f%% of the last %d steps' training "
            "time; this host's input delivered %.0f images/s (%d per step): raise "
            "config.workers (now %d decoding processes) or config.threads (now %d per "
            "process), or give this host more cores",
            step,
            100 * share,
            steps,
            fed * local / waited,
            local,
            c.workers,
            c.threads,
        )

    def end_epoch(self, step: int) -> None:
        """The epoch's mean training error and loss, over its finite updates."""
        spe = self.run.plan.steps_per_epoch
        err, loss, count = self.progress.epoch_sums.pop(str(step // spe - 1), [0.0, 0.0, 0])
        if count:
            self.writer.write_scalars(
                step,
                {
                    "epoch": step / spe,
                    "epoch_train_error": err / count,
                    "epoch_train_loss": loss / count,
                },
            )


def key_hyperparameters(config: Any, plan: Plan) -> dict[str, Any]:
    """The run's key hyper-parameters in the paper's vocabulary (TensorBoard's HParams
    tab): kn, n, k, the peak rate eta, the warmup, the reduction and the dtype, and what
    tells runs apart besides."""
    c = config
    return {
        "kn": plan.kn,
        "n": plan.n,
        "k": plan.k,
        "peak_lr": plan.peak_lr,
        "warmup": c.warmup,
        "warmup_epochs": float(c.warmup_epochs),
        "reduction": plan.reduction,
        "dtype": plan.dtype,
        "model": c.model,
        "dataset": c.dataset,
        "optimizer": c.optimizer,
        "lr_scaling": c.lr_scaling,
        "num_epochs": float(c.num_epochs),
        "seed": c.seed,
    }


def describe_timing(timing: dict[str, float]) -> str:
    """The timing scalars of a log line: what the run's platform measures, nothing else."""
    t = timing
    parts = [
        f"{t['images_per_sec']:.0f} img/s ({t['images_per_sec_per_device']:.0f} per device), "
        f"{t['step_ms']:.1f} ms/step, input wait {100 * t['input_wait']:.0f}%"
    ]
    if "mfu" in t:
        parts.append(f"{t['tflops_per_device']:.1f} TFLOP/s per device, MFU {100 * t['mfu']:.1f}%")
    if "peak_memory_gib" in timing:
        parts.append(
            f"memory {timing['peak_memory_gib']:.1f} of {timing['memory_limit_gib']:.1f} GiB"
        )
    return ", ".join(parts)


def evaluate(run: Run, state: Any) -> dict:
    """Every validation image once (padded, masked); returns error rates and loss."""
    totals: dict[str, float] = {}
    batches = loader.eval_batches(
        run.data.eval,
        run.data.augment,
        run.plan.eval_batch,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=run.config.workers,
        threads=run.config.threads,
    )
    try:
        for batch in batches:
            sums = jax.device_get(run.training.eval_step(state, run.engine.shard_batch(batch)))
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


def evaluate_and_log(run: Run, state: Any, writer: Any, clock: TrainClock, step: int) -> None:
    with clock.paused("eval"):
        result = evaluate(run, state)
    writer.write_scalars(step, {"epoch": run.plan.epoch(step), **result})
    if run.is_main:
        logging.info(
            "eval at epoch %.2f: top-1 error %.4f top-5 %.4f",
            run.plan.epoch(step),
            result["val_error_top1"],
            result["val_error_top5"],
        )
