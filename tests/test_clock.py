"""Honest timing: images/s, ETA and a run's training seconds count training only, and
the total survives a resume."""

import pytest

from largebatch_jax.metrics import TrainClock
from largebatch_jax.train.state import Progress


class FakeTimer:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_evaluation_saves_and_compiles_are_not_training_time():
    timer = FakeTimer()
    clock = TrainClock(total_steps=100, start_step=0, timer=timer)
    timer.now += 50.0  # before the loop starts (data, restore): not training
    clock.start()
    with clock.paused("compile"):
        timer.now += 30.0
    timer.now += 10.0  # steps 1-10
    assert clock.progress(10, images_per_step=64) == pytest.approx((64.0, 90.0))
    with clock.paused("eval"):
        timer.now += 7.0
    timer.now += 5.0  # steps 11-20
    with clock.paused("checkpoint"):
        timer.now += 4.0
    with clock.paused("eval"):
        timer.now += 1.0
    images_per_sec, eta = clock.progress(20, images_per_step=64)
    assert images_per_sec == pytest.approx(128.0) and eta == pytest.approx(40.0)
    assert clock.session_seconds() == pytest.approx(15.0)
    assert clock.total_seconds() == pytest.approx(15.0)
    assert clock.paused_seconds == pytest.approx({"compile": 30.0, "eval": 8.0, "checkpoint": 4.0})
    assert clock.wall_seconds() == pytest.approx(107.0)
    clock.stop()
    timer.now += 3.0  # stopped: not counted
    assert clock.session_seconds() == pytest.approx(15.0)


def test_the_total_continues_from_the_checkpoint_after_a_resume():
    timer = FakeTimer()
    first = TrainClock(total_steps=100, start_step=0, timer=timer)
    first.start()
    timer.now += 12.0
    saved = Progress(step=40, train_seconds=first.total_seconds()).to_json()
    timer.now += 5.0  # trained past the checkpoint, then killed: those steps rerun
    host = Progress.from_json(saved)
    second = TrainClock(100, host.step, host.train_seconds, timer=timer)
    timer.now += 20.0  # start-up of the second session
    second.start()
    timer.now += 6.0
    assert second.session_seconds() == pytest.approx(6.0)
    assert second.total_seconds() == pytest.approx(18.0)
    # ETA from this session's rate only: 60 steps left after step 70 at 0.2 s per step.
    assert second.progress(70, 8)[1] == pytest.approx(6.0)


def test_run_state_reads_checkpoints_written_before_it_had_a_clock():
    old = {"epoch_sums": {"1": [0.5, 1.0, 3]}, "data": {"step": 8}, "skipped": 1, "step": 8}
    host = Progress.from_json(old)
    assert (host.step, host.skipped, host.train_seconds) == (8, 1, 0.0)
    assert host.to_json() == {**old, "train_seconds": 0.0}


def test_library_log_filter_keeps_warnings_but_drops_orbax_save_advice():
    """The run's log keeps library warnings, except the ones that say nothing to a user
    (metrics._QUIET_WARNINGS): orbax's advice when a save waits for the one before it."""
    import logging as std_logging

    from largebatch_jax import metrics

    def record(path, level, msg):
        return std_logging.LogRecord("absl", level, path, 1, msg, (1.1,), None)

    keep = metrics._DropLibraryInfo().filter
    orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
    advice = "Waiting for previous save to complete took %f seconds. If this"
    assert not keep(record(orbax, std_logging.WARNING, advice))
    assert not keep(record(orbax, std_logging.INFO, "Saving checkpoint"))
    assert keep(record(orbax, std_logging.WARNING, "Metadata file does not exist: %s"))
    assert keep(record("/work/largebatch_jax/train/loop.py", std_logging.INFO, advice))
