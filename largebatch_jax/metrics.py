"""Metric writing: clu writers (TensorBoard + logging) and a metrics.jsonl in the workdir.

metrics.jsonl holds one JSON object per written line (`step`, `epoch` and scalars); it is
appended to across restarts, so readers keep the last line written for each step and kind.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from clu import metric_writers


class MetricWriter:
    """Writes scalars to TensorBoard, the log and metrics.jsonl (process 0 only)."""

    def __init__(self, workdir: str | Path, is_main: bool = True):
        self.is_main = is_main
        self.path = Path(workdir) / "metrics.jsonl"
        self._writer = metric_writers.create_default_writer(
            str(workdir), just_logging=not is_main, asynchronous=False
        )

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        scalars = {k: float(v) for k, v in scalars.items()}
        self._writer.write_scalars(step, scalars)
        if self.is_main:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **scalars}) + "\n")

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def read_metrics(workdir: str | Path) -> list[dict]:
    """metrics.jsonl lines, deduplicated: for each (step, set of keys) the last one written
    (a run resumed from a checkpoint rewrites the steps after it)."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    latest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            latest[(row["step"], tuple(sorted(row)))] = row
    return sorted(latest.values(), key=lambda r: r["step"])


class Progress:
    """Throughput and ETA between two log points."""

    def __init__(self, total_steps: int, start_step: int):
        self.total, self.last_step, self.last_time = total_steps, start_step, time.perf_counter()

    def update(self, step: int, images_per_step: int) -> tuple[float, float]:
        now = time.perf_counter()
        steps, elapsed = step - self.last_step, max(now - self.last_time, 1e-9)
        self.last_step, self.last_time = step, now
        per_step = elapsed / max(steps, 1)
        return steps * images_per_step / elapsed, per_step * (self.total - step)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"
