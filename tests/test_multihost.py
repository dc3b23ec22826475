"""Multi-host, proven on one machine: real `jax.distributed` runs of 2 processes x 4 CPU
devices (gloo collectives) started by the local launcher, against 1 process x 8 devices."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from largebatch_jax import launch, parallel
from largebatch_jax.data import loader, sources
from largebatch_jax.metrics import read_metrics
from tests.runs import (
    LAUNCH,
    ROOT,
    call,
    checkpoint_steps,
    command,
    env,
    final_state,
    foreign_lines,
    metrics_size,
    result,
    run,
    start,
    wait_for_checkpoint,
    wait_for_logged_step,
    without_timing,
)

TWO = {"processes": 2, "devices": 4}
EVAL_PER_EPOCH = ("--config.eval_every_epochs=1.0",)  # smoke: 32 steps, 2 evaluations


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, fashion_mnist_dir):
    workdir = tmp_path_factory.mktemp("one_process")
    out = run(workdir, fashion_mnist_dir, *EVAL_PER_EPOCH)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, fashion_mnist_dir):
    workdir = tmp_path_factory.mktemp("two_processes")
    out = run(workdir, fashion_mnist_dir, *EVAL_PER_EPOCH, **TWO)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir, out


def flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree.leaves_with_path(tree)}


def leaf_relative_gap(a, b) -> float:
    """max over leaves of max|a - b| / max|b|."""
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    return max(
        float(np.abs(fa[k] - fb[k]).max()) / max(float(np.abs(fb[k]).max()), 1e-12) for k in fa
    )


@pytest.mark.slow
def test_two_processes_equal_one_process(one_process, two_processes):
    workdir, out = two_processes
    assert "devices=8 (local 4) processes=2" in out.stderr
    # Only process 0 writes logs and results.
    assert "[p0] done: top-1 error" in out.stdout and "[p1] done" not in out.stdout
    assert [
        line for line in out.stderr.splitlines() if line.startswith("[p0]") and "] step " in line
    ]
    assert not [
        line for line in out.stderr.splitlines() if line.startswith("[p1]") and "] step " in line
    ]
    # Same math, gloo's all-reduce instead of the in-process one: float reassociation,
    # which training amplifies, and differently on different CPUs. So the parameters and
    # BN statistics are compared relative to each leaf's largest value (momentum buffers
    # of biases and BN betas, near zero, are not: on another machine of this kind one
    # element was 8.4e-6 apart at step 24). Measured here on 2026-12-03: at most 3.8e-5
    # at step 32; the bound has 25x headroom. A wrong share of the data or a wrong
    # reduction is far more (a run with another seed: 2.9 for the parameters, 1.8 for
    # the BN statistics).
    # Bit-identical runs across layouts are the exact mode's promise, not this one's.
    assert sorted(checkpoint_steps(workdir)) == sorted(checkpoint_steps(one_process))
    for step in (24, 32):
        ours, theirs = final_state(workdir, step), final_state(one_process, step)
        assert int(ours["step"]) == int(theirs["step"]) == step
        for part in ("params", "batch_stats"):
            gap = leaf_relative_gap(ours[part], theirs[part])
            print(f"step {step} {part}: largest leaf-relative gap {gap:.2e}")
            assert gap <= 1e-3, (step, part, gap)
    rows, reference = (
        without_timing(read_metrics(workdir)),
        without_timing(read_metrics(one_process)),
    )
    assert [r["step"] for r in rows] == [r["step"] for r in reference]  # written once, not twice
    for row, ref in zip(rows, reference, strict=True):
        assert row.keys() == ref.keys()
        for key, value in row.items():
            assert value == pytest.approx(ref[key], rel=1e-3, abs=1e-6), (row["step"], key)


@pytest.mark.slow
def test_processes_read_disjoint_shares_that_cover_the_epoch(tmp_path, fashion_mnist_dir):
    """Remark 4 across processes: one epoch, each process its own share of every global
    batch; assembled on the mesh, the global batches are the one-process ones."""
    proc = call(
        [
            *launch_command(2, 4),
            "tests/multihost_probe.py",
            f"--data_dir={fashion_mnist_dir}",
            f"--out={tmp_path}",
            "--batch_size=64",
            "--subset=512",
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    p0, p1 = (json.loads((tmp_path / f"p{k}.json").read_text()) for k in (0, 1))
    assert p0["process_count"] == 2 and p0["devices"] == 8
    read0 = [i for batch in p0["local"] for i in batch]
    read1 = [i for batch in p1["local"] for i in batch]
    assert len(read0) == len(read1) == 256
    assert not set(read0) & set(read1)
    assert sorted(read0 + read1) == list(range(512))
    # The one-process loader's global batches, in order.
    spec = sources.dataset_spec("fashion_mnist", fashion_mnist_dir)
    src = sources.Subset(
        sources.load_source("fashion_mnist", spec.train_split, fashion_mnist_dir), 512
    )
    single = loader.TrainLoader(
        src, loader.default_augmentation(spec, 14, False), 64, seed=0, num_steps=8
    )
    expected = [np.asarray(next(single)["index"]).tolist() for _ in range(8)]
    assert p0["global"] == p1["global"] == expected


@pytest.fixture(scope="module")
def exact_probe(tmp_path_factory):
    """tests/exact_probe.py alone (1 x 8) and under the launcher (2 x 4)."""
    out = tmp_path_factory.mktemp("exact_probe")
    base = ["tests/exact_probe.py"]
    for name, cmd in (("one", [sys.executable, *base]), ("two", [*launch_command(2, 4), *base])):
        proc = call([*cmd, f"--out={out / name}.json"], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("one", "two")}


@pytest.mark.slow
def test_exact_device_sum_is_bit_identical_across_processes(exact_probe):
    """reduction='exact''s cross-device sum through gloo (2 processes x 4 devices) gives
    the bits of the in-process one, and of the fixed tree over the 8 rows."""
    one, two = exact_probe["one"], exact_probe["two"]
    assert two["device_sum"] == one["device_sum"] == one["tree_of_rows"]


@pytest.mark.slow
def test_a_convolution_has_the_same_bits_in_two_processes(exact_probe):
    """With XLA:CPU's thread count fixed (exact.fix_cpu_threads), the same compiled 3x3
    convolution on the same data gives the same bits with 2 processes x 4 devices as with
    1 x 8 (without it the pools have 4 and 8 threads, and Eigen splits the sums by the
    thread count: other bits)."""
    assert exact_probe["two"]["conv"] == exact_probe["one"]["conv"]


def launch_command(processes, devices, grace=10):
    return [
        *LAUNCH,
        f"--processes={processes}",
        f"--devices_per_process={devices}",
        f"--grace={grace}",
        "--",
    ]


def children(pid):
    """(pid, command line) of the processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry.name), cmdline))
    return found


