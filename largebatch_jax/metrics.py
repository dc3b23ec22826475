"""Metrics and the clock: clu writers (logging, TensorBoard, metrics.jsonl), the
training clock behind images/s and ETA, and the log filter for orbax.

metrics.jsonl holds one JSON object per written line (`step`, `epoch` and scalars); it is
appended to across restarts, so readers keep the last line written for each step and kind.
"""

from __future__ import annotations

import contextlib
import json
import logging as std_logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from absl import logging
from clu import metric_writers


class JsonlWriter(metric_writers.MetricWriter):
    """metrics.jsonl as a clu writer: one line per `write_scalars` call.

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

    def write_summaries(self, step, values, metadata=None) -> None:
        del step, values, metadata  # scalars only

    def write_images(self, step, images) -> None:
        del step, images

    def write_videos(self, step, videos) -> None:
        del step, videos

    def write_audios(self, step, audios, *, sample_rate) -> None:
        del step, audios, sample_rate

    def write_texts(self, step, texts) -> None:
        del step, texts

    def write_histograms(self, step, arrays, num_buckets=None) -> None:
        del step, arrays, num_buckets

    def write_hparams(self, hparams) -> None:
        del hparams

    def flush(self) -> None:
        pass  # every line is written (and closed) when it is made

    def close(self) -> None:
        pass


def create_writer(workdir: str | Path, is_main: bool = True) -> metric_writers.MetricWriter:
    """The run's metric writer: the log, TensorBoard events and metrics.jsonl in `workdir`
    on process 0; nothing on the others (their metrics are process 0's)."""
    if not is_main:
        return metric_writers.MultiWriter([])
    return metric_writers.MultiWriter(
        [
            metric_writers.LoggingWriter(),
            metric_writers.SummaryWriter(str(workdir)),
            JsonlWriter(Path(workdir) / "metrics.jsonl"),
        ]
    )


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
    torn = 0
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            latest[(row["step"], tuple(sorted(row)))] = row
    if torn:
        logging.warning("%s: skipped %d torn line(s) that are not JSON", path, torn)
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

    def progress(self, step: int, images_per_step: int) -> tuple[float, float]:
        """(images/s, ETA seconds) over the training time since the last call."""
        now = self.session_seconds()
        last_step, last_seconds = self._last
        self._last = (step, now)
        steps, elapsed = step - last_step, now - last_seconds
        if steps <= 0 or elapsed <= 0:
            return 0.0, math.inf
        return steps * images_per_step / elapsed, elapsed / steps * (self.total_steps - step)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


# Libraries whose INFO records say nothing about the run: orbax logs several per
# checkpoint save, tfds two per dataset load. Their warnings and errors stay.
_QUIET_PACKAGES = ("/orbax/", "/tensorflow_datasets/")


class _DropLibraryInfo(std_logging.Filter):
    def filter(self, record: std_logging.LogRecord) -> bool:
        path = record.pathname.replace("\\", "/")
        noisy = any(p in path for p in _QUIET_PACKAGES)
        return not (noisy and record.levelno < std_logging.WARNING)


def filter_library_logs() -> None:
    """Keep the log to the run's own lines (idempotent); other records pass untouched,
    so the run's INFO lines and clu's metric lines show at absl's default verbosity."""
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _DropLibraryInfo) for f in handler.filters):
        handler.addFilter(_DropLibraryInfo())
