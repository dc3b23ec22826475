"""The console of a process of a multi-process run, passed through a filter process:
gloo's connection lines dropped, and JAX's abort when its coordination service loses a
process of the run (JAX's errors, a C++ stack trace and Python's dump of every thread,
dozens of lines) said in one line.

`start` (main.py, once the run is joined) routes a file descriptor through
`python -m largebatch_jax.console`, a child process rather than a thread: what is
written just before the process dies still comes out, and the child says the one line
once its parent is gone. Importing this module imports no JAX and changes nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

# Gloo (JAX's CPU collectives across processes) prints a line to stdout each time a group
# of devices connects ("[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of
# connected peer ranks is : 7"), in pieces that the devices' threads interleave: a line
# may hold any run of those pieces, down to a bare number ("7") or nothing at all (two
# threads' line ends side by side: an empty line).
GLOO_NOISE = re.compile(r"\[Gloo\]|peer ranks|is connected to|^\s*\d*\s*$")

# The first line of JAX's abort (jax 0.10.2, XLA's coordination service and agent): the
# service reports processes without heartbeats, the agent polls that error or finds the
# service gone, the client ends the process. Everything after it is the abort's.
ABORT_START = re.compile(
    rb"coordination_service\.cc:\d+\] .*stopped sending heartbeats"
    rb"|coordination_service_agent\.cc:\d+\] Polled an error from coordination service"
    rb"|client\.h:\d+\] Terminating process because the JAX distributed service detected"
)
# Within it: the processes without heartbeats, one per line, until this line.
_LOST_LIST = re.compile(rb"stopped sending heartbeats\):\s*$")
_LIST_END = re.compile(rb"^The tasks have crashed")
_TASK = re.compile(rb"^\s*(?:/job:\S+/task:)?(\d+)\s*$")


def abort_line(
    lost: list[int], checkpoints: Path | None, paused: float = 0.0, heartbeat: int | None = None
) -> str:
    """What the abort means, in one line: who is gone, or that the whole job was paused
    (`paused` seconds without running, at least half the heartbeat timeout), and what a
    rerun does."""
    kept = _steps(checkpoints)
    where = f"checkpoints at steps {kept} in {checkpoints}" if checkpoints else "the checkpoints"
    advice = ""
    if was_paused(paused, heartbeat):
        limit = f"--heartbeat_timeout_seconds={heartbeat}" if heartbeat else "the heartbeat"
        what = (
            f"this job was paused for {paused:.0f} s (stopped by a signal, a scheduler's "
            f"suspend or a paused VM), longer than its heartbeat allows ({limit}): JAX's "
            "coordination service took its processes for dead"
        )
        advice = (
            "; where jobs may be suspended, raise --heartbeat_timeout_seconds above the "
            "longest pause"
        )
    elif lost:
        who = f"process {lost[0]}" if len(lost) == 1 else f"processes {lost}"
        what = (
            f"{who} of the run stopped sending heartbeats (--heartbeat_timeout_seconds): "
            f"{'it has' if len(lost) == 1 else 'they have'} died or lost "
            f"{'its' if len(lost) == 1 else 'their'} host"
        )
    else:
        what = (
            "process 0, which runs JAX's coordination service, is gone (it died or lost its host)"
        )
    return (
        f"error: {what}; JAX stopped the others; {where} are intact; rerun the same "
        f"command to resume{f' from step {max(kept)}' if kept else ''}{advice}."
    )


def was_paused(paused: float, heartbeat: int | None) -> bool:
    """A stretch without running long enough to explain missed heartbeats: half the
    timeout (the heartbeats before it may have been late), 5 s where it is not known."""
    return paused >= (heartbeat / 2 if heartbeat else 5.0)


class PauseWatch:
    """The time this process last went without running: a thread wakes every TICK
    seconds and measures on CLOCK_BOOTTIME, which goes on while a process is stopped
    (SIGSTOP, SLURM's suspend) and while the machine sleeps. The filter is part of the
    job, so a pause of the job stops it too."""

    TICK = 0.5

    def __init__(self) -> None:
        self._pauses: list[tuple[float, float]] = []  # (when it ended, how long)
        threading.Thread(target=self._watch, daemon=True, name="pause-watch").start()

    def _watch(self) -> None:
        last = time.clock_gettime(time.CLOCK_BOOTTIME)
        while True:
            time.sleep(self.TICK)
            now = time.clock_gettime(time.CLOCK_BOOTTIME)
            if now - last > 2 * self.TICK + 1.0:
                self._pauses = [*self._pauses[-9:], (now, now - last - self.TICK)]
            last = now

    def recent(self, within: float) -> float:
        """The longest pause that ended in the last `within` seconds (0 if none)."""
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max((length for end, length in self._pauses if now - end <= within), default=0.0)


def _steps(checkpoints: Path | None) -> list[int]:
    if checkpoints is None or not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())


def filtered(
    lines: Iterable[bytes],
    drop: re.Pattern | None = None,
    rank: int | None = None,
    checkpoints: Path | None = None,
    paused: Callable[[], float] = lambda: 0.0,
    heartbeat: int | None = None,
) -> Iterator[bytes]:
    """`lines` without those `drop` matches; where JAX's abort begins (`rank` given), the
    rest is swallowed and, at the end, one line says it: from process 0 when the service
    names the processes it lost, from process 1 when the service itself (process 0) is
    gone, so that one process of the run says it; where the job was paused (`paused()`
    seconds, against the `heartbeat` timeout), process 0 says so."""
    aborting, listing, lost = False, False, []
    for line in lines:
        if aborting:
            if listing and _LIST_END.search(line):
                listing = False
            elif listing and (task := _TASK.match(line)):
                lost.append(int(task[1]))
            elif _LOST_LIST.search(line) and not lost:
                listing = True
            continue
        if rank is not None and ABORT_START.search(line):
            aborting, listing = True, bool(_LOST_LIST.search(line))
            continue
        if drop is None or not drop.search(line.decode(errors="replace")):
            yield line
    if not aborting:
        return
    pause = paused()
    # A whole job paused: process 0, whose service took them for dead, is there to say
    # it (the others see the service's list, or not, by how their resumes fell).
    speaker = 0 if lost or was_paused(pause, heartbeat) else 1
    if rank == speaker:
        yield (abort_line(sorted(set(lost)), checkpoints, pause, heartbeat) + "\n").encode()


def start(fd: int, *options: str) -> None:
    """From now on, what this process writes to `fd` (native code included) passes
    through `python -m largebatch_jax.console OPTIONS`. The child ignores SIGTERM and
    SIGINT (a scheduler signals every process of a job step) and ends when the last
    writer of the pipe is gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    target = os.dup(fd)
    subprocess.Popen(
        [sys.executable, "-m", "largebatch_jax.console", *options], stdin=read, stdout=target
    )
    os.close(read)
    os.close(target)
    os.dup2(write, fd)
    os.close(write)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m largebatch_jax.console")
    parser.add_argument("--drop", help="drop the lines this regular expression finds")
    parser.add_argument("--rank", type=int, help="this process's index: say JAX's abort")
    parser.add_argument("--checkpoints", type=Path, help="the run's checkpoints, to name them")
    parser.add_argument("--heartbeat", type=int, help="the run's heartbeat timeout, seconds")
    args = parser.parse_args(argv)
    drop = re.compile(args.drop) if args.drop else None
    out = sys.stdout.buffer
    watch = PauseWatch() if args.rank is not None else None
    # JAX aborts within a heartbeat timeout of the job's return: older pauses are not it.
    paused = (lambda: watch.recent(2 * (args.heartbeat or 60))) if watch else (lambda: 0.0)
    for line in filtered(
        sys.stdin.buffer, drop, args.rank, args.checkpoints, paused, args.heartbeat
    ):
        out.write(line)
        out.flush()


if __name__ == "__main__":
    main()
