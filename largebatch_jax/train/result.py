"""A run's result (rule 14's metric and what was run), written to result.json once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from largebatch_jax import record
from largebatch_jax import workdir as wd
from largebatch_jax.checkpoint import tree_digest
from largebatch_jax.metrics import TrainClock, read_metrics
from largebatch_jax.train.loop import Triggers
from largebatch_jax.train.state import Progress, Run

RESULT = "result.json"


def paper_metric(evals: list[dict], num_epochs: float, last_epochs: float) -> dict:
    """Paper rule 14: a run's error is the median top-1 validation error of the
    evaluations made in its last `last_epochs` epochs (5 in the paper)."""
    used = [e for e in evals if e["epoch"] > num_epochs - last_epochs + 1e-9]
    return {
        "val_error_top1_median_last_epochs": (
            float(np.median([e["val_error_top1"] for e in used])) if used else None
        ),
        "last_epochs": last_epochs,
        "evaluations_used": [
            {"epoch": e["epoch"], "val_error_top1": e["val_error_top1"]} for e in used
        ],
    }


def missing_evaluations(run: Run, used: list[dict]) -> list[float]:
    """The epochs of the evaluations that the paper's metric should use (those the loop
    made in the last `result_last_epochs` epochs) but metrics.jsonl does not hold."""
    c, spe, total = run.config, run.plan.steps_per_epoch, run.plan.total_steps
    triggers = Triggers.of(run.plan)
    first = c.num_epochs - c.result_last_epochs + 1e-9
    due = [s / spe for s in range(1, total + 1) if s / spe > first and triggers.at(s).evaluate]
    have = {round(e["epoch"], 9) for e in used}
    return [e for e in due if round(e, 9) not in have]


def finish(run: Run, state: Any, progress: Progress, clock: TrainClock) -> dict:
    """The run's result from its metrics.jsonl and final state; written to result.json."""
    c = run.config
    evals = [r for r in read_metrics(run.workdir) if "val_error_top1" in r]
    final = evals[-1] if evals else {}
    metric = paper_metric(evals, c.num_epochs, c.result_last_epochs)
    missing = missing_evaluations(run, metric["evaluations_used"])
    if missing and run.is_main:
        logging.warning(
            "the evaluations at epochs %s are missing from %s (lost or deleted): the paper's "
            "metric is the median of the others only; result.json lists them",
            missing,
            run.workdir / "metrics.jsonl",
        )
    result = {
        **metric,
        **({"evaluations_missing": missing} if missing else {}),
        "final_val_error_top1": final.get("val_error_top1"),
        "final_val_error_top5": final.get("val_error_top5"),
        "steps": run.plan.total_steps,
        "epochs": c.num_epochs,
        "skipped_steps": progress.skipped,
        # Training time only (no evaluation, checkpoints or compiles), every session.
        "train_seconds": clock.total_seconds(),
        "train_seconds_this_session": clock.session_seconds(),
        "wall_seconds_this_session": clock.wall_seconds(),
        "paused_seconds_this_session": dict(clock.paused_seconds),
        "params_sha256": tree_digest(state.params),
        "batch_size": run.plan.kn,
        "bn_group_size": run.plan.n,
        "peak_learning_rate": run.plan.peak_lr,
        "config": c.to_dict(),
    }
    if run.is_main:
        wd.atomic_write_text(run.workdir / RESULT, json.dumps(result, indent=2, default=str) + "\n")
    return result


def finished_result(run: Run, progress: Progress) -> dict | None:
    """A finished run's stored result: rerunning it trains nothing and rewrites nothing."""
    path = run.workdir / RESULT
    if progress.step < run.plan.total_steps or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # torn by a crash before it was written atomically: write it again


def finished_in(workdir: Path, config: Any) -> dict | None:
    """The stored result of the run in `workdir` where that run finished with this config
    (the same length and every field of the math the same), else None. A finished run
    started again answers with it at once: a requeued or repeated job ends without
    starting the accelerators or waiting for its other processes."""
    try:
        result = json.loads((workdir / RESULT).read_text())
        recorded = result["config"]
        if recorded.get("num_epochs") != config.num_epochs:
            return None
        record.check_resume(recorded, config, int(result["steps"]), steps_per_epoch=1)
    except Exception:  # no result, a torn or foreign one, another config: the full start says
        return None
    return result


def summary(result: dict) -> str:
    """The run's headline: the paper's metric (rule 14) and the error after the last
    epoch, in percent, and how long the run took (wall time and training time)."""
    skipped = result.get("skipped_steps", 0)
    done = f"done, {skipped} of {result['steps']} updates skipped (non-finite)"
    final, metric = result["final_val_error_top1"], result["val_error_top1_median_last_epochs"]
    epochs = result["last_epochs"]
    last = "the last epoch" if epochs == 1 else f"the last {epochs:g} epochs"
    last_s = "the last epoch's" if epochs == 1 else f"the last {epochs:g} epochs'"
    parts = [
        f"{metric:.2%} by the paper's metric (the median of {last_s} evaluations)"
        if metric is not None
        else f"no evaluation in {last} for the paper's metric",
        "no evaluation after the last epoch"
        if final is None
        else f"{final:.2%} after the last epoch",
    ]
    missing = result.get("evaluations_missing")
    text = f"{done if skipped else 'done'}: top-1 error " + ", ".join(parts)
    if missing:
        text += f" (without the evaluations at epochs {missing}, missing from metrics.jsonl)"
    return text + _took(result)


def _took(result: dict) -> str:
    """'; 2 min 58 s wall time, 1 min 40 s training' (this session's wall time; the
    training time of every session, said so where the run was resumed)."""
    wall, train = result.get("wall_seconds_this_session"), result.get("train_seconds")
    if wall is None or train is None:
        return ""
    resumed = result.get("train_seconds_this_session", train) < train - 0.5
    return (
        f"; {duration(wall)} wall time{' this session' if resumed else ''}, "
        f"{duration(train)} training{' over every session' if resumed else ''}"
    )


def duration(seconds: float) -> str:
    """42 s, 2 min 58 s, 1 h 02 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
