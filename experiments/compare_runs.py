"""How far apart two runs' curves are: every logged training metric and every evaluation,
step by step, and the training-loss gap epoch by epoch (the invariance experiment: the
same kn on 8 devices and on 1 device with accumulation, against two seeds as the yardstick).

    python -m experiments.compare_runs RUN_A RUN_B
    python -m experiments.compare_runs --archive=SWEEP_ARCHIVE NAME_A NAME_B

RUN: a run's workdir; with --archive (e.g. experiments/results/fashion_sweep.tar.xz), a
run's name in that sweep archive (experiments/sweep/archive.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from largebatch_jax.metrics import read_metrics  # noqa: E402

KEYS = ("train_loss", "train_error", "grad_norm", "param_norm", "val_error_top1", "val_loss")


def compare(a: str, b: str) -> dict[str, tuple[int, float, float]]:
    """Per metric: (points compared, max absolute difference, max relative difference)."""
    rows_a = {(r["step"], tuple(sorted(r))): r for r in read_metrics(a)}
    rows_b = {(r["step"], tuple(sorted(r))): r for r in read_metrics(b)}
    shared = sorted(rows_a.keys() & rows_b.keys())
    out = {}
    for key in KEYS:
        diffs = [
            (abs(rows_a[s][key] - rows_b[s][key]), abs(rows_b[s][key]))
            for s in shared
            if key in rows_a[s]
        ]
        if diffs:
            out[key] = (
                len(diffs),
                max(d for d, _ in diffs),
                max(d / m for d, m in diffs if m) if any(m for _, m in diffs) else 0.0,
            )
    return out


def loss_gap_by_epoch(a: str, b: str) -> list[tuple[int, float]]:
    """Max |train_loss difference| of the logged steps within each epoch: how fast two
    runs that start from the same arithmetic drift apart."""
    loss_a = {
        r["step"]: (r["epoch"], r["train_loss"]) for r in read_metrics(a) if "train_loss" in r
    }
    loss_b = {r["step"]: r["train_loss"] for r in read_metrics(b) if "train_loss" in r}
    gaps: dict[int, float] = {}
    for step in sorted(loss_a.keys() & loss_b.keys()):
        epoch, value = loss_a[step]
        index = max(0, math.ceil(epoch) - 1)  # epoch 1.0 closes the first epoch
        gaps[index] = max(gaps.get(index, 0.0), abs(value - loss_b[step]))
    return sorted(gaps.items())


def main() -> int:
    args = sys.argv[1:]
    archived = args[0].split("=", 1)[1] if args and args[0].startswith("--archive=") else None
    args = args[1:] if archived else args
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if archived:
            from experiments.sweep import archive

            folder = stack.enter_context(archive.opened(ROOT / archived))
            missing = [r for r in args if not (folder / r).is_dir()]
            if missing:
                print(f"error: {', '.join(missing)}: no such run in {archived}", file=sys.stderr)
                return 2
            args = [str(folder / r) for r in args]
        report(*args)
    return 0


def report(a: str, b: str) -> None:
    print(f"{Path(a).name} vs {Path(b).name}")
    for key, (n, absolute, relative) in compare(a, b).items():
        print(f"  {key:15s} {n:5d} points  max |diff| {absolute:.3g}  max relative {relative:.3g}")
    gaps = "  ".join(f"{e + 1}: {g:.2g}" for e, g in loss_gap_by_epoch(a, b))
    print(f"  train_loss max |diff| per epoch  {gaps}")
    results = [json.loads((Path(r) / "result.json").read_text()) for r in (a, b)]
    metric = "val_error_top1_median_last_epochs"
    print(f"  paper metric    {results[0][metric]:.4f} vs {results[1][metric]:.4f}")
    same = results[0]["params_sha256"] == results[1]["params_sha256"]
    print(f"  final parameters bit-identical: {same}")


if __name__ == "__main__":
    sys.exit(main())
