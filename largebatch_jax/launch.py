"""Start a real multi-process JAX run on this machine: N processes x M CPU devices.

    python -m largebatch_jax.launch --processes 2 --devices_per_process 4 -- \\
        main.py --config=configs/smoke.py --workdir=/tmp/run

Each process is the given command plus `--coordinator_address=127.0.0.1:PORT
--num_processes=N --process_id=K`, with M fake CPU devices and gloo collectives, so the run
goes through `jax.distributed` exactly as on a cluster (one process per host). Output is
forwarded line by line with a `[pK]` prefix. If a process fails, the others get `--grace`
seconds to stop on their own (JAX's coordination service reports the lost peer), then
are killed; the launcher names the process that failed and exits non-zero. SIGTERM or
Ctrl-C is forwarded to every process (a preemption: they agree on a step, save a
checkpoint and exit 0); rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from queue import Empty, Queue
from typing import TextIO

from largebatch_jax import errors
from largebatch_jax.console import GLOO_NOISE


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices_per_process: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one process: M fake CPU devices (any other device-count flag
    removed), CPU platform, gloo collectives, unbuffered output, no TensorFlow INFO logs."""
    env = dict(os.environ if base is None else base)
    xla = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={devices_per_process}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's INFO banners, once per process
    return env


# One machine's processes, and fake devices per process: far beyond any machine's cores.
MAX_LOCAL = 256


def process_command(
    command: Sequence[str], coordinator: str, num_processes: int, process_id: int
) -> list[str]:
    """The command of process `process_id`: a `.py` script runs under this Python."""
    head = [sys.executable, *command] if command[0].endswith(".py") else list(command)
    return [
        *head,
        f"--coordinator_address={coordinator}",
        f"--num_processes={num_processes}",
        f"--process_id={process_id}",
    ]


def _forward(stream: TextIO, out: TextIO, prefix: str, lock: threading.Lock) -> None:
    for line in stream:
        if GLOO_NOISE.search(line):
            continue
        with lock:
            out.write(prefix + line)
            out.flush()


def _stop_with_the_launcher() -> None:
    """In each child, before it runs: SIGTERM (a preemption: save and stop) when the
    launcher dies, even by SIGKILL, so that no process is left running on its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stopped_processes(procs: Sequence[subprocess.Popen]) -> list[int]:
    """The indices of the processes that are stopped (SIGSTOP, a debugger, a frozen
    host): alive but sending no heartbeats, so the others fail for them."""
    stopped = []
    for k, p in enumerate(procs):
        try:
            stat = Path(f"/proc/{p.pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] in ("T", "t"):
            stopped.append(k)
    return stopped


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Processes:
    """The launched processes, each one's output forwarded line by line with a `[pK] `
    prefix, and the launcher's own notes on stderr."""

    def __init__(self, command, processes, devices_per_process, port, out, err):
        coordinator = f"127.0.0.1:{port or free_port()}"
        env = process_env(devices_per_process)
        self.err, self.lock = err, threading.Lock()
        self.procs, self.threads, self.interrupts = [], [], 0
        for k in range(processes):
            proc = subprocess.Popen(
                process_command(command, coordinator, processes, k),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
                preexec_fn=_stop_with_the_launcher,
            )
            self.procs.append(proc)
            for stream, target in ((proc.stdout, out), (proc.stderr, err)):
                t = threading.Thread(target=_forward, args=(stream, target, f"[p{k}] ", self.lock))
                t.start()
                self.threads.append(t)

    def note(self, message: str) -> None:
        with self.lock:
            self.err.write(f"[launch] {message}\n")
            self.err.flush()

    def on_signal(self, signum, frame) -> None:
        # A preemption notice: every process must see it to agree on a checkpoint step.
        del frame
        self.interrupts += 1
        sig = signal.SIGTERM if self.interrupts == 1 else signal.SIGKILL
        self.note(f"received {signal.Signals(signum).name}: sending {sig.name} to all processes")
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def supervise(self, grace: float) -> tuple[tuple[int, int] | None, list[int]]:
        """Wait for every process; once one fails, stop the others within `grace` s.
        Returns (the first failed process and its exit code, or None; the processes found
        stopped when it failed)."""
        # One waiter thread per process records exits in the order they happen: the first
        # process to fail is the one to name, even if the others die a moment later because
        # of it (a broken collective can abort them within the same instant).
        exits: Queue = Queue()
        for k, p in enumerate(self.procs):
            threading.Thread(target=lambda k=k, p=p: exits.put((k, p.wait())), daemon=True).start()
        failed, stopped, deadline = None, [], None
        running = len(self.procs)
        while running:
            try:
                k, code = exits.get(timeout=0.1)
                running -= 1
                if code != 0 and failed is None:
                    failed, stopped = (k, code), stopped_processes(self.procs)
                    self.note(
                        self._failure(k, code, stopped)
                        + f"; stopping the others within {grace:g} s"
                    )
                    deadline = time.time() + grace
            except Empty:
                pass
            if deadline is not None and time.time() > deadline:
                self._kill_running()
                deadline = None
        return failed, stopped

    def _failure(self, k: int, code: int, stopped: list[int]) -> str:
        cause = ""
        if stopped:
            cause = (
                f" because process {stopped[0]} (pid {self.procs[stopped[0]].pid}) "
                "is stopped (SIGSTOP or a frozen host) and sends no heartbeats"
            )
        return f"process {k} (pid {self.procs[k].pid}) {_describe(code)}{cause}"

    def _kill_running(self) -> None:
        for j, p in enumerate(self.procs):
            if p.poll() is None:
                self.note(f"killing process {j} (pid {p.pid}), still running")
                p.kill()
                p.send_signal(signal.SIGCONT)  # a stopped process dies only running

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for t in self.threads:
            t.join()


