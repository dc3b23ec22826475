"""A sweep's figure: the metric against a grid field, and training-error curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.sweep.tables import shown
from largebatch_jax import schedules
from largebatch_jax.metrics import read_metrics


def plot(
    name: str,
    out: Path,
    rows: list[dict],
    fields: list[str],
    x: str | None,
    curves: bool,
    title: str,
    base_batch_size: int = 256,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [f for f in fields if f not in ("seed", x)]
    panels = int(x is not None) + int(curves)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if x is not None:
        ax = axes.pop(0)
        for key, members in _by(rows, keys).items():
            points = {}
            for r in members:
                if r["status"] == "done":
                    points.setdefault(r[x], []).append(100 * r["error"])
            xs = sorted(points)
            lost = sorted({r[x] for r in members if r["status"] == "diverged"})
            color = None
            if xs:
                means = [np.mean(points[v]) for v in xs]
                stds = [np.std(points[v], ddof=1) if len(points[v]) > 1 else 0 for v in xs]
                line = ax.errorbar(
                    xs, means, yerr=stds, marker="o", capsize=3, label=_label(keys, key)
                )
                color = line[0].get_color()
            if lost:  # diverged at these x (some seed): crosses on the axis' top edge
                ax.plot(
                    lost,
                    [0.97] * len(lost),
                    "x",
                    ms=9,
                    color=color,
                    label=None if xs else f"{_label(keys, key)} (diverged)",
                    transform=ax.get_xaxis_transform(),
                    clip_on=False,
                )
        if x in ("batch_size", "lr_multiplier"):
            ax.set_xscale("log", base=2)
            ticks = sorted({r[x] for r in rows})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlabel(x)
        ax.set_ylabel("top-1 validation error (%), mean +- std over seeds")
        if any(r["status"] == "diverged" for r in rows):
            ax.set_title("x: diverged (some seed)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if curves:
        ax = axes.pop(0)
        curve_keys = [f for f in fields if f != "seed"]
        for key, members in _by(rows, curve_keys).items():
            done = [r for r in members if r["status"] == "done"]
            if not done:
                continue
            train = [r for r in read_metrics(done[0]["files"]) if "train_error" in r]
            epochs = np.array([r["epoch"] for r in train])
            errors = np.array([100 * r["train_error"] for r in train])
            width = max(1, len(errors) // 30)  # smoothed, as the paper's curves
            smooth = np.convolve(errors, np.ones(width) / width, mode="valid")
            shown = dict(zip(curve_keys, key, strict=True))
            kn = done[0].get("batch_size")
            if kn is not None and not schedules.warmup_applies(kn, base_batch_size):
                shown.pop("warmup", None)  # no warmup at or below the base kn
            ax.plot(epochs[width - 1 :], smooth, label=_label(list(shown), tuple(shown.values())))
        ax.set_xlabel("epoch")
        ax.set_ylabel("training error (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _by(rows: list[dict], keys: list[str]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _label(keys: list[str], values: tuple) -> str:
    return ", ".join(f"{k}={shown(v)}" for k, v in zip(keys, values, strict=True)) or "runs"
