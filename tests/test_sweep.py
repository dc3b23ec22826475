"""`python -m experiments.sweep` on a 2 x 2 smoke grid: runs, skips finished runs, collects the
paper's metric into the CSV / Markdown tables and draws the figure."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.runs import PLUGIN_LINE, ROOT, env

GRID = [
    "--name=smoke_grid",
    "--config=configs/smoke.py",
    "--grid=batch_size=32,64",
    "--grid=seed=0,1",
    "--set=num_epochs=1.0",
    "--set=train_subset=512",  # 8 or 16 steps a run: the sweep, not the training, is tested
    "--set=eval_subset=256",
    "--set=decay_epochs=(0.5;0.75)",
    "--set=warmup_epochs=0.125",
    "--set=result_last_epochs=0.5",
    "--plot=batch_size",
    "--curves",
]


def sweep(tmp_path, data_dir, *args):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.sweep",
            *args,
            f"--runs={tmp_path / 'runs'}",
            f"--out={tmp_path / 'results'}",
        ],
        cwd=ROOT,
        env={**env(), "TFDS_DATA_DIR": data_dir},
        capture_output=True,
        text=True,
        timeout=600,
    )


def sweep_here(capsys, tmp_path, *args):
    """sweep.main in this process (for what trains nothing): (exit code, stdout, stderr)."""
    from experiments import sweep as sweep_lib

    capsys.readouterr()
    code = sweep_lib.main([*args, f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'results'}"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_sweep_runs_collects_and_resumes(tmp_path, fashion_mnist_dir):
    out = sweep(tmp_path, fashion_mnist_dir, *GRID)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("training ...") == 4
    assert [x for x in (out.stdout + out.stderr).splitlines() if PLUGIN_LINE.search(x)] == []
    results = tmp_path / "results"
    with (results / "smoke_grid.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["batch_size"], r["seed"]) for r in rows] == [
        ("32", "0"),
        ("32", "1"),
        ("64", "0"),
        ("64", "1"),
    ]
    assert all(r["status"] == "done" for r in rows)
    runs = tmp_path / "runs" / "smoke"
    for r in rows:  # the table holds each run's own result.json
        result = json.loads((runs / r["run"] / "result.json").read_text())
        assert float(r["error"]) == pytest.approx(result["val_error_top1_median_last_epochs"])
        assert result["batch_size"] == int(r["batch_size"])
    # Markdown: one line per kn, mean +- std over the two seeds, and the command.
    table = (results / "smoke_grid.md").read_text()
    assert "python -m experiments.sweep --name=smoke_grid" in table
    for kn in ("32", "64"):
        errors = [100 * float(r["error"]) for r in rows if r["batch_size"] == kn]
        (line,) = [x for x in table.splitlines() if x.startswith(f"| {kn} |")]
        assert f"{np.mean(errors):.2f} +- {np.std(errors, ddof=1):.2f} | 2 |" in line
    assert (results / "smoke_grid.png").stat().st_size > 10_000
    # Rerun: everything is done, nothing trains, the tables are the same.
    again = sweep(tmp_path, fashion_mnist_dir, *GRID)
    assert again.returncode == 0 and "training ..." not in again.stdout
    assert (results / "smoke_grid.md").read_text().split("\n", 4)[4] == table.split("\n", 4)[4]


def test_sweep_rejects_unknown_fields_and_bad_values(tmp_path, capsys):
    for bad, words in [
        ("--grid=batchsize=32", "'batchsize' is not a config field"),
        ("--grid=batch_size=3x", "batch_size='3x' is not an int"),
    ]:
        code, _, err = sweep_here(capsys, tmp_path, "--name=x", "--config=configs/smoke.py", bad)
        assert code == 2
        assert words in err, err[-1000:]


def test_run_names_identify_runs():
    from configs import smoke
    from experiments import sweep as sweep_lib

    defaults = smoke.get_config()
    name = sweep_lib.run_name({"batch_size": 128, "seed": 0, "warmup": "none"}, defaults, 8)
    assert name == "batch_size=128-warmup=none"  # seed 0 is the default
    # At kn <= base_batch_size there is no warmup (rule 2): the same run either way.
    assert sweep_lib.run_name({"batch_size": 32, "warmup": "none"}, defaults, 8) == (
        sweep_lib.run_name({"batch_size": 32}, defaults, 8)
    )
    # A run names its device count only where it differs from the sweep's.
    assert sweep_lib.run_name({}, defaults, 1) == "default"
    assert sweep_lib.run_name({"devices": 1}, defaults, 8) == "devices=1"
    assert sweep_lib.run_name({"devices": 2}, defaults, 2) == "default"
    assert sweep_lib.parse_value("decay_epochs", "(1;2.5)", (30.0, 60.0)) == (1.0, 2.5)


def test_extra_runs_and_devices(tmp_path, capsys):
    code, stdout, err = sweep_here(
        capsys,
        tmp_path,
        "--name=x",
        "--config=configs/smoke.py",
        "--grid=warmup=none,gradual",
        "--extra=batch_size=32",
        "--extra=devices=1,accum_steps=8",
        "--dry_run",
    )
    assert code == 0, err[-1000:]
    names = [line.split("] ")[1].split(":")[0] for line in stdout.splitlines()]
    assert names == ["warmup=none", "default", "batch_size=32", "accum_steps=8-devices=1"]


def test_a_workdir_keeps_its_device_count(tmp_path, capsys):
    args = ["--name=x", "--config=configs/smoke.py", "--grid=seed=0", "--dry_run"]
    workdir = tmp_path / "runs" / "smoke" / "default"
    workdir.mkdir(parents=True)
    (workdir / "devices.json").write_text('{"devices": 8}')
    assert sweep_here(capsys, tmp_path, *args)[0] == 0
    code, _, err = sweep_here(capsys, tmp_path, *args, "--devices=2")
    assert code == 2
    assert "was trained on devices=8, this sweep asks for 2: rerun with --devices=8" in err


def test_compare_runs_reports_the_gap_epoch_by_epoch(tmp_path):
    from experiments import compare_runs

    for name, drift in (("a", 0.0), ("b", 1.0)):
        workdir = tmp_path / name
        workdir.mkdir()
        rows = [
            {"step": s, "epoch": s / 4, "train_loss": 2.0 - s / 10 + drift * (s / 4) ** 2 / 100}
            for s in range(1, 9)
        ] + [{"step": 8, "epoch": 2.0, "val_error_top1": 0.5 + drift / 10}]
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Epoch 1 holds steps 1-4 (epoch 1.0 closes it), epoch 2 steps 5-8.
    gaps = compare_runs.loss_gap_by_epoch(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [e for e, _ in gaps] == [0, 1]
    assert gaps[0][1] == pytest.approx(0.01) and gaps[1][1] == pytest.approx(0.04)
    summary = compare_runs.compare(str(tmp_path / "a"), str(tmp_path / "b"))
    assert summary["train_loss"][0] == 8
    assert summary["val_error_top1"][:2] == (1, pytest.approx(0.1))


def test_the_warmup_grids_go_through_the_config_validation(tmp_path, capsys):
    """The grids of experiments/small_scale.sh's warmup_range and warmup_length: the rate
    multiplier m and the warmup length are config fields like any other, m = 1 and the
    default warmup share the runs that exist, and a bad value stops the sweep with
    main.py's own one line before any run trains."""
    base = ["--name=x", "--config=configs/fashion_sweep.py", "--devices=2", "--dry_run"]
    code, stdout, err = sweep_here(
        capsys,
        tmp_path,
        *base,
        "--grid=lr_multiplier=1,2,16",
        "--grid=warmup=gradual,none",
        "--set=batch_size=1024",
    )
    assert code == 0, err[-1000:]
    names = [line.split("] ")[1].split(":")[0] for line in stdout.splitlines()]
    assert names == [
        "batch_size=1024",
        "batch_size=1024-warmup=none",
        "batch_size=1024-lr_multiplier=2.0",
        "batch_size=1024-lr_multiplier=2.0-warmup=none",
        "batch_size=1024-lr_multiplier=16.0",
        "batch_size=1024-lr_multiplier=16.0-warmup=none",
    ]
    # 1/90, 5/90 (the config's own) and 15/90 of the 10 epochs.
    code, stdout, err = sweep_here(
        capsys,
        tmp_path,
        *base,
        f"--grid=warmup_epochs={10 / 90!r},{10 * 5 / 90!r},{150 / 90!r}",
        "--set=batch_size=1024",
        "--set=lr_multiplier=8",
    )
    assert code == 0, err[-1000:]
    names = [line.split("] ")[1].split(":")[0] for line in stdout.splitlines()]
    assert names == [
        "batch_size=1024-lr_multiplier=8.0-warmup_epochs=0.1111111111111111",
        "batch_size=1024-lr_multiplier=8.0",
        "batch_size=1024-lr_multiplier=8.0-warmup_epochs=1.6666666666666667",
    ]
    for bad, words in [
        (
            "--grid=lr_multiplier=2,0",
            "run batch_size=1024-lr_multiplier=0.0: config.lr_multiplier=0.0 must be > 0.",
        ),
        ("--grid=warmup_epochs=0.5,-1", "config.warmup_epochs=-1.0 must be >= 0."),
        ("--grid=warmup_epochs=4", "config.warmup_epochs=4.0 runs past the first decay at epoch"),
    ]:
        code, _, err = sweep_here(capsys, tmp_path, *base[:-1], bad, "--set=batch_size=1024")
        assert code == 2, err[-1000:]
        assert words in err and len(err.strip().splitlines()) == 1, err[-1000:]
        assert not (tmp_path / "runs").exists()  # nothing trained, no workdir made


