"""A `jax.profiler` trace of a few steps, one config field away (`profile_steps`): into
WORKDIR/profile, where `tensorboard --logdir WORKDIR` (its Profile tab, with the
`profile` extra) and Perfetto (the `perfetto_trace.json.gz` beside it) find it. The loop
annotates every step (`StepTraceAnnotation('train', step_num=...)`) and its input
(`feed.py`), so the trace shows step boundaries and input waits. Tracing changes no value
the run computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
from absl import logging

PROFILE_DIR = "profile"


def trace_directory(workdir: Path, process_index: int, process_count: int) -> Path:
    """WORKDIR/profile; one folder per process where several trace (the trace files are
    named by host, and processes may share one)."""
    base = workdir / PROFILE_DIR
    return base if process_count == 1 else base / f"process_{process_index}"


class StepProfile:
    """Traces steps `first` to `first + steps - 1` of this session, where this process
    traces; the steps before it compile and warm up."""

    def __init__(self, directory: Path | None, first: int, steps: int):
        self.directory, self.first, self.last = directory, first, first + steps - 1
        self.active = False
        self.traced_to = first  # the last step dispatched while tracing

    @classmethod
    def of(
        cls,
        workdir: Path,
        steps: int,
        after_steps: int,
        processes: str,
        start_step: int,
        process_index: int,
        process_count: int,
    ) -> StepProfile:
        traces = steps > 0 and (processes == "all" or process_index == 0)
        directory = trace_directory(workdir, process_index, process_count) if traces else None
        return cls(directory, start_step + after_steps + 1, steps)

    def before(self, step: int) -> None:
        if self.directory is not None and step == self.first:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, state: Any, clock: Any) -> None:
        """Once the last traced step is dispatched: wait for it (training time), then
        write the trace (not training time: `clock` is paused)."""
        if not self.active:
            return
        self.traced_to = step
        if step >= self.last:
            jax.block_until_ready(state)
            with clock.paused("profile"):
                self.stop()

    def stop(self) -> None:
        """Write the trace (also where the run ends or is preempted before its last
        traced step)."""
        if not self.active:
            return
        self.active = False
        jax.profiler.stop_trace()
        written = sorted(self.directory.glob("plugins/profile/*/*.xplane.pb"))
        where = written[-1].parent if written else self.directory
        logging.info(
            "profile of steps %d-%d written to %s (tensorboard --logdir of the workdir, "
            "Profile tab; or perfetto_trace.json.gz there in ui.perfetto.dev)",
            self.first,
            self.traced_to,
            where,
        )
