"""The third fault campaign's defects (issue 46), each reproduced from outside: real
files, subprocesses, the program's own command line."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests.runs import (
    LONGER,
    call,
    checkpoint_steps,
    error_lines,
    final_state,
    result,
    run,
    start,
    wait_for_checkpoint,
)
from tests.test_multihost import flat


def _refused(out, line: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert error_lines(out.stderr) == [f"error: {line}"], out.stderr[-2000:]


def test_a_typo_in_a_config_file_is_refused_like_one_on_the_command_line(
    tmp_path, fashion_mnist_dir
):
    """`c.batch_szie = 128` in a config file added a field nothing reads: the run
    trained with the default batch and ended 'done'. It is refused with the command
    line's line, before anything is written."""
    typo = tmp_path / "typo.py"
    typo.write_text(
        "from configs import smoke\n\n\ndef get_config():\n"
        "    c = smoke.get_config()\n    c.batch_szie = 128\n    return c\n"
    )
    common = [f"--workdir={tmp_path / 'wd'}", f"--config.data_dir={fashion_mnist_dir}"]
    from_file = call([sys.executable, "main.py", f"--config={typo}", *common], timeout=120)
    hint = "the config has no field 'batch_szie' (did you mean 'batch_size'?); the fields are in"
    _refused(from_file, f"config.batch_szie: {hint} configs/base.py.")
    from_flag = call(
        [sys.executable, "main.py", "--config=configs/smoke.py", *common, "--config.batch_szie=1"],
        timeout=120,
    )
    _refused(from_flag, f"--config.batch_szie: {hint} configs/base.py.")
    assert not (tmp_path / "wd").exists()


def test_a_link_planted_in_a_temporary_name_is_not_written_through(tmp_path, fashion_mnist_dir):
    """`.run_config.json.tmp<PID>` and `.result.json.tmp<PID>` planted as links to a file
    outside the workdir, for the pid of a run just started: the run wrote its config
    through the first into that file and left run_config.json a link to it. Now the
    links are removed, not followed: the outside file is untouched, the run's files are
    its own, and it ends done."""
    outside = tmp_path / "precious.txt"
    outside.write_text("precious\n")
    workdir = tmp_path / "wd"
    workdir.mkdir()
    proc = start(workdir, fashion_mnist_dir)
    for name in ("run_config.json", "result.json"):
        (workdir / f".{name}.tmp{proc.pid}").symlink_to(outside)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert outside.read_text() == "precious\n"
    for name in ("run_config.json", "result.json"):
        assert (workdir / name).is_file() and not (workdir / name).is_symlink()
    assert json.loads((workdir / "run_config.json").read_text())["batch_size"] == 64


@pytest.mark.parametrize("name", ["metrics.jsonl", "rejected_checkpoints"])
def test_a_run_file_that_is_a_link_is_refused(tmp_path, fashion_mnist_dir, name):
    """A `metrics.jsonl` that linked outside had its target cut back and appended to; a
    `rejected_checkpoints` link received set-aside checkpoints outside the workdir. A run
    file that is a link is refused in one line, exit 2, the target untouched."""
    target = tmp_path / "elsewhere"
    if name == "metrics.jsonl":
        target.write_text('{"step": 1}\nnot a row, no newline')
    else:
        target.mkdir()
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / name).symlink_to(target)
    before = sorted(p.name for p in target.iterdir()) if target.is_dir() else target.read_text()
    out = run(workdir, fashion_mnist_dir, timeout=120)
    _refused(
        out,
        f"{workdir / name} is a symlink (to {target}): the run writes its own files in its "
        "workdir, never through a link: replace it by the file it points to, or remove it.",
    )
    after = sorted(p.name for p in target.iterdir()) if target.is_dir() else target.read_text()
    assert after == before
    assert not (workdir / "checkpoints").exists()


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_data_workers_die_with_their_parent(tmp_path, fashion_mnist_dir):
    """With workers > 0, a SIGKILL of the main process (as the OOM killer sends) left its
    grain worker processes alive indefinitely, with their memory and shared memory. Now
    they exit within a second of it (each watches its parent's pid)."""
    workdir = tmp_path / "wd"
    proc = start(workdir, fashion_mnist_dir, "--config.workers=2", *LONGER)
    wait_for_checkpoint(proc, workdir, 8)
    workers = {c for c in _children(proc.pid) if "python" in Path(f"/proc/{c}/exe").resolve().name}
    assert len(workers) >= 2, workers  # grain's 2 workers (and its resource tracker)
    proc.kill()
    proc.wait(timeout=30)  # not communicate(): orphaned workers would hold its pipes open
    proc.stdout.close()
    proc.stderr.close()
    deadline = time.time() + 10
    while any(map(_alive, workers)) and time.time() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:  # do not leave them to the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"data workers alive 10 s after their parent's SIGKILL: {left}"