def test_the_loss_spike_is_the_largest_rise_above_the_lowest_loss_so_far():
    from experiments import sweep as sweep_lib

    logged = [(0.5, 2.0), (1.0, 1.2), (1.5, 1.9), (2.0, 1.0), (2.5, 1.8), (3.0, 9.0)]
    records = [{"epoch": e, "train_loss": loss} for e, loss in logged]
    records.insert(2, {"epoch": 1.0, "val_error_top1": 0.5})  # evaluations do not count
    assert sweep_lib.loss_spike(records) == pytest.approx(0.7)  # 1.2 -> 1.9, by epoch 2
    assert sweep_lib.loss_spike(records, epochs=3.0) == pytest.approx(8.0)
    assert sweep_lib.loss_spike([{"epoch": 0.5, "train_loss": 2.0}]) == 0.0
    assert sweep_lib.loss_spike([]) is None


def test_tables_show_fractions_of_training_short_and_the_csv_keeps_them_exact(tmp_path):
    from experiments import sweep as sweep_lib

    row = {
        "warmup_epochs": 5 / 90,
        "warmup": "gradual",
        "seed": 0,
        "status": "done",
        "error": 0.1323,
        "train_error": 0.1196,
        "peak_lr": 3.2,
    }
    sweep_lib.write_tables("t", tmp_path, [row], ["warmup_epochs", "warmup", "seed"], "cmd")
    assert "| 0.05556 | gradual | 3.2 | 13.23 |" in (tmp_path / "t.md").read_text()
    with (tmp_path / "t.csv").open() as f:
        assert float(next(csv.DictReader(f))["warmup_epochs"]) == 5 / 90
    assert sweep_lib.shown("none") == "none" and sweep_lib.shown(1024) == "1024"


