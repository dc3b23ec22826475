"""Metrics and the clock: the writers (TensorBoard, metrics.jsonl), the
training clock behind images/s and ETA, and the log filter for orbax.

metrics.jsonl holds one JSON object per written line (`step`, `epoch` and scalars); it is
appended to across restarts, so readers keep the last line written for each step and kind.
"""

from __future__ import annotations

import contextlib
import json
import logging as std_logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from absl import logging

from largebatch_jax import private


class JsonlWriter:
    """metrics.jsonl: one line per `write_scalars` call.

    A crash or a full disk in the middle of an append can leave a torn last line; the
    writer cuts it off when it opens the file (so the next line never joins it) and cuts
    back a line whose own write failed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        repair_torn_tail(self.path)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        with self.path.open("ab") as f:
            size = f.tell()
            try:
                f.write((json.dumps(row) + "\n").encode())
                f.flush()
            except OSError:
                with contextlib.suppress(OSError):
                    f.truncate(size)
                raise

    def write_summary(self, step: int, summary: Any) -> None:
        pass  # TensorBoard's alone (the config's text, the hyper-parameters)

    def flush(self) -> None:
        pass  # every line is written (and closed) when it is made

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """TensorBoard's event file of the scalars, written with the `tensorboard` package's
    record format and protos alone: clu's and flax's writers, and tensorboard's own
    EventFileWriter, import TensorFlow for this (3.7 s of every start-up)."""

    def __init__(self, logdir: str | Path):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self._records = RecordWriter(open(Path(logdir) / name, "ab"))  # noqa: SIM115
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()
        ]
        self._write(
            event_pb2.Event(
                wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)
            )
        )

    def write_summary(self, step: int, summary: Any) -> None:
        """A prepared Summary proto (`run_summaries`)."""
        from tensorboard.compat.proto import event_pb2

        self._write(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()


class Writers:
    """Every scalar to each of `writers` (the shape of clu's MultiWriter, without the
    TensorFlow that importing clu's writers brings)."""

    def __init__(self, writers: list):
        self.writers = writers

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        for w in self.writers:
            w.write_scalars(step, scalars)

    def write_summary(self, step: int, summary: Any) -> None:
        for w in self.writers:
            w.write_summary(step, summary)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def create_writer(workdir: str | Path, is_main: bool = True) -> Writers:
    """The run's metric writer: TensorBoard events and metrics.jsonl in `workdir` on
    process 0; nothing on the others (their metrics are process 0's). The console gets
    the trainer's own lines, one per log point and one per evaluation."""
    if not is_main:
        return Writers([])
    return Writers([TensorBoardWriter(workdir), JsonlWriter(Path(workdir) / "metrics.jsonl")])


def run_summaries(config_json: str, hparams: Mapping[str, Any]) -> list:
    """TensorBoard summaries of a run: its config as text (the Text tab) and its key
    hyper-parameters (the HParams tab; its metrics are the run's scalars). Made with
    tensorboard's own summary functions, which need no TensorFlow for these."""
    from tensorboard.plugins.hparams import summary_v2 as hparams_summary
    from tensorboard.plugins.text import summary_v2 as text_summary

    text = "```\n" + config_json + "\n```"  # the Text tab renders markdown
    return [text_summary.text_pb("config", text), hparams_summary.hparams_pb(dict(hparams))]


def repair_torn_tail(path: Path) -> None:
    """Cut a torn last line (no newline: its write never finished) off `path`."""
    try:
        with path.open("rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
                logging.warning("cut a torn last line off %s (a write that never finished)", path)
    except FileNotFoundError:
        pass


def read_metrics(workdir: str | Path) -> list[dict]:
    """metrics.jsonl lines, deduplicated: for each (step, set of keys) the last one written
    (a run resumed from a checkpoint rewrites the steps after it). A line that is not
    JSON (torn by a crash, before the writer cut such lines) is skipped with a warning:
    the rerun that follows a crash rewrites every row after its checkpoint."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    latest: dict[tuple, dict] = {}
    torn = foreign = 0
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                foreign += 1  # JSON, but not a row this program writes
                continue
            latest[(row["step"], tuple(sorted(row)))] = row
    if torn:
        logging.warning("%s: skipped %d torn line(s) that are not JSON", path, torn)
    if foreign:
        logging.warning("%s: skipped %d line(s) that are not metric rows", path, foreign)
    return sorted(latest.values(), key=lambda r: r["step"])


class TrainClock:
    """Seconds of training only: paused around evaluation, checkpoint saves and
    compiles (each paused span is added up under its name), and continued from the
    `previous_seconds` a checkpoint saved, so the total survives restarts. Images/s and
    ETA come from it, not from the wall clock."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        previous_seconds: float = 0.0,
        timer: Callable[[], float] = time.perf_counter,
        started_at: float | None = None,
    ):
        self.total_steps = total_steps
        self.previous_seconds = float(previous_seconds)
        self.paused_seconds: dict[str, float] = {}
        self._timer = timer
        # Wall clock of this session: from `started_at` (e.g. before the run was built).
        self._started_at = timer() if started_at is None else started_at
        self._session = 0.0  # training seconds of this session, up to _running_since
        self._running_since: float | None = None
        self._last = (start_step, 0.0)  # (step, session seconds) at the last progress()

    def start(self) -> None:
        if self._running_since is None:
            self._running_since = self._timer()

    def stop(self) -> None:
        if self._running_since is not None:
            self._session += self._timer() - self._running_since
            self._running_since = None

    @contextlib.contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """Not training while inside: `what` ('eval', 'checkpoint', 'compile') is timed."""
        running = self._running_since is not None
        self.stop()
        began = self._timer()
        try:
            yield
        finally:
            self.paused_seconds[what] = self.paused_seconds.get(what, 0.0) + (self._timer() - began)
            if running:
                self.start()

    def session_seconds(self) -> float:
        running = 0.0 if self._running_since is None else self._timer() - self._running_since
        return self._session + running

    def total_seconds(self) -> float:
        """Training seconds of the run so far, every session before this one included."""
        return self.previous_seconds + self.session_seconds()

    def wall_seconds(self) -> float:
        """Wall seconds since this session started (start-up, compiles, evals and all)."""
        return self._timer() - self._started_at

    def interval(self, step: int) -> tuple[int, float]:
        """(steps, training seconds) since the last call (or since `start_step`)."""
        now = self.session_seconds()
        last_step, last_seconds = self._last
        self._last = (step, now)
        return step - last_step, now - last_seconds

    def progress(self, step: int, images_per_step: int) -> tuple[float, float]:
        """(images/s, ETA seconds) over the training time since the last call."""
        steps, elapsed = self.interval(step)
        return rate_and_eta(steps, elapsed, images_per_step, self.total_steps - step)


def rate_and_eta(
    steps: int, seconds: float, images_per_step: int, left: int
) -> tuple[float, float]:
    """(images/s, seconds for the `left` steps at that pace) of `steps` steps in `seconds`."""
    if steps <= 0 or seconds <= 0:
        return 0.0, math.inf
    return steps * images_per_step / seconds, seconds / steps * left


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


# Libraries whose INFO records say nothing about the run: orbax logs several per
# checkpoint save, tfds two per dataset load, JAX's distributed start two per process,
# JAX's profiler two per trace (the project names the trace): JAX's by their source files,
# private paths (`private.JAX_LOG_SOURCES`).
# Their warnings and errors stay.
_QUIET_PACKAGES = ("/orbax/", "/tensorflow_datasets/", *private.JAX_LOG_SOURCES)


# Their warnings that say nothing to the user either: tfds scanning a data_dir (a dataset
# not, or not fully, prepared there is the project's own one-line error, with the command
# that prepares it); orbax's advice when a save waits for the one before it (a run saving
# often, as the tests' do; the run reports its checkpoint time in result.json).
_QUIET_WARNINGS = ("Variant folder ", "Waiting for previous save to complete")


class _DropLibraryInfo(std_logging.Filter):
    def filter(self, record: std_logging.LogRecord) -> bool:
        path = record.pathname.replace("\\", "/")
        noisy = any(p in path for p in _QUIET_PACKAGES)
        if noisy and str(record.msg).startswith(_QUIET_WARNINGS):
            return False
        return not (noisy and record.levelno < std_logging.WARNING)


def filter_library_logs() -> None:
    """Keep the log to the run's own lines (idempotent); other records pass untouched,
    so the run's INFO lines show at absl's default verbosity."""
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
        handler.addFilter(_DropLibraryInfo())