@pytest.mark.parametrize(
    "flag",
    [
        "--heartbeat_timeout_seconds=-1",
        "--initialization_timeout_seconds=0",
        "--num_processes=0",
        "--process_id=-1",
        "--coordinator_address=127.0.0.1:99999",
        "--coordinator_address=node001",
    ],
)
def test_a_bad_cluster_flag_is_one_line(tmp_path, flag):
    """A negative heartbeat aborted every process (SIGABRT, 71 lines), port 99999 raised
    an OverflowError, --num_processes=0 ran as one process: each is now absl's one line
    naming the flag, exit 2, before anything starts."""
    out = call(
        [sys.executable, "main.py", "--config=configs/smoke.py", f"--workdir={tmp_path}", flag],
        timeout=120,
    )
    name = flag.split("=")[0]
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and name in lines[0], out.stderr[-2000:]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "name,kind,line",
    [
        ("run_config.json", "1", "holds int '1', not a config: restore it from"),
        ("run_config.json", "folder", "is a folder, where the run keeps its file run_config"),
        ("metrics.jsonl", "folder", "is a folder, where the run keeps its file metrics.jsonl"),
        ("result.json", "folder", "is a folder, where the run keeps its file result.json"),
    ],
)
def test_a_run_file_of_the_wrong_kind_is_one_line(tmp_path, fashion_mnist_dir, name, kind, line):
    """run_config.json holding `1` or being a folder, metrics.jsonl or result.json being
    a folder: tracebacks, now one line naming the file, exit 2, nothing written."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    if kind == "folder":
        (workdir / name).mkdir()
    else:
        (workdir / name).write_text(kind)
    out = run(workdir, fashion_mnist_dir, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and f"{workdir / name} {line}" in lines[0], out.stderr[-2000:]
    assert not checkpoint_steps(workdir)


def test_a_json_line_that_is_not_a_row_is_skipped(tmp_path, fashion_mnist_dir):
    """Valid JSON in metrics.jsonl that is not a row (`[]`, an object without a step)
    made the end of training a KeyError, result.json never written, on every rerun; and
    `plot` the same. They are skipped with one warning."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('[]\n{"note": "mine"}\n')
    out = run(workdir, fashion_mnist_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipped 2 line(s) that are not metric rows" in out.stderr
    assert json.loads((workdir / "result.json").read_text())["final_val_error_top1"] is not None
    plot = [sys.executable, "-m", "largebatch_jax.plot", str(workdir)]
    drawn = call([*plot, "--out", str(tmp_path / "c.png")])
    assert drawn.returncode == 0 and (tmp_path / "c.png").exists(), drawn.stderr[-2000:]


@contextlib.contextmanager
def _ext4(tmp_path: Path):
    """A fresh ext4 file system on a loop device, mounted to stop writing at its first
    error (`errors=remount-ro`): (mount point, its sysfs name)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("the crash test mounts a loop device: run the suite as root (CI does)")
    image, mount = tmp_path / "ext4.img", tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["truncate", "-s", "128M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(mount)], check=True)
    try:
        source = subprocess.run(
            ["findmnt", "-no", "SOURCE", str(mount)], capture_output=True, text=True, check=True
        ).stdout.strip()
        yield image, mount, Path(source).name
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _stop_writing_at(step: int, workdir: Path, data_dir, device: str) -> subprocess.Popen:
    """The smoke run (LONGER) in `workdir`, its file system made to stop writing (ext4's
    trigger_fs_error: remounted read-only, as after a disk error or a crash) once
    checkpoint `step` appears."""
    proc = start(workdir, data_dir, *LONGER)
    wait_for_checkpoint(proc, workdir, step)
    Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text(f"stop at {step}\n")
    return proc


def _kept_are_the_uninterrupted_runs(workdir: Path, straight: Path, at_least: int) -> None:
    """The checkpoints left in `workdir` (the newest at step `at_least` or later) hold the
    uninterrupted run's state, bit for bit, at every step that run kept too."""
    kept = checkpoint_steps(workdir)
    assert kept and kept[-1] >= at_least, kept
    both = sorted(set(kept) & set(checkpoint_steps(straight)))
    assert both, (kept, checkpoint_steps(straight))
    for step in both:
        ours, reference = flat(final_state(workdir, step)), flat(final_state(straight, step))
        assert all(np.array_equal(ours[k], reference[k]) for k in reference), step


def _rerun_once_writable(image: Path, mount: Path, workdir: Path, data_dir):
    """The file system mounted writable again, and the same command run to its end."""
    subprocess.run(["umount", str(mount)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    out = run(workdir, data_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_machine_crash_leaves_the_checkpoints_saved_before_it_readable(
    tmp_path, fashion_mnist_dir, straight
):
    """The file system stops writing as a power loss would leave it (ext4's
    trigger_fs_error once checkpoint 40 appears): what was not fsynced is lost. Orbax
    fsyncs its arrays but not its metadata or its renamed folders, so checkpoints 16-32
    came back with empty metadata and none could be restored. Now each is durable
    before it counts: the rerun resumes from one saved before the crash and ends with
    the uninterrupted run's params_sha256."""
    with _ext4(tmp_path) as (image, mount, device):
        workdir = mount / "wd"
        proc = _stop_writing_at(40, workdir, fashion_mnist_dir, device)
        proc.kill()  # it may have stopped on the read-only file system already
        proc.communicate()
        out = _rerun_once_writable(image, mount, workdir, fashion_mnist_dir)
        resumed = re.search(r"resuming at step (\d+)", out.stderr)
        assert resumed and int(resumed[1]) >= 32, out.stderr[-3000:]
        assert result(workdir)["params_sha256"] == result(straight)["params_sha256"]


def test_a_file_system_gone_read_only_mid_run_is_one_line(tmp_path, fashion_mnist_dir, straight):
    """The workdir's file system remounted read-only after a disk error (ext4's
    errors=remount-ro) mid-run: 67 lines, two chained OSErrors and an empty lock left;
    and, once that was one line, a process that did not exit (orbax's signalling threads
    of the cut save wait 300 s). Now one line, exit 2 at once, naming the checkpoints
    kept, each the uninterrupted run's (the resume from such a file system is the crash
    test's)."""
    with _ext4(tmp_path) as (_, mount, device):
        workdir = mount / "wd"
        proc = _stop_writing_at(16, workdir, fashion_mnist_dir, device)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        (line,) = error_lines(err)
        assert f"the file system of --workdir={workdir} became read-only" in line, line
        named = re.search(r"checkpoints at steps \[([\d, ]+)\] in", line)
        assert named and set(map(int, named[1].split(","))) <= set(checkpoint_steps(workdir))
        _kept_are_the_uninterrupted_runs(workdir, straight, at_least=8)


def test_an_io_error_of_the_disk_is_one_line(tmp_path):
    """An fsync in flight when ext4 takes its disk error gets EIO, not EROFS, and the
    remount may not show yet (2 CI runs of the test above in about 20): the same fault,
    the same one line, exit 2."""
    import errno

    from largebatch_jax.errors import BadInputError
    from largebatch_jax.train.faults import one_line_error

    cut = OSError(errno.EIO, "Input/output error")
    try:
        raise RuntimeError("the save failed") from cut
    except RuntimeError as e:
        line = one_line_error(e, [8, 16], tmp_path / "checkpoints", tmp_path)
    assert isinstance(line, BadInputError) and line.exit_code == 2
    assert f"the file system of --workdir={tmp_path} became read-only or failed a write" in str(
        line
    )
    assert "checkpoints at steps [8, 16]" in str(line)


def test_orbax_failures_logged_by_asyncio_are_one_line(capsys):
    """A save cut by a read-only file system leaves orbax's asyncio tasks failed and
    never awaited: asyncio logged "Task exception was never retrieved" with the whole
    traceback (1 CI run of the read-only test in about 10). One line now, as orbax's own."""
    import logging

    from largebatch_jax import checkpoint

    checkpoint._log_orbax_errors_in_one_line()
    orbax_code = compile(
        "def mkdir():\n    raise OSError(30, 'Read-only file system')\n",
        "/site-packages/orbax/checkpoint/_src/path/async_path.py",
        "exec",
    )
    scope: dict = {}
    exec(orbax_code, scope)
    logger = logging.getLogger("asyncio")
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    try:
        try:
            scope["mkdir"]()
        except OSError:
            logger.error("Task exception was never retrieved", exc_info=True)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert err == (
        "Task exception was never retrieved (OSError: [Errno 30] Read-only file system)\n"
    ), err


def test_checkpoints_on_another_file_system_are_set_aside_across_it(tmp_path, fashion_mnist_dir):
    """checkpoints/ a link to a folder on another file system (/dev/shm here): setting an
    unreadable checkpoint aside renamed it across file systems, EXDEV on every rerun, so
    the fallback never worked. It is moved across: the rerun resumes from the one before
    and finishes."""
    elsewhere = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="checkpoints_"))
    try:
        workdir = tmp_path / "wd"
        workdir.mkdir()
        (workdir / "checkpoints").symlink_to(elsewhere)
        out = run(workdir, fashion_mnist_dir)
        assert out.returncode == 0, out.stderr[-3000:]
        (workdir / "result.json").unlink()
        for f in (elsewhere / "32" / "host").iterdir():
            f.write_text("not json")
        again = run(workdir, fashion_mnist_dir)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "checkpoint at step 32 cannot be read" in again.stderr
        assert (workdir / "rejected_checkpoints" / "32").is_dir()
        assert "resuming at step 24" in again.stderr
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_a_closed_terminal_stops_the_run_as_a_preemption_does(
    tmp_path, fashion_mnist_dir, straight
):
    """SIGHUP (the terminal closed, the ssh session dropped) ended the run with exit 129,
    no message and no checkpoint. It now stops it as SIGTERM does: a checkpoint at the
    step it reached, one line, exit 0; the rerun ends with the uninterrupted sha."""
    workdir = tmp_path / "wd"
    proc = start(workdir, fashion_mnist_dir, *LONGER)
    wait_for_checkpoint(proc, workdir, 16)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    saved = re.search(r"preempted: checkpoint saved at step (\d+)", out)
    assert saved and int(saved[1]) in checkpoint_steps(workdir), out
    again = run(workdir, fashion_mnist_dir, *LONGER)
    assert again.returncode == 0, again.stderr[-3000:]
    assert result(workdir)["params_sha256"] == result(straight)["params_sha256"]


@pytest.mark.parametrize("when", ["importing", "building"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, fashion_mnist_dir, when):
    """Ctrl-C while main.py imports JAX, or once it has written its run record and is
    loading data and compiling: a traceback of 28 or 147 lines. Now one line, exit
    130, the workdir lock released."""
    workdir = tmp_path / "wd"
    proc = start(workdir, fashion_mnist_dir)
    deadline = time.time() + 120
    if when == "importing":
        time.sleep(1.0)
    else:
        while not (workdir / "run_config.json").exists() and time.time() < deadline:
            time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = [x for x in (out + err).splitlines() if x.strip()]
    assert "Traceback" not in err, err[-3000:]
    assert [x for x in lines if x.startswith(("interrupted", "error:"))], err[-3000:]
    assert not (workdir / "run.lock").exists()


@pytest.mark.parametrize(
    "command,line",
    [
        (
            ["-m", "largebatch_jax.plot", "{wd}", "--out", "{tmp}/missing/c.png"],
            "--out={tmp}/missing/c.png: the folder {tmp}/missing does not exist: create it first.",
        ),
        (
            ["-m", "largebatch_jax.plot", "{wd}", "--out", "{tmp}/c.pngx"],
            "--out={tmp}/c.pngx: cannot write a .pngx file: name it with one of .png, .pdf, "
            ".svg, .jpg.",
        ),
        (
            [
                "-m",
                "largebatch_jax.aot",
                "--config=configs/smoke.py",
                "--topology=v5e:2x2",
                "--json={tmp}/missing/figures.json",
            ],
            "--json={tmp}/missing/figures.json: the folder {tmp}/missing does not exist: "
            "create it first.",
        ),
    ],
    ids=["plot_missing_folder", "plot_unknown_suffix", "aot_json_missing_folder"],
)
def test_an_output_file_that_cannot_be_written_is_one_line_before_the_work(tmp_path, command, line):
    """`plot --out` into a missing folder or with a suffix matplotlib cannot write, and
    `aot --json` into a missing folder (after the whole compile): tracebacks. Each is one
    line, exit 2, before any work."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text('{"step": 4, "epoch": 1.0, "train_error": 0.5}\n')
    fill = {"wd": str(workdir), "tmp": str(tmp_path)}
    out = call([sys.executable, *(c.format(**fill) for c in command)], timeout=120)
    _refused(out, line.format(**fill))


def test_an_empty_lock_from_the_future_is_stale(tmp_path, fashion_mnist_dir):
    """An empty run.lock whose mtime is a day ahead (a clock set back, a file copied in)
    refused the run for that day ('try again in 5 s'). It is stale like an old one:
    replaced with one warning, and the run trains."""
    workdir = tmp_path / "wd"
    workdir.mkdir()
    lock = workdir / "run.lock"
    lock.write_text("")
    ahead = time.time() + 86400
    os.utime(lock, (ahead, ahead))
    out = run(workdir, fashion_mnist_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replaced the stale lock" in out.stderr, out.stderr[-3000:]
    assert (workdir / "result.json").exists()


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--processes=2", "--devices_per_process=4", "--", "/nonexistent_binary"],
            "`/nonexistent_binary` after `--` is neither a program on the PATH nor a Python "
            "script: check its name and path.",
        ),
        (
            ["--processes=300", "--devices_per_process=1", "--", "true"],
            "--processes=300 must be from 1 to 256.",
        ),
    ],
    ids=["missing_program", "too_many_processes"],
)
def test_the_launcher_refuses_what_it_cannot_start(args, line):
    """`launch -- /nonexistent_binary` was a traceback; --processes had no upper bound
    (300 processes started). Each is one line, exit 2, nothing started."""
    out = call([sys.executable, "-m", "largebatch_jax.launch", *args], timeout=60)
    _refused(out, line)


def test_decoding_workers_and_threads_are_bounded(tmp_path, fashion_mnist_dir):
    """--config.workers had no upper bound (a typo of 80000 starts that many processes):
    it is refused in one line, as are threads beyond the same bound."""
    for field, value, allowed in (
        ("workers", 300, "from 0 to 256"),
        ("threads", 0, "from 1 to 256"),
    ):
        out = run(tmp_path / field, fashion_mnist_dir, f"--config.{field}={value}", timeout=120)
        _refused(out, f"config.{field}={value} must be {allowed}.")


def _cut_back(straight: Path, workdir: Path, step: int) -> None:
    """A copy of the finished `straight` run as it stood when checkpoint `step` was the
    newest: later checkpoints and result.json gone, metrics.jsonl cut back to `step`."""
    shutil.copytree(straight, workdir)
    (workdir / "result.json").unlink()
    for s in checkpoint_steps(workdir):
        if s > step:
            shutil.rmtree(workdir / "checkpoints" / str(s))
    rows = (workdir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (workdir / "metrics.jsonl").write_text(
        "".join(r for r in rows if json.loads(r)["step"] <= step)
    )


@pytest.mark.parametrize("host", ["[]", '{"note": "no fields"}', "step"])
def test_a_checkpoint_whose_host_state_is_damaged_is_set_aside(
    tmp_path, fashion_mnist_dir, straight, host
):
    """Checkpoint 16's host JSON replaced by `[]` or an object without its fields was
    used as it was: step and data position restarted at 0 on step-16 parameters and the
    run ended 'done' with another sha. An edited `step` was a traceback on every rerun.
    Now such a checkpoint is set aside like one with damaged arrays (the stamp covers
    the host state and its step must be the arrays' own), and the run resumes from the
    one before with the uninterrupted sha."""
    workdir = tmp_path / "wd"
    _cut_back(straight, workdir, 16)
    saved = workdir / "checkpoints" / "16" / "host" / "metadata"
    if host == "step":
        blob = json.loads(saved.read_text())
        blob["step"] = 15
        saved.write_text(json.dumps(blob))
    else:
        saved.write_text(host)
    out = run(workdir, fashion_mnist_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint at step 16 is damaged (its host state" in out.stderr, out.stderr[-3000:]
    assert "resuming at step 8" in out.stderr
    assert result(workdir)["params_sha256"] == result(straight)["params_sha256"]


def test_the_papers_metric_says_which_evaluations_are_missing(
    tmp_path, fashion_mnist_dir, straight
):
    """metrics.jsonl deleted after the evaluation at epoch 3 (the paper's metric takes
    epochs 3 and 4 here), the run resumed from step 56: the metric came from epoch 4
    alone, silently. The run now says which are missing, in a warning, the done line and
    result.json."""
    workdir = tmp_path / "wd"
    _cut_back(straight, workdir, 56)
    (workdir / "metrics.jsonl").unlink()
    out = run(workdir, fashion_mnist_dir, *LONGER)
    assert out.returncode == 0, out.stderr[-3000:]
    assert result(workdir)["evaluations_missing"] == [3.0]
    assert "evaluations at epochs [3.0] are missing" in out.stderr
    assert "without the evaluations at epochs [3.0]" in out.stdout


@pytest.mark.parametrize(
    "kind,line",
    [
        ("utf16", "is not UTF-8 text (byte 0xff at 0; UTF-16?): save it as UTF-8."),
        ("nul", "holds NUL bytes: save it as UTF-8 text."),
    ],
)
def test_a_config_file_that_is_not_utf8_text_is_one_line(tmp_path, kind, line):
    """A config file saved as UTF-16 was a traceback of 64 lines; one with a NUL byte
    said 'line None'. Each is one line naming the file and the fix."""
    source = "from configs import smoke\n\n\ndef get_config():\n    return smoke.get_config()\n"
    config = tmp_path / f"{kind}.py"
    if kind == "utf16":
        config.write_text(source, encoding="utf-16")
    else:
        config.write_bytes(source.replace("\n\n\n", "\n\x00\n").encode())
    out = call([sys.executable, "main.py", f"--config={config}", f"--workdir={tmp_path / 'wd'}"])
    _refused(out, f"--config={config}: {config} {line}")


def test_a_config_file_without_get_config_is_one_line_in_its_own_words(tmp_path):
    """A config file without get_config() was answered with ml_collections' internal
    module name and a quote lost (`module 'config_config' has no attribute
    'get_config`): the line now names the file and what it must define."""
    config = tmp_path / "mine.py"
    config.write_text("batch_size = 64\n")
    out = call([sys.executable, "main.py", f"--config={config}", f"--workdir={tmp_path / 'wd'}"])
    _refused(
        out,
        f"--config={config}: the file defines no get_config(): a config file returns its "
        "ConfigDict from get_config(), as configs/smoke.py does.",
    )


def test_a_file_beside_the_class_folders_is_named(tmp_path):
    """`train/notes.txt` beside the class folders was left out without a word; it is
    named in the prepare's one summary line, with why."""
    from tests.test_faults import make_folder, prepare

    make_folder(tmp_path / "pets", bad=False)
    (tmp_path / "pets" / "train" / "notes.txt").write_text("where the photos came from\n")
    out = prepare(tmp_path / "pets", tmp_path / "tfds")
    assert out.returncode == 0, out.stderr[-3000:]
    (summary,) = [x for x in out.stdout.splitlines() if "left out" in x]
    assert "left out 1 file(s), each with why: train/notes.txt (not in a class folder)" in summary


def test_a_math_field_edited_in_the_record_is_named_as_an_edit(
    tmp_path, fashion_mnist_dir, straight
):
    """base_lr edited in run_config.json: the run answered 'rerun with
    --config.base_lr=0.2', and that rerun then rejected every checkpoint as another
    run's. The checkpoints' stamp says which is right: the record was edited, and the
    line says to restore or delete it; deleted, the same command resumes and ends with
    the uninterrupted sha."""
    workdir = tmp_path / "wd"
    _cut_back(straight, workdir, 32)
    record = workdir / "run_config.json"
    record.write_text(record.read_text().replace('"base_lr": 0.1', '"base_lr": 0.2'))
    out = run(workdir, fashion_mnist_dir, *LONGER)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = error_lines(out.stderr)
    assert "run_config.json was edited: its checkpoints carry this config's run" in line
    assert "delete it (this config is then recorded)" in line
    record.unlink()
    again = run(workdir, fashion_mnist_dir, *LONGER)
    assert again.returncode == 0, again.stderr[-3000:]
    assert result(workdir)["params_sha256"] == result(straight)["params_sha256"]


BIG = "9" * 100_000  # a value pasted by mistake


@pytest.mark.parametrize(
    "args,named",
    [
        (["main.py", f"--config.batch_size={BIG}"], "--config.batch_size=999"),
        (["main.py", f"--config.model={BIG}"], "config.model='999"),
        (["main.py", f"--config.decay_epochs=({BIG},)"], "--config.decay_epochs=(999"),
        (
            ["-m", "largebatch_jax.launch", "--processes=1", "--devices_per_process=1", "--", BIG],
            "`999",
        ),
        (
            ["-m", "largebatch_jax.plot", "w", f"--out=/nonexistent/{BIG}.png"],
            "--out=/nonexistent/999",
        ),
    ],
    ids=["int_field", "choice_field", "tuple_field", "launch_program", "plot_out"],
)
def test_a_huge_value_is_shown_by_its_ends_in_one_short_line(tmp_path, args, named):
    """A 100 KB value made a 100-300 KB error line (thousands of screen lines), repeated up
    to three times: each error line now shows it by its start, its end and its length."""
    if args[0] == "main.py":
        args = [*args[:1], "--config=configs/smoke.py", f"--workdir={tmp_path}", *args[1:]]
    out = call([sys.executable, *args], timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    (line,) = error_lines(out.stderr)
    assert named in line and "...(100,0" in line and len(line) < 800, line[:1000]


def test_an_unknown_field_on_the_command_line_without_a_near_one_is_named(tmp_path):
    """`--config.label_smoothing=0.1` (no field is near it) said `AttributeError:
    label_smoothing`: now the line that a typo gets, without the guess."""
    out = call(
        [
            sys.executable,
            "main.py",
            "--config=configs/smoke.py",
            f"--workdir={tmp_path}",
            "--config.label_smoothing=0.1",
        ],
        timeout=120,
    )
    _refused(
        out,
        "--config.label_smoothing: the config has no field 'label_smoothing'; the fields are "
        "in configs/base.py.",
    )


def _process_tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [pid, *(p for c in children.split() for p in _process_tree(int(c)))]


def test_a_whole_job_paused_past_its_heartbeat_says_so_in_one_line(
    tmp_path, fashion_mnist_dir, straight
):
    """Every process of a 2-process job stopped past the heartbeat timeout (SLURM's
    suspend, a VM pause; here SIGSTOP for 15 s against 6 s): JAX's service takes them
    for dead and aborts them, which printed 176 lines and no word of a pause. Now one
    line names the pause and the flag to raise; the checkpoints kept are the
    uninterrupted run's (a rerun resumes from them: the heartbeat tests of
    test_multihost.py). Resumed all at once, JAX's heartbeat check and the processes'
    next heartbeats race: in 1 CI run of about 6 the service took the new heartbeats
    first and the job went on; it must then end as the uninterrupted run does, with no
    error line. (Resuming process 1 a second later instead, as a suspended job's nodes
    may come back, let the local launcher see a stopped process and exit 139.)"""
    # 40 epochs, so that the pause surely comes mid-run; its first 64 steps are the
    # uninterrupted run's (the same decays, at epochs 2 and 3).
    flags = (*LONGER, "--config.num_epochs=40.0", "--heartbeat_timeout_seconds=6")
    proc = start(tmp_path, fashion_mnist_dir, *flags, processes=2, devices=4)
    wait_for_checkpoint(proc, tmp_path, 8)
    job = _process_tree(proc.pid)
    for pid in job:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(15)
    for pid in job:
        os.kill(pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=180)
    lines = [x.removeprefix("[p0] ").removeprefix("[p1] ") for x in err.splitlines()]
    found = error_lines("\n".join(lines))
    if proc.returncode == 0:  # the service took the resumed heartbeats in time
        assert not found and "Traceback" not in err, err[-3000:]
        assert result(tmp_path)["steps"] == 640
        return
    assert proc.returncode == 134, err[-3000:]  # 128 + SIGABRT: JAX aborts the processes
    assert len(found) == 1, "\n".join(found)
    (line,) = found
    assert re.match(r"error: this job was paused for 1[4-6] s \(", line), line
    assert "(--heartbeat_timeout_seconds=6)" in line and "rerun the same command" in line
    assert not [x for x in lines if "Traceback" in x or "Fatal Python" in x or "@ " in x]
    _kept_are_the_uninterrupted_runs(tmp_path, straight, at_least=8)
