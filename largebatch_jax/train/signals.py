"""The two signals a run answers between steps: a scheduler's preemption notice (SIGTERM)
and Ctrl-C (SIGINT), which never interrupts a checkpoint save half-started."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils


class Preemption:
    """A scheduler's preemption notice (SIGTERM), read by the loop between steps.

    One process: our handler sets a flag. Several: JAX's preemption sync service catches
    SIGTERM on any process and makes all of them agree on the step to stop at, so they
    save the same checkpoint together (a process stopping alone would hang the others).
    """

    def __init__(self):
        self.requested = False
        self._previous = None
        self._multi = jax.process_count() > 1

    def __enter__(self):
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        del signum, frame
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (called once per step, on every process)."""
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


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
