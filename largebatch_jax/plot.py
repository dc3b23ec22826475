"""Paper-style curves of runs against each other (Figures 2-4): training error per epoch
and validation error, one line per workdir.

    python -m largebatch_jax.plot WORKDIR [WORKDIR ...] [--out curves.png] [--labels a,b]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from largebatch_jax import errors
from largebatch_jax.metrics import read_metrics
from largebatch_jax.workdir import output_file_problem


def curves(workdir: str) -> tuple[list, list]:
    """A run's (epoch, training error) and (epoch, validation top-1 error) points."""
    rows = read_metrics(workdir)
    train = [(r["epoch"], r["epoch_train_error"]) for r in rows if "epoch_train_error" in r]
    val = [(r["epoch"], r["val_error_top1"]) for r in rows if "val_error_top1" in r]
    return train, val


def check_workdirs(workdirs: list[str]) -> str:
    """Why the workdirs cannot be plotted, in one line ("" when each has a curve)."""
    for workdir in workdirs:
        if not Path(workdir).is_dir():
            return f"{workdir} is not a directory: name the workdirs of runs."
        if not any(curves(workdir)):
            return (
                f"{workdir} has no finished epoch or evaluation in its metrics.jsonl yet: "
                "nothing to plot (name the workdir of a run that has trained an epoch)."
            )
    return ""


def plot_runs(
    workdirs: list[str], out: str, labels: list[str] | None = None, title: str = ""
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [Path(w).name for w in workdirs]
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for workdir, label in zip(workdirs, labels, strict=True):
        train, val = curves(workdir)
        if train:
            ax_train.plot(*zip(*train, strict=True), label=label)
        if val:
            ax_val.plot(*zip(*val, strict=True), marker="o", markersize=3, label=label)
    for ax, name in ((ax_train, "training error"), (ax_val, "validation top-1 error")):
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"{name} (%)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def parser() -> argparse.ArgumentParser:
    """The plot command's line."""
    p = argparse.ArgumentParser(
        prog="python -m largebatch_jax.plot", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("workdirs", nargs="+", help="the runs' workdirs (each with metrics.jsonl)")
    p.add_argument("--out", default="curves.png", help="the figure's file: .png, .pdf, .svg, .jpg")
    p.add_argument("--labels", default="", help="comma-separated, one per workdir")
    p.add_argument("--title", default="", help="the figure's title")
    return p


def main() -> None:
    args = parser().parse_args()
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.workdirs):
        errors.fail(f"--labels names {len(labels)} runs, not {len(args.workdirs)}.")
    problem = output_file_problem("--out", args.out, (".png", ".pdf", ".svg", ".jpg")) or (
        check_workdirs(args.workdirs)
    )
    if problem:
        errors.fail(problem)
    print(plot_runs(args.workdirs, args.out, labels, args.title))


if __name__ == "__main__":
    main()
