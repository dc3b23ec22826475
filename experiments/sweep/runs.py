"""Training a sweep's runs (main.py in a subprocess, one workdir each) and reading what
they left."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from experiments.sweep.grid import ROOT, SweepError, flag_value
from largebatch_jax.metrics import read_metrics

METRIC = "val_error_top1_median_last_epochs"
# Where a spike is looked for: warmup's job is the first epochs (RESULTS.md, warmup_range).
SPIKE_EPOCHS = 2.0


def loss_spike(records: list[dict], epochs: float = SPIKE_EPOCHS) -> float | None:
    """The largest rise of the logged training loss above its lowest value so far, over the
    log points of the first `epochs`: how far training was thrown back (a stable run rises
    only by minibatch noise; one that spikes, by more). None without log points."""
    losses = [r["train_loss"] for r in records if "train_loss" in r and r["epoch"] <= epochs]
    if not losses:
        return None
    rise, low = 0.0, losses[0]
    for loss in losses[1:]:
        rise, low = max(rise, loss - low), min(low, loss)
    return float(rise)


def check_devices(
    workdir: Path, devices: int | None, record_it: bool = True, archive: Path | None = None
) -> None:
    """A workdir trains on one device count: record it, refuse another. With `archive`,
    `workdir` is that archive's copy of the run (only checked)."""
    record = workdir / "devices.json"
    if record.exists():
        had = json.loads(record.read_text())["devices"]
        if had != devices:
            where = f"run {workdir.name} of {archive}" if archive else str(workdir)
            raise SweepError(
                f"{where} was trained on devices={had}, this sweep asks for {devices}: "
                f"rerun with --devices={had or 0} or use another "
                f"{'--archive' if archive else '--runs folder'}."
            )
    elif record_it:
        workdir.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"devices": devices}))


def run_one(config_path: str, workdir: Path, overrides: dict[str, Any], devices: int | None) -> str:
    """Train one run (or resume it); returns 'done', 'preempted', 'diverged' or 'failed'."""
    workdir.mkdir(parents=True, exist_ok=True)
    devices = overrides.get("devices", devices)
    overrides = {k: v for k, v in overrides.items() if k != "devices"}
    command = [
        sys.executable,
        "main.py",
        f"--config={config_path}",
        f"--workdir={workdir}",
        *[f"--config.{k}={flag_value(v)}" for k, v in overrides.items()],
    ]
    env = dict(os.environ)
    if devices is not None:  # fake CPU devices; on accelerators leave the platform alone
        env["XLA_FLAGS"] = (
            re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
            + f" --xla_force_host_platform_device_count={devices}"
        ).strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    with (workdir / "log.txt").open("a") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code == 0 and (workdir / "result.json").exists():
        return "done"
    if code == 0:  # a preemption notice (SIGTERM): checkpoint saved, the next sweep resumes
        return "preempted"
    text = (workdir / "log.txt").read_text()
    status = "diverged" if "non-finite loss" in text else "failed"
    (workdir / "failed.json").write_text(json.dumps({"status": status, "exit_code": code}))
    return status


def collect(run: dict, files: Path | None = None) -> dict:
    """One table row from a run's files: its archived record (`files`) or its workdir."""
    folder = Path(run["workdir"]) if files is None else files
    row = {**run["values"], "run": Path(run["workdir"]).name, "status": "pending"}
    if (folder / "metrics.jsonl").exists():  # a diverged run's too: up to its last log
        row["loss_spike"] = loss_spike(read_metrics(folder))
    if (folder / "result.json").exists():
        result = json.loads((folder / "result.json").read_text())
        epochs = [r for r in read_metrics(folder) if "epoch_train_error" in r]
        row.update(
            status="done",
            error=result[METRIC],
            final_error=result["final_val_error_top1"],
            train_error=epochs[-1]["epoch_train_error"] if epochs else None,
            steps=result["steps"],
            peak_lr=result["peak_learning_rate"],
            # Training time of every session (older results have only the last one's).
            seconds=result.get("train_seconds", result.get("train_seconds_this_session")),
        )
    elif (folder / "failed.json").exists():
        row["status"] = json.loads((folder / "failed.json").read_text())["status"]
    return row
