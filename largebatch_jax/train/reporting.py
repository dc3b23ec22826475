"""What a run reports: the training metrics of the steps since the last log point (one
host sync per log point), the epochs' mean training error, and the evaluations."""

from __future__ import annotations

from typing import Any

import jax
from absl import logging

from largebatch_jax.data import loader
from largebatch_jax.metrics import TrainClock, format_eta
from largebatch_jax.train.errors import NonFiniteLossError
from largebatch_jax.train.state import Progress, Run

TRAIN_SCALARS = ("train_loss", "train_error", "learning_rate", "grad_norm", "param_norm")


class MetricLog:
    """The training metrics of the steps since the last log point, left on the devices.
    `flush` fetches them all in one host sync (the loop's only one outside evaluation),
    counts each finite update into `progress`'s epoch sums and writes a row."""

    def __init__(self, run: Run, progress: Progress, writer: Any, clock: TrainClock):
        self.run, self.progress, self.writer, self.clock = run, progress, writer, clock
        self.pending: list[tuple[int, dict]] = []

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
        spe = self.run.data.steps_per_epoch
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
        epoch = str((step - 1) // self.run.data.steps_per_epoch)
        sums = self.progress.epoch_sums.setdefault(epoch, [0.0, 0.0, 0])
        sums[0] += float(m["train_error"])
        sums[1] += float(m["train_loss"])
        sums[2] += 1

    def _write(self, step: int, last: dict) -> None:
        run = self.run
        images_per_sec, eta = self.clock.progress(step, run.config.batch_size)
        scalars = {
            "epoch": step / run.data.steps_per_epoch,
            **{k: last[k] for k in TRAIN_SCALARS},
            "images_per_sec": images_per_sec,
            "skipped_steps": self.progress.skipped,
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
        spe = self.run.data.steps_per_epoch
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


def evaluate(run: Run, state: Any) -> dict:
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
    writer.write_scalars(step, {"epoch": step / run.data.steps_per_epoch, **result})
    if run.is_main:
        logging.info(
            "eval at epoch %.2f: top-1 error %.4f top-5 %.4f",
            step / run.data.steps_per_epoch,
            result["val_error_top1"],
            result["val_error_top5"],
        )