@pytest.mark.slow
def test_a_preempted_run_is_resumed_not_failed(tmp_path, fashion_mnist_dir):
    """The cluster SIGTERMs a run of the sweep: the run saves its checkpoint and exits 0;
    the sweep calls it preempted (exit 1, no failed.json), and the same command resumes
    it to the end."""
    one = [a for a in GRID if not a.startswith(("--grid", "--plot", "--curves"))]
    one += ["--set=train_subset=2048", "--set=checkpoint_every_steps=4"]
    args = [sys.executable, "-m", "experiments.sweep", *one]
    args += [f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'results'}"]
    sweep_env = {**env(), "TFDS_DATA_DIR": fashion_mnist_dir}
    proc = subprocess.Popen(
        args, cwd=ROOT, env=sweep_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    runs = tmp_path / "runs" / "smoke"
    deadline = time.time() + 240
    while time.time() < deadline and not list(runs.glob("*/checkpoints/4")):
        time.sleep(0.1)
    (child,) = [
        int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    ]
    os.kill(child, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert "preempted (its checkpoint is saved: the same command resumes it)" in stdout
    (workdir,) = runs.iterdir()
    assert not (workdir / "failed.json").exists() and not (workdir / "result.json").exists()
    again = sweep(tmp_path, fashion_mnist_dir, *one)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "training ..." in again.stdout and (workdir / "result.json").exists()
    assert "resuming at step" in (workdir / "log.txt").read_text()
