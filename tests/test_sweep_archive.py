"""The sweeps' runs are kept as one archive per config (experiments/results/<config>.tar.xz,
experiments/sweep/archive.py): the committed tables come back from it byte for byte, and a
sweep packs its finished workdirs into it."""

import json
import re
import shlex
import shutil
import tarfile

from tests.runs import ROOT

RESULTS = ROOT / "experiments" / "results"
ARCHIVE = RESULTS / "fashion_sweep.tar.xz"


def sweep_main(capsys, *args):
    from experiments import sweep

    capsys.readouterr()
    code = sweep.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_archive_gives_back_the_committed_table(tmp_path, capsys):
    """invariance_exact's own command with --collect_only, from the archive alone (no
    workdir): the same .md (its date kept: the table is unchanged) and .csv, bit for bit."""
    name = "invariance_exact"
    committed = (RESULTS / f"{name}.md").read_text()
    command = re.search(r"^Command: `python -m experiments\.sweep (.*)`$", committed, re.M)[1]
    out = tmp_path / "results"
    out.mkdir()
    shutil.copyfile(RESULTS / f"{name}.md", out / f"{name}.md")
    before = ARCHIVE.read_bytes()
    code, stdout, err = sweep_main(
        capsys,
        *shlex.split(command),
        "--collect_only",
        f"--runs={tmp_path / 'runs'}",
        f"--out={out}",
        f"--archive={ARCHIVE}",
    )
    assert code == 0, err[-2000:]
    assert stdout.count("done (archived)") == 3, stdout
    assert (out / f"{name}.md").read_text() == committed
    assert (out / f"{name}.csv").read_bytes() == (RESULTS / f"{name}.csv").read_bytes()
    assert (out / f"{name}.png").stat().st_size > 10_000
    assert ARCHIVE.read_bytes() == before and not (tmp_path / "runs").exists()


def test_a_sweep_packs_its_finished_runs_and_reads_them_back(tmp_path, capsys):
    """A finished workdir goes into OUT/<config>.tar.xz (its record only, fixed metadata);
    without the workdir the same command skips the run and writes the same files."""
    workdir = tmp_path / "runs" / "smoke" / "default"
    workdir.mkdir(parents=True)
    result = {
        "val_error_top1_median_last_epochs": 0.25,
        "final_val_error_top1": 0.25,
        "steps": 8,
        "peak_learning_rate": 0.1,
        "train_seconds": 60.0,
    }
    (workdir / "result.json").write_text(json.dumps(result))
    rows = [{"step": s, "epoch": s / 8, "train_loss": 2.0 / s, "train_error": 0.5} for s in (4, 8)]
    rows.append({"step": 8, "epoch": 1.0, "epoch_train_error": 0.4})
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "devices.json").write_text('{"devices": 8}')
    (workdir / "checkpoints").mkdir()  # not part of the record
    (workdir / "checkpoints" / "8").write_text("state")
    args = ["--name=t", "--config=configs/smoke.py", "--grid=seed=0", "--curves"]
    args += [f"--runs={tmp_path / 'runs'}", f"--out={tmp_path / 'results'}"]
    code, stdout, err = sweep_main(capsys, *args)
    assert code == 0 and "1/1] default: done" in stdout, err[-2000:]
    archive = tmp_path / "results" / "smoke.tar.xz"
    with tarfile.open(archive, "r:xz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "default/devices.json",
        "default/metrics.jsonl",
        "default/result.json",
    ]
    assert {(m.mtime, m.mode, m.uid, m.gid, m.uname) for m in members} == {(0, 0o644, 0, 0, "")}
    table, packed = (tmp_path / "results" / "t.csv").read_bytes(), archive.read_bytes()
    assert b",default,done,0.25,0.25,0.4,8,0.1," in table
    shutil.rmtree(tmp_path / "runs")
    code, stdout, err = sweep_main(capsys, *args)
    assert code == 0 and "1/1] default: done (archived)" in stdout, err[-2000:]
    assert (tmp_path / "results" / "t.csv").read_bytes() == table
    assert archive.read_bytes() == packed and not (tmp_path / "runs").exists()
    # A sweep on another device count is refused for an archived run, as for a workdir.
    code, _, err = sweep_main(capsys, *args, "--devices=2")
    assert code == 2 and "was trained on devices=8, this sweep asks for 2" in err


def test_compare_runs_reads_runs_from_the_archive(capsys, monkeypatch):
    from experiments import compare_runs

    name = "batch_size=1024-eval_batch_size=1024-reduction=exact"
    argv = ["compare_runs", f"--archive={ARCHIVE}", f"{name}-devices=8", name]
    monkeypatch.setattr("sys.argv", argv)
    capsys.readouterr()
    assert compare_runs.main() == 0
    compared = capsys.readouterr().out
    assert compared in (RESULTS / "invariance_exact_compare.txt").read_text()
    assert "final parameters bit-identical: True" in compared
    monkeypatch.setattr("sys.argv", [*argv[:2], "no_such_run", name])
    assert compare_runs.main() == 2
    assert "no_such_run: no such run in" in capsys.readouterr().err
