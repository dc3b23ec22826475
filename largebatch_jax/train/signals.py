"""The two signals a run answers between steps: a scheduler's preemption notice (SIGTERM)
and Ctrl-C (SIGINT), which never interrupts a checkpoint save half-started."""

from __future__ import annotations

import contextlib
import itertools
import select
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from largebatch_jax import cluster

# How long the processes of a run have to join an agreement on the step to stop at; one
# that has not joined by then has died or lost its host.
AGREEMENT_SECONDS = 10.0
# How often each process looks for a notice that another process announced.
POLL_SECONDS = 0.5
_AGREEMENTS = itertools.count()  # each agreement's keys are new in the job's store


class StopAgreement:
    """The step at which the processes of a run stop after a notice: JAX's preemption
    sync protocol (each process reports the last step it passed to `reached`, a barrier
    waits for all of them, the stop step is the largest plus one), over the coordination
    service's store, with a deadline: the processes that have not reported within
    `timeout` seconds (and have not left the loop) are silent, and `on_silent(silent,
    answered)` is called.

    While the agreement runs, `reached` waits, so no process passes a step before the
    stop step is known. It runs in whichever thread comes first, once: the watcher of
    `Preemption`, which reports even while the main thread waits inside a step for the
    others' collectives, or the main thread after a collective failed."""

    def __init__(
        self,
        client: Any,
        process: int,
        processes: int,
        start: int,
        timeout: float,
        on_silent: Callable[[list[int], list[int]], None],
    ):
        self._client, self._process, self._processes = client, process, processes
        self._timeout, self._on_silent = timeout, on_silent
        self._key = f"largebatch_jax/stop/{next(_AGREEMENTS)}"
        self._lock, self._once = threading.Lock(), threading.Lock()
        self._last, self._stop_at, self._ran = start, None, False

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (called once per step, on every process)."""
        with self._lock:
            self._last = step
            return step == self._stop_at

    def announced(self) -> bool:
        """Whether some process has announced a notice."""
        return bool(self._client.key_value_dir_get(f"{self._key}/notice/"))

    def announce(self, why: str) -> None:
        """Tell the other processes to agree (this process may announce twice: a SIGTERM
        and a failed collective at the same moment)."""
        self._client.key_value_set(f"{self._key}/notice/{self._process}", why, allow_overwrite=True)

    def leave(self) -> None:
        """This process has left the loop: a notice now finds it gone, not silent."""
        with contextlib.suppress(Exception):
            self._client.key_value_set(f"{self._key}/left/{self._process}", "1")

    def run(self) -> None:
        """Report, wait for the others, set the stop step (once; a second caller waits
        for the first)."""
        with self._once, self._lock:
            if self._ran:
                return
            self._ran = True
            self._client.key_value_set(f"{self._key}/step/{self._process}", str(self._last))
            try:
                self._client.wait_at_barrier(f"{self._key}/barrier", int(self._timeout * 1000))
            except Exception:  # DEADLINE_EXCEEDED: someone did not come
                answered = sorted(self._ids("step"))
                silent = sorted(set(range(self._processes)) - set(answered) - self._ids("left"))
                if silent:
                    self._on_silent(silent, answered)
                return
            self._stop_at = 1 + max(int(v) for _, v in self._entries("step"))

    def _entries(self, kind: str) -> list[tuple[str, str]]:
        return self._client.key_value_dir_get(f"{self._key}/{kind}/")

    def _ids(self, kind: str) -> set[int]:
        return {int(k.rsplit("/", 1)[1]) for k, _ in self._entries(kind)}


# The signals that stop a run with a checkpoint: a scheduler's preemption notice, and a
# closed terminal or dropped ssh session.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Preemption:
    """A scheduler's preemption notice (SIGTERM), read by the loop between steps.

    One process: our handler sets a flag. Several: every process must stop at the same
    step and save that checkpoint together (a process stopping alone would hang the
    others): a thread of each process runs the `StopAgreement` as soon as this process
    gets SIGTERM (`signal.set_wakeup_fd` wakes it even while the main thread waits inside
    a step's collective, where Python runs no handler) or another process announces a
    notice. Processes that do not join it within `timeout` seconds have died or lost
    their host, and `on_silent(silent, answered)` is called (the loop ends the run in one
    line: the others can neither save with them nor go on). `check_peers` runs the same
    agreement after a collective failed, to tell a dead process from another failure.
    """

    def __init__(
        self,
        start: int = 0,
        on_silent: Callable[[list[int], list[int]], None] | None = None,
        timeout: float = AGREEMENT_SECONDS,
    ):
        self.requested = False
        self._start, self._timeout = start, timeout
        self._on_silent = on_silent or (lambda silent, answered: None)
        self._previous, self._previous_fd = None, None
        self._agreement: StopAgreement | None = None
        self._done = threading.Event()

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        # SIGHUP (the terminal closed, the ssh session dropped) stops the run as SIGTERM does.
        self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}
        if jax.process_count() > 1:
            self._agreement = StopAgreement(
                cluster.kv_client(),
                jax.process_index(),
                jax.process_count(),
                self._start,
                self._timeout,
                self._on_silent,
            )
            self._wake, self._wake_write = socket.socketpair()
            self._wake_write.setblocking(False)
            self._previous_fd = signal.set_wakeup_fd(
                self._wake_write.fileno(), warn_on_full_buffer=False
            )
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def _handler(self, signum, frame):
        del signum, frame
        self.requested = True

    def _watch(self) -> None:
        """Wait for this process's SIGTERM or another's notice, then agree."""
        while not self._done.is_set():
            ready, _, _ = select.select([self._wake], [], [], POLL_SECONDS)
            signals = self._wake.recv(256) if ready else b""
            got = [s for s in STOP_SIGNALS if s in signals]
            if got:
                self._agree(got[0].name)
                return
            with contextlib.suppress(Exception):  # the service is gone: JAX stops us
                if self._agreement.announced():
                    self._agree(None)
                    return

    def _agree(self, why: str | None) -> None:
        """Announce a notice (`why`, unless another process did), then run the agreement;
        where the coordination service is gone, JAX itself stops the process."""
        with contextlib.suppress(Exception):
            if why is not None:
                self._agreement.announce(why)
        with contextlib.suppress(Exception):
            self._agreement.run()

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (called once per step, on every process)."""
        if self._agreement is not None:
            return self._agreement.reached(step)
        return self.requested

    def check_peers(self, why: str) -> None:
        """After a collective failed: are all processes still there? Announces a notice
        and runs the agreement; returns when every process answered (the failure is
        another one), and `on_silent` is called otherwise."""
        if self._agreement is not None:
            self._agree(why)

    def __exit__(self, *exc):
        self._done.set()
        if self._agreement is not None:
            self._agreement.leave()
            signal.set_wakeup_fd(self._previous_fd)
            self._thread.join(timeout=POLL_SECONDS * 2)
            self._wake.close()
            self._wake_write.close()
        if self._previous is not None:
            for s, previous in self._previous.items():
                signal.signal(s, previous)


class DeferredInterrupt:
    """SIGINT raises KeyboardInterrupt as usual, except while a checkpoint save is being
    started (`deferred()`): then it is raised as soon as that part is done, so a Ctrl-C
    never leaves a half-started save behind (the run then waits for the save's
    background part before it exits)."""

    def __init__(self):
        self._deferring, self._pending, self._previous = False, False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        del signum, frame
        if self._deferring:
            self._pending = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
