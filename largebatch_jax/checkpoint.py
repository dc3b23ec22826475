"""Checkpoints with orbax: the train state (params, optimizer, BN statistics, step) and a
JSON of the host-side state (data loader position, partial epoch sums).

Saves are atomic (orbax writes a temporary directory and renames it), so a run killed at
any moment leaves only complete checkpoints behind. Restoring tries the newest first and
falls back to older ones if a checkpoint cannot be read. Nothing here deletes a
checkpoint except orbax's rotation of the oldest beyond `keep`. A save is not started
when the disk lacks the room for it (an OSError ENOSPC, before anything is written).
"""

from __future__ import annotations

import errno
import logging as pylogging
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class _OrbaxErrorsInOneLine(pylogging.Filter):
    """Orbax logs a failure of its background save threads with the whole traceback,
    often dozens of them for one full disk; the same error reaches the main thread (at
    the next save or the final wait), which reports or raises it. Its log keeps one line
    per failure: the message and the exception's first line."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        if record.exc_info and "/orbax/" in record.pathname:
            error = record.exc_info[1]
            first = (str(error).splitlines() or [""])[0]
            record.msg = f"{record.getMessage()} ({type(error).__name__}: {first})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _log_orbax_errors_in_one_line() -> None:
    absl_logger = pylogging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrorsInOneLine) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxErrorsInOneLine())


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        _log_orbax_errors_in_one_line()
        self.manager = ocp.CheckpointManager(
            self.directory,
            # A save cut short (SIGKILL, a full disk) leaves a temporary directory that
            # restore never reads; it is removed when the next run opens the manager.
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, cleanup_tmp_directories=True
            ),
            item_names=("state", "host"),
        )

    def steps(self) -> list[int]:
        """The finished checkpoints on disk (a save in progress is a temporary directory)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def save(self, step: int, state: Any, host_state: dict) -> bool:
        """Save at `step` unless a checkpoint of that step exists (never overwritten)."""
        if step in self.manager.all_steps():
            return False
        _check_room(self.directory, state)
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host_state)
            ),
            force=True,
        )

    def restore_latest(self, template: Any) -> tuple[Any, dict] | None:
        """The newest readable checkpoint as (state, host_state), shaped and placed like
        `template`; None when there is none. Unreadable ones are reported and skipped."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        for step in reversed(self.steps()):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()
                    ),
                )
                return restored["state"], dict(restored["host"])
            except Exception as e:  # a corrupt or partial checkpoint: use the one before
                logging.warning(
                    "checkpoint at step %d cannot be read (%s: %s) in %s; trying the previous one",
                    step,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                    self.directory,
                )
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _check_room(directory: Path, state: Any) -> None:
    """A full disk found before a save, not in orbax's threads half-way through it: the
    checkpoint holds each array once (its global size), plus a little metadata."""
    need = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)) * 1.05 + (1 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device for a checkpoint of {need / 2**20:.1f} MiB "
            f"({free / 2**20:.1f} MiB free)",
            str(directory),
        )
