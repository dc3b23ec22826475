"""SLURM starts the job for real: a one-node SLURM of this machine (tests/engines.py) runs
main.py on the smoke config (64 steps, tests.runs.LONGER; evaluated at the end only) as 2
tasks x 2 CPU devices, with the srun flags of the sbatch script the docs show
(scripts/slurm/train.sbatch). Exact mode makes every layout's
bits the same, so every run, interrupted or not, ends with the params_sha256 of one
process with 8 devices (conftest's `straight`)."""

import json
import os
import shlex
import signal
import sys
import time

import numpy as np
import pytest

from tests.engines import TWO_BY_TWO, Slurm, need, program_lines, task_pid
from tests.runs import (
    LONGER,
    checkpoint_steps,
    error_lines,
    final_state,
    foreign_lines,
    result,
    start,
    wait_for_checkpoint,
)
from tests.test_multihost import flat

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_engines")]

# The sbatch script's srun flags, for 2 tasks (scripts/slurm/train.sbatch).
SRUN = ("srun", "--kill-on-bad-exit=1", "--ntasks=2")
# One evaluation, at the end (LONGER has one per epoch): the same parameters, less time.
SMOKE = (*LONGER, "--config.eval_every_epochs=4.0")
SCRIPT = "scripts/slurm/train.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    need("slurmctld", "slurmd", "srun", "munged")
    engine = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


def main_py(workdir, data_dir, *extra):
    return [
        sys.executable,
        "main.py",
        "--config=configs/smoke.py",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *SMOKE,
        *extra,
    ]


def sha(workdir):
    return result(workdir)["params_sha256"]


def test_srun_gives_the_bits_of_the_launcher_and_of_one_process(
    slurm, straight, tmp_path, fashion_mnist_dir
):
    """srun's 2 tasks x 2 devices and the local launcher's 2 processes x 4, side by side,
    against one process with 8 devices; checkpoints at the start and the end only."""
    ends = "--config.checkpoint_every_steps=64"
    step = slurm.start_step(
        [*SRUN, *main_py(tmp_path / "srun", fashion_mnist_dir, ends)], **TWO_BY_TWO
    )
    launched = start(tmp_path / "launch", fashion_mnist_dir, *SMOKE, ends, processes=2, devices=4)
    stdout, stderr = step.communicate(timeout=300)
    assert step.returncode == 0, stderr[-3000:]
    assert "joining a run of 2 processes started by SLURM" in stderr
    assert foreign_lines(stdout + stderr) == [], stderr[-3000:]
    _, stderr = launched.communicate(timeout=300)
    assert launched.returncode == 0, stderr[-3000:]
    assert sha(tmp_path / "srun") == sha(tmp_path / "launch") == sha(straight)