@pytest.mark.slow
def test_a_dead_process_then_a_sigterm_and_the_run_still_ends_bit_identical(
    tmp_path, fashion_mnist_dir, two_processes
):
    """One run, two faults (one 2-process run fewer than a test each): process 1 is
    SIGKILLed, the launcher stops the run, the same command resumes; that resumed run is
    SIGTERMed, saves one checkpoint the processes agree on; the next rerun finishes with
    the uninterrupted run's exact parameters."""
    # Fault 1: a dead process.
    proc = start(tmp_path, fashion_mnist_dir, *EVAL_PER_EPOCH, **TWO)
    wait_for_checkpoint(proc, tmp_path, 8)
    (victim,) = [pid for pid, cmd in children(proc.pid) if "--process_id=1" in cmd]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    elapsed = time.time() - killed
    print(f"launcher exited {elapsed:.1f} s after process 1 was killed")
    assert proc.returncode != 0 and elapsed < 60
    assert "[launch] failed: process 1 was killed by SIGKILL" in stderr
    assert not (tmp_path / "result.json").exists()
    resumed_from = max(checkpoint_steps(tmp_path))
    assert 8 <= resumed_from < 32
    # Fault 2: SIGTERM to the launcher of the resumed run, once it trains again.
    logged = metrics_size(tmp_path)
    proc = start(tmp_path, fashion_mnist_dir, *EVAL_PER_EPOCH, **TWO)
    wait_for_logged_step(proc, tmp_path, resumed_from, since=logged)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"resuming at step {resumed_from}" in stderr
    (line,) = [x for x in stdout.splitlines() if "preempted" in x]
    saved = int(line.split("checkpoint saved at step ")[1].split()[0])
    assert saved in checkpoint_steps(tmp_path) and resumed_from < saved < 32
    # The same launcher command ends the run, to the uninterrupted run's parameters.
    out = run(tmp_path, fashion_mnist_dir, *EVAL_PER_EPOCH, **TWO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming at step {saved}" in out.stderr
    assert result(tmp_path)["params_sha256"] == result(two_processes[0])["params_sha256"]


@pytest.mark.slow
def test_a_dead_coordinator_is_one_line_from_its_survivor(tmp_path, fashion_mnist_dir):
    """Process 0, which runs JAX's coordination service, SIGKILLed: JAX stops process 1 at
    once (its errors, a C++ stack trace and Python's dump of every thread); the console
    filter says it in one line naming process 0 and the checkpoints kept."""
    proc = start(tmp_path, fashion_mnist_dir, *EVAL_PER_EPOCH, **TWO)
    wait_for_checkpoint(proc, tmp_path, 8)
    (victim,) = [pid for pid, cmd in children(proc.pid) if "--process_id=0" in cmd]
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    survivor = [x[len("[p1] ") :] for x in stderr.splitlines() if x.startswith("[p1] ")]
    (line,) = [x for x in survivor if x.startswith("error:")]
    assert line.startswith("error: process 0, which runs JAX's coordination service, is gone")
    assert f"checkpoints at steps {checkpoint_steps(tmp_path)} in" in line
    assert foreign_lines("\n".join(survivor)) == [], stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("differ", ["config", "workdir", "devices"])
def test_processes_that_disagree_stop_with_exit_2(tmp_path, fashion_mnist_dir, differ):
    """Two processes of one run with different configs, each with a workdir of its own
    (a local folder on each host: process 0 would wait forever in the first save), or
    with 4 and 2 devices: both stop at start-up with exit 2 and one line naming the
    problem, nothing saved."""
    coordinator = f"127.0.0.1:{launch.free_port()}"
    workdirs = [tmp_path / "a", tmp_path / ("b" if differ == "workdir" else "a")]
    procs = [
        subprocess.Popen(
            launch.process_command(
                command(
                    workdirs[k], fashion_mnist_dir, f"--config.seed={k * (differ == 'config')}"
                )[1:],
                coordinator,
                2,
                k,
            ),
            cwd=ROOT,
            env=launch.process_env(2 if k and differ == "devices" else 4, env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    expected = {
        "config": "process 1 has config.seed=1 but process 0 has 0",
        "workdir": "is not one folder that every process sees: process 1 of 2 cannot see",
        "devices": "process 1 has local devices=2 but process 0 has 4",
    }[differ]
    for p, (_, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 2, stderr[-3000:]
        (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
        assert expected in line, line
    for workdir in workdirs:
        assert not checkpoint_steps(workdir)
        assert not (workdir / "run.lock").exists()


@pytest.mark.parametrize("case", ["port_in_use", "never_joined"])
def test_a_start_up_that_cannot_join_is_one_line(tmp_path, case):
    """Process 0 of 2 whose coordinator port another program holds
    (JAX would crash binding it), or whose process 1 never starts: exit 2 and one line
    naming the problem and the fix, after at most the join timeout (here 5 s)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] if case == "port_in_use" else launch.free_port()
        main = command(tmp_path, tmp_path / "no_data")[1:]
        out = subprocess.run(
            [
                *launch.process_command(main, f"127.0.0.1:{port}", 2, 0),
                "--initialization_timeout_seconds=5",
            ],
            cwd=ROOT,
            env=launch.process_env(4, env()),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    if case == "port_in_use":
        assert f"port {port} cannot be used on this host" in line and "free port" in line
    else:
        assert "processes did not all join the run at 127.0.0.1:" in line, line
        assert "within 5 s" in line and "--initialization_timeout_seconds" in line
    assert foreign_lines(out.stdout + out.stderr) == [], out.stderr[-3000:]
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------ the launcher alone

SCRIPT = """
import sys, time
k = int([a for a in sys.argv if a.startswith("--process_id=")][0].split("=")[1])
print("hello from", k, flush=True)
if k == 1:
    sys.exit(3)
time.sleep(120)
"""


def test_launcher_names_the_failed_process_and_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    began = time.time()
    out = subprocess.run(
        [*launch_command(2, 1, grace=1), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3
    assert time.time() - began < 30
    assert "[p0] hello from 0" in out.stdout and "[p1] hello from 1" in out.stdout
    assert "[launch] process 1" in out.stderr and "exited with code 3" in out.stderr
    assert "killing process 0" in out.stderr


STOPS = """
import os, signal, sys, time
k = int([a for a in sys.argv if a.startswith("--process_id=")][0].split("=")[1])
print("pid", os.getpid(), flush=True)
if k == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # a frozen host: alive, silent
time.sleep(1)
sys.exit(1)  # process 0 gives up on its silent peer, as JAX's heartbeat check does
"""


def test_launcher_blames_a_stopped_process_not_the_one_that_lost_it(tmp_path):
    """Process 1 stopped (SIGSTOP), process 0 then fails: the launcher
    names process 1 as the cause, and still stops it."""
    script = tmp_path / "stops.py"
    script.write_text(STOPS)
    out = subprocess.run(
        [*launch_command(2, 1, grace=1), str(script)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1, out.stderr
    assert "because process 1 (pid " in out.stderr and "is stopped (SIGSTOP" in out.stderr
    assert "[launch] failed: process 1 was stopped; process 0 exited with code 1" in out.stderr


SLEEPS = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM", flush=True), sys.exit(0)))
print("pid", os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_killed_launcher_stops_its_processes(tmp_path):
    """SIGKILL to the launcher (no chance to forward anything): each
    process gets SIGTERM (a preemption: save and stop), none is left running."""
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    launcher = subprocess.Popen(
        [*launch_command(2, 1), str(script)], stdout=subprocess.PIPE, text=True
    )
    pids = []
    while len(pids) < 2:
        line = launcher.stdout.readline()
        assert line, "the launcher ended before its processes started"
        if " pid " in line:
            pids.append(int(line.split()[-1]))
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(map(running, pids)):
        time.sleep(0.05)
    assert not any(map(running, pids)), pids


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit status waits for whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_launcher_drops_gloo_lines_and_their_interleaved_pieces():
    """A resumed 2-process run printed a stray `[p1] 7`, a piece of
    Gloo's connection line cut by another device's thread."""
    import io
    import threading

    noisy = (
        "[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer "
        "ranks is : 7\n[Gloo] Rank 2 is connected to  peer ranks. Expected number of "
        "connected peer ranks is : 7\n7\n\n5 is connected to 7\n"
        "step 8/64\n 7 \nthe run's own line: 7 steps\n"
    )
    out = io.StringIO()
    launch._forward(io.StringIO(noisy), out, "[p1] ", threading.Lock())
    assert out.getvalue() == "[p1] step 8/64\n[p1] the run's own line: 7 steps\n"


def test_launcher_environment_and_command():
    env_ = launch.process_env(4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --a=b"})
    assert env_["XLA_FLAGS"].split() == ["--a=b", "--xla_force_host_platform_device_count=4"]
    assert env_["JAX_PLATFORMS"] == "cpu" and env_["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    cmd = launch.process_command(["main.py", "--workdir=w"], "127.0.0.1:5", 2, 1)
    assert cmd == [
        sys.executable,
        "main.py",
        "--workdir=w",
        "--coordinator_address=127.0.0.1:5",
        "--num_processes=2",
        "--process_id=1",
    ]
    with pytest.raises(SystemExit) as no_command:  # no `--`: one line, exit 2
        launch.main(["--processes=2", "--devices_per_process=4"])
    assert no_command.value.code == 2


def test_mesh_is_process_major():
    mesh = parallel.create_mesh(list(reversed(jax.devices())))
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in mesh.devices.flat)
