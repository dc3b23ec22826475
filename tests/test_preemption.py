"""The processes' agreement on a stop step (train.signals) over a stand-in of JAX's
coordination service, with the real one's semantics: a key is set once unless overwriting
is allowed, a barrier waits for every process or raises DEADLINE_EXCEEDED. Real runs of
it: tests/test_slurm.py, tests/test_multihost.py."""

import os
import signal
import threading
import time

import pytest

from largebatch_jax.train import signals


class Store:
    """The coordination service's key-value store and barriers, for threads."""

    def __init__(self, processes: int):
        self.processes = processes
        self.values: dict[str, str] = {}
        self.arrived: dict[str, int] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.changed:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value

    def key_value_dir_get(self, key):
        with self.changed:
            return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(key)]

    def wait_at_barrier(self, barrier, timeout_ms):
        with self.changed:
            self.arrived[barrier] = self.arrived.get(barrier, 0) + 1
            self.changed.notify_all()
            if not self.changed.wait_for(
                lambda: self.arrived[barrier] >= self.processes, timeout_ms / 1000
            ):
                raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {barrier}")


def agreements(store, lasts, silent_calls, timeout=5.0):
    """One StopAgreement per process of `store`, sharing its keys."""
    made = []
    for process, last in enumerate(lasts):
        agreement = signals.StopAgreement(
            store, process, store.processes, last, timeout, lambda s, a: silent_calls.append((s, a))
        )
        agreement._key = "test/stop"  # the processes' counters agree; here one process
        made.append(agreement)
    return made


def test_the_processes_stop_one_step_after_the_furthest():
    """Each reports the last step it passed; the stop step is the largest plus one, the
    same for all, and `reached` is true there only."""
    store, silent = Store(3), []
    made = agreements(store, [7, 8, 7], silent)
    made[1].announce("SIGTERM")
    assert all(a.announced() for a in made)
    threads = [threading.Thread(target=a.run) for a in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert silent == []
    for agreement in made:
        assert [s for s in range(7, 12) if agreement.reached(s)] == [9]


def test_a_silent_process_is_named_after_the_deadline():
    store, silent = Store(3), []
    made = agreements(store, [4, 4, 4], silent, timeout=0.3)
    made[2].leave()  # process 2 left the loop: gone, not silent
    began = time.time()
    made[0].announce("SIGTERM")
    made[0].run()
    assert 0.3 <= time.time() - began < 3
    assert silent == [([1], [0])]
    assert not made[0].reached(5)


@pytest.fixture
def two_processes(monkeypatch):
    """This process as process 0 of 2 on the stand-in store; process 1 never answers."""
    store = Store(2)
    monkeypatch.setattr(signals.jax, "process_count", lambda: 2)
    monkeypatch.setattr(signals.jax, "process_index", lambda: 0)
    monkeypatch.setattr(signals.cluster, "kv_client", lambda: store)
    return store


def test_a_sigterm_and_a_failed_collective_at_once_still_find_the_silent_process(two_processes):
    """srun's SIGTERM (--kill-on-bad-exit) and gloo's failed collective reach the survivor
    together: the watcher and the main thread both announce (allowed twice) and agree
    (once: the second waits for the first), and the main thread goes on only once the
    silent process is named (in a run, on_silent ends the process there; a main thread
    that went on would hang in JAX's shutdown: seen in CI, the step ended at srun's
    SIGKILL, 30 s)."""
    silent = []
    with signals.Preemption(8, lambda *named: silent.append(named), timeout=0.5) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the watcher announces first
        preemption.check_peers("Gloo AllGather failed: Connection closed by peer")
        assert silent == [([1], [0])]
        time.sleep(0.2)  # and is not called again
    assert silent == [([1], [0])]
    assert preemption.requested  # this process's own handler saw the SIGTERM too


def test_a_notice_announced_by_another_process_wakes_the_watcher(two_processes):
    """A process that got no SIGTERM joins when another announces: its watcher reports its
    last step, which the agreement then waits for."""
    reported = threading.Event()
    with signals.Preemption(3, timeout=5.0) as preemption:
        preemption.reached(5)
        two_processes.key_value_set(f"{preemption._agreement._key}/notice/1", "SIGTERM")
        deadline = time.time() + 5
        while time.time() < deadline and not reported.is_set():
            if two_processes.key_value_dir_get(f"{preemption._agreement._key}/step/"):
                reported.set()
            time.sleep(0.05)
        assert reported.is_set()
        step_key = f"{preemption._agreement._key}/step/0"
        assert two_processes.values[step_key] == "5"
        two_processes.key_value_set(f"{preemption._agreement._key}/step/1", "6")
        two_processes.wait_at_barrier(f"{preemption._agreement._key}/barrier", 5000)
        assert not preemption.reached(6) and preemption.reached(7)
