"""The filter of a multi-process run's console (largebatch_jax.console), on what JAX 0.10.2
and gloo printed here: a process lost by its heartbeats (seen by process 0, which runs the
coordination service), process 0 itself lost (seen by process 1), gloo's lines."""

import os
import signal
import subprocess
import sys
import time

from largebatch_jax import console
from tests.runs import ROOT

LOG = "I1207 16:24:15.807101 139931089881984 loop.py:78] compiled the train step in 3.6 s\n"
STACK = """\
*** Check failure stack trace: ***
    @     0x7f4437040634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f443e6a71f5  (unknown)
Fatal Python error: Aborted

Thread 0x00007f436f4146c0 (most recent call first):
  File "/x/orbax/checkpoint/checkpoint_manager.py", line 150 in run

Extension modules: jaxlib.cpu_feature_guard, numpy._core._multiarray_umath (total: 2)
"""
# Process 0 when process 1 was SIGKILLed under plain srun (48 s later, 2026-12-07).
HEARTBEATS = (
    LOG + "E1207 16:25:07.538909    4892 coordination_service.cc:1549] [16383388959987041853] Use "
    "error polling to propagate the following error to all tasks: UNAVAILABLE: The following "
    "tasks are unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed. Check the "
    "task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug "
    "further. [type.googleapis.com/tensorflow.CoordinationServiceError='']\n"
    "E1207 16:25:07.539495    4903 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n"
    "F1207 16:25:07.539618    4903 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died; see the "
    "other task logs for more details. absl::Status: UNAVAILABLE: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n1\nThe tasks have crashed.\n\nRPC: "
    "/xla.coordination.CoordinationService/PollForError\n"
    "E1207 16:25:07.539781 139927596226240 async_checkpointer.py:264] [process=0] Failed to run "
    "4 Handler Commit operations\n" + STACK
)
# Process 1 when process 0 was SIGKILLed under srun (at once).
COORDINATOR_GONE = (
    LOG + "E1207 16:42:21.153152   13878 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).\n"
    "F1207 16:42:21.153192   13878 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died\n"
    "Additional GRPC error information from remote target coordination_service while calling "
    "/xla.coordination.CoordinationService/PollForError:\n"
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}\n' + STACK
)


def run_filter(text, rank, checkpoints=None, drop=None):
    lines = text.encode().splitlines(keepends=True)
    return b"".join(console.filtered(lines, drop, rank, checkpoints)).decode()


def test_a_process_lost_by_its_heartbeats_is_one_line_from_process_0(tmp_path):
    for step in ("0", "8", "16.orbax-checkpoint-tmp-17"):
        (tmp_path / step).mkdir()
    out = run_filter(HEARTBEATS, 0, tmp_path)
    assert out.splitlines() == [
        LOG.strip(),
        "error: process 1 of the run stopped sending heartbeats (--heartbeat_timeout_seconds): "
        f"it has died or lost its host; JAX stopped the others; checkpoints at steps [0, 8] in "
        f"{tmp_path} are intact; rerun the same command to resume from step 8.",
    ]
    assert run_filter(HEARTBEATS, 2, tmp_path) == LOG  # the others say nothing more


def test_the_coordinator_gone_is_one_line_from_process_1():
    out = run_filter(COORDINATOR_GONE, 1)
    assert out.splitlines() == [
        LOG.strip(),
        "error: process 0, which runs JAX's coordination service, is gone (it died or lost its "
        "host); JAX stopped the others; the checkpoints are intact; rerun the same command to "
        "resume.",
    ]
    assert run_filter(COORDINATOR_GONE, 3) == LOG


def test_without_a_rank_and_before_an_abort_every_line_passes():
    assert run_filter(HEARTBEATS, None) == HEARTBEATS
    assert run_filter(LOG * 3, 0) == LOG * 3


def test_gloo_lines_and_their_pieces_are_dropped_through_the_child_process():
    """The filter as main.py starts it: a child process between a pipe and the console,
    which ignores SIGTERM and passes the last lines when its writer is gone."""
    noisy = (
        "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer "
        "ranks is : 7\n[Gloo] Rank 2 is connected to  peer ranks. Expected number of "
        "connected peer ranks is : 7\n7\n\n5 is connected to 7\n"
        "done: top-1 error 0.68\n 7 \npreempted: step 7\n"
    )
    child = subprocess.run(
        [sys.executable, "-m", "largebatch_jax.console", f"--drop={console.GLOO_NOISE.pattern}"],
        input=noisy,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout == "done: top-1 error 0.68\npreempted: step 7\n"


def test_a_whole_job_paused_past_its_heartbeat_is_named_as_a_pause(tmp_path):
    """Every process stopped for 90 s (SLURM's suspend, a VM pause) with a 60 s heartbeat:
    JAX's service takes the processes for dead, and the line says the job was paused and
    what to raise; a shorter stretch without running is not taken for the cause."""
    (tmp_path / "8").mkdir()
    lines = HEARTBEATS.encode().splitlines(keepends=True)
    out = b"".join(console.filtered(lines, None, 0, tmp_path, lambda: 90.4, 60)).decode()
    assert out.splitlines()[-1] == (
        "error: this job was paused for 90 s (stopped by a signal, a scheduler's suspend or a "
        "paused VM), longer than its heartbeat allows (--heartbeat_timeout_seconds=60): JAX's "
        "coordination service took its processes for dead; JAX stopped the others; "
        f"checkpoints at steps [8] in {tmp_path} are intact; rerun the same command to resume "
        "from step 8; where jobs may be suspended, raise --heartbeat_timeout_seconds above the "
        "longest pause."
    )
    out = b"".join(console.filtered(lines, None, 0, tmp_path, lambda: 20.0, 60)).decode()
    assert "process 1 of the run stopped sending heartbeats" in out.splitlines()[-1]
    # Process 1 resumed after the service aborted sees no list: in a pause, process 0
    # alone says it (both said it, 1 run in 3 with staggered resumes).
    gone = COORDINATOR_GONE.encode().splitlines(keepends=True)
    out = b"".join(console.filtered(gone, None, 1, tmp_path, lambda: 91.0, 60)).decode()
    assert out == LOG
    out = b"".join(console.filtered(gone, None, 0, tmp_path, lambda: 91.0, 60)).decode()
    assert out.splitlines()[-1].startswith("error: this job was paused for 91 s")


def test_the_pause_watch_measures_a_stop_of_its_process():
    """PauseWatch in a child stopped by SIGSTOP for 3 s: it reports the pause (to within
    its tick), and nothing where the child ran without a stop."""
    code = (
        "import sys, time; from largebatch_jax.console import PauseWatch; w = PauseWatch(); "
        "print('ready', flush=True); sys.stdin.readline(); time.sleep(1.0); "
        "print(round(w.recent(60), 1), flush=True)"
    )
    for stop in (0.0, 3.0):
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout.readline() == "ready\n"
        if stop:
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(stop)
            os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate("go\n", timeout=60)
        assert (stop - 0.6 <= float(out) <= stop + 0.6) if stop else float(out) == 0.0, out