def test_a_task_killed_ends_the_step_in_seconds_with_one_line(
    slurm, straight, tmp_path, fashion_mnist_dir
):
    """Task 1 SIGKILLed: srun tells task 0 (SIGTERM, --kill-on-bad-exit=1), which finds
    process 1 silent and stops within AGREEMENT_SECONDS (10 s), not JAX's heartbeat (60 s),
    with one line naming it; every checkpoint saved is the uninterrupted run's, and the
    same command then finishes the run with its bits."""
    command = [*SRUN, *main_py(tmp_path, fashion_mnist_dir)]
    step = slurm.start_step(command, **TWO_BY_TWO)
    wait_for_checkpoint(step, tmp_path, 8)
    killed = time.time()
    os.kill(task_pid(tmp_path, 1), signal.SIGKILL)
    _, stderr = step.communicate(timeout=120)
    took = time.time() - killed
    print(f"the job step ended {took:.1f} s after task 1 was killed")
    assert took < 20 and step.returncode == 128 + signal.SIGKILL
    lines = "\n".join(program_lines(stderr))
    (line,) = error_lines(lines)
    assert line.startswith("error: process 1 of 2 did not answer the others within 10 s")
    assert "rerun the same command to resume" in line
    assert foreign_lines(lines) == [], stderr[-3000:]
    assert "srun: error: localhost: task 1: Killed" in stderr
    assert "srun: error: localhost: task 0: Exited with exit code 75" in stderr
    kept = sorted(set(checkpoint_steps(tmp_path)) & set(checkpoint_steps(straight)))
    assert kept and kept[0] >= 8, (checkpoint_steps(tmp_path), checkpoint_steps(straight))
    for saved in kept:
        ours, reference = flat(final_state(tmp_path, saved)), flat(final_state(straight, saved))
        assert all(np.array_equal(ours[k], reference[k]) for k in reference), saved
    out = slurm.run(command, **TWO_BY_TWO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sha(tmp_path) == sha(straight)


def test_scancel_term_saves_one_step_and_the_sbatch_script_resumes_it_to_the_end(
    slurm, straight, tmp_path, fashion_mnist_dir
):
    """scripts/slurm/train.sbatch as written, on one node and 2 tasks, with the smoke
    config; `scancel --signal=TERM` mid-run (what a preemption or the script's --signal
    before the time limit sends): both tasks save the step they agree on and exit 0, the
    script requeues the job, whose same srun command resumes from that step and ends
    with the uninterrupted run's bits."""
    if not slurm.gpus:
        pytest.skip("the script asks for --gpus-per-node=8: this SLURM has no GPUs (no mknod)")
    workdir, log = tmp_path / "run", tmp_path / "job.out"
    submitted = slurm.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=2",
            f"--output={log}",
            SCRIPT,
            *SMOKE,
        ],
        CONFIG="configs/smoke.py",
        WORKDIR=str(workdir),
        DATA_DIR=fashion_mnist_dir,
        PYTHON=sys.executable,
        **TWO_BY_TWO,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    deadline = time.time() + 240
    while not any(s >= 8 for s in checkpoint_steps(workdir)):
        assert time.time() < deadline, log.read_text() if log.exists() else slurm.job(job)
        time.sleep(0.05)
    slurm.run(["scancel", "--signal=TERM", job])
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    done = slurm.wait(job, lambda j: j.get("JobState") in ended and j.get("Restarts") == "1", "end")
    text = log.read_text()
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", text[-3000:]
    (line,) = [x for x in text.splitlines() if x.startswith("preempted")]
    saved = int(line.split("checkpoint saved at step ")[1].split()[0])
    assert 8 <= saved < 64
    # The script requeues only where srun returned 0: every task exited 0.
    assert f"requeueing job {job} to resume the run (restart 1 of at most 20)" in text
    assert f"resuming at step {saved}" in text and "done: top-1 error" in text
    ours = [x for x in program_lines(text) if not x.startswith("requeueing job")]
    assert foreign_lines("\n".join(ours)) == [], text[-3000:]
    assert sha(workdir) == sha(straight)


def test_main_py_in_a_batch_script_without_srun_is_one_line(slurm, tmp_path, fashion_mnist_dir):
    log = tmp_path / "job.out"
    command = shlex.join(main_py(tmp_path / "run", fashion_mnist_dir))
    submitted = slurm.run(
        ["sbatch", "--parsable", "--ntasks=2", f"--output={log}", f"--wrap={command}"],
        **TWO_BY_TWO,
    )
    job = submitted.stdout.strip()
    done = slurm.wait(job, lambda j: j.get("JobState") in ("COMPLETED", "FAILED"), "end", 120)
    assert done["ExitCode"] == "2:0"
    (line,) = log.read_text().splitlines()
    assert line.startswith(f"error: this is the shell of SLURM job {job} (2 tasks)")
    assert "start the program with srun" in line


# The GPU layouts of the docs, on this SLURM's (driverless) GPUs: each process's share,
# as the GPU numbers CUDA will show it (its CUDA_VISIBLE_DEVICES, in order).
PROBE = (
    "import json, os; from largebatch_jax import cluster; "
    "ids = cluster.local_devices(cluster.detect(), cluster.visible_gpus()); "
    "seen = os.environ['CUDA_VISIBLE_DEVICES'].split(','); "
    "print(json.dumps([int(seen[i]) for i in (ids or range(len(seen)))]))"
)


@pytest.mark.parametrize(
    "layout",
    [
        ("--ntasks=8", "--gpus-per-task=1"),  # one process per GPU
        ("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=8"),  # one per node
        ("--ntasks=8", "--gpus-per-node=8"),  # 8 processes that all see the 8 GPUs
        ("--ntasks=2", "--gpus-per-task=4"),
    ],
    ids=["per_gpu", "per_node", "shared", "two_by_four"],
)
def test_every_gpu_of_the_node_goes_to_exactly_one_process(slurm, layout):
    if not slurm.gpus:
        pytest.skip("this SLURM has no GPUs (no mknod)")
    out = slurm.run(["srun", *layout, sys.executable, "-c", PROBE])
    assert out.returncode == 0, out.stderr
    shares = [json.loads(x) for x in out.stdout.splitlines()]
    assert sorted(g for share in shares for g in share) == list(range(8)), shares