def launch(
    command: Sequence[str],
    processes: int,
    devices_per_process: int,
    port: int = 0,
    grace: float = 10.0,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Run `command` as `processes` JAX processes; returns 0 when all succeed, else the
    exit code of the first process that failed (128 + signal number if it was killed)."""
    group = _Processes(command, processes, devices_per_process, port, out, err)
    previous = {
        s: signal.signal(s, group.on_signal)
        for s in (signal.SIGTERM, signal.SIGINT)
        if threading.current_thread() is threading.main_thread()
    }
    try:
        failed, stopped = group.supervise(grace)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        group.close()
    if failed is None:
        return 0
    k, code = failed
    if stopped:  # the cause: the failed process lost a stopped peer
        group.note(f"failed: process {stopped[0]} was stopped; process {k} {_describe(code)}")
    else:
        group.note(f"failed: process {k} {_describe(code)}")
    return code if code > 0 else 128 - code


def parser() -> argparse.ArgumentParser:
    """The launcher's command line."""
    p = argparse.ArgumentParser(
        prog="python -m largebatch_jax.launch",
        usage="%(prog)s --processes N --devices_per_process M [--port P] [--grace S] -- "
        "COMMAND [ARG ...]",
        description="Run a command as N JAX processes x M CPU devices on this machine "
        "(a multi-process run without a cluster: the tests, a laptop).",
        epilog="e.g. python -m largebatch_jax.launch --processes 2 --devices_per_process 4 "
        "-- main.py --config=configs/smoke.py --workdir=/tmp/smoke",
    )
    p.add_argument("--processes", type=int, required=True, help="JAX processes to start")
    p.add_argument(
        "--devices_per_process", type=int, required=True, help="fake CPU devices per process"
    )
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the others get to stop after one process fails, before they are killed",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        errors.fail(
            "put the command after `--`, e.g. python -m largebatch_jax.launch --processes 2 "
            "--devices_per_process 4 -- main.py --config=... --workdir=..."
        )
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:split])  # --help prints the usage and exits 0
    command = argv[split + 1 :]
    for name in ("processes", "devices_per_process"):
        if not 1 <= getattr(args, name) <= MAX_LOCAL:
            errors.fail(f"--{name}={getattr(args, name)} must be from 1 to {MAX_LOCAL}.")
    if args.grace < 0:
        errors.fail(f"--grace={args.grace} must be >= 0.")
    if not command:
        errors.fail("no command after `--`.")
    program = command[0]
    if not (program.endswith(".py") and Path(program).is_file()) and not shutil.which(program):
        errors.fail(
            f"`{program}` after `--` is neither a program on the PATH nor a "
            "Python script: check its name and path."
        )
    return launch(command, args.processes, args.devices_per_process, args.port, args.grace)


if __name__ == "__main__":
    sys.exit(main())
