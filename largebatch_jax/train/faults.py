"""The faults a run turns into one line: a non-finite update, Ctrl-C, a full disk, a
process of the run lost."""

from __future__ import annotations

from pathlib import Path

from largebatch_jax import workdir as wd
from largebatch_jax.errors import NonFiniteLossError, RunInterruptedError, WorkdirError

# The exit code of the processes that stop because others of the run did not answer
# (sysexits' EX_TEMPFAIL: the checkpoints are good, a rerun resumes).
LOST_PROCESS_EXIT = 75


def lost_processes(
    silent: list[int], processes: int, seconds: float, kept: list[int], checkpoints: Path
) -> str:
    """The line for processes that did not join the agreement on a stop step."""
    who = f"process {silent[0]}" if len(silent) == 1 else f"processes {silent}"
    return (
        f"{who} of {processes} did not answer the others within {seconds:g} s of a SIGTERM "
        "or a failed collective: "
        f"{'it has' if len(silent) == 1 else 'they have'} died or lost "
        f"{'its' if len(silent) == 1 else 'their'} host; checkpoints at steps {kept} in "
        f"{checkpoints} are intact; rerun the same command to resume from step "
        f"{max(kept, default=0)}."
    )


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0]


def one_line_error(
    error: BaseException, kept: list[int], checkpoints: Path, workdir: Path
) -> BaseException | None:
    """The one-line error a known fault becomes (non-finite update, SIGINT, disk full,
    a read-only file system), or None. Called after the checkpointer has closed: every
    save has finished, and `kept` are the steps of the checkpoints in `checkpoints`."""
    where = f"checkpoints at steps {kept} in {checkpoints} are intact"
    if isinstance(error, NonFiniteLossError):
        return NonFiniteLossError(
            error.step,
            error.epoch,
            f"non-finite loss, gradient or update at step {error.step} (epoch "
            f"{error.epoch:.2f}): {where}; rerun the same command with "
            f"--config.skip_nonfinite=True to resume from step {max(kept, default=0)} "
            "skipping such updates, or lower the learning rate in a new workdir.",
        )
    if isinstance(error, KeyboardInterrupt):
        return RunInterruptedError(
            f"interrupted (SIGINT): {where}; rerun the same command to resume from step "
            f"{max(kept, default=0)}."
        )
    if wd.is_disk_full(error):
        return WorkdirError(
            f"no space left on the device of --workdir={workdir}: {where}; free space "
            "and rerun the same command to resume."
        )
    if wd.is_read_only(error) or wd.is_io_error(error):
        return WorkdirError(
            f"the file system of --workdir={workdir} became read-only or failed a write (a "
            f"disk error, or remounted): {where}; rerun the same command once it is writable "
            "again."
        )
    return None
