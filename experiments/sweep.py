"""Run a grid of configs, one workdir per run, and collect the results into tables and
a figure.

    python experiments/sweep.py --name=fig1 --config=configs/fashion_sweep.py \\
        --grid=seed=0,1 --grid=warmup=gradual,none \\
        --grid=batch_size=256,512,1024,2048,4096,8192 --plot=batch_size

`--grid=FIELD=V1,V2,...` (repeatable; the first is the outermost loop, runs go in grid
order) and `--set=FIELD=V` (every run) override config fields; values are parsed with the
type of the field's default (tuples as `(a;b)` or `a;b`). A run is named by its overrides
that differ from the config's defaults, so two sweeps asking for the same run share it
(warmup settings do not count at kn <= base_batch_size, where rule 2 applies none).
Runs go to RUNS/<config>/<run name>/ and are skipped once they have a result.json; an
interrupted or preempted run resumes from its checkpoint, a failed one (e.g. diverged) is
recorded in failed.json and not retried unless --retry_failed. Rerunning the same command therefore
continues a sweep. Writes OUT/<name>.csv (one row per run), OUT/<name>.md (the paper's
metric, mean +- std over seeds, per grid point) and, with --plot or --curves, OUT/<name>.png.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from configs import overrides  # noqa: E402
from largebatch_jax import schedules  # noqa: E402
from largebatch_jax.metrics import read_metrics  # noqa: E402
from largebatch_jax.validate import ConfigError, validate_config, validate_fields  # noqa: E402

METRIC = "val_error_top1_median_last_epochs"
# `devices` is not a config field: the number of (fake CPU) devices a run uses, which
# may go in --grid / --set / --extra like a field (the invariance experiment).
DEFAULT_DEVICES = 8
# Where a spike is looked for: warmup's job is the first epochs (RESULTS.md, warmup_range).
SPIKE_EPOCHS = 2.0


class SweepError(ValueError):
    """Bad sweep arguments; one line."""


def load_config(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("sweep_config", ROOT / path)
    if spec is None or not (ROOT / path).exists():
        raise SweepError(f"--config={path} does not exist.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def parse_value(field: str, text: str, default: Any) -> Any:
    """`text` as the type of the config field's default (configs/overrides.py)."""
    try:
        return overrides.parse_value(field, text, default)
    except ValueError as e:
        raise SweepError(str(e)) from None


def parse_assignment(text: str, config: Any, many: bool) -> tuple[str, list[Any]]:
    if "=" not in text:
        raise SweepError(f"{text!r} must be FIELD=VALUE{',VALUE...' if many else ''}.")
    field, values = text.split("=", 1)
    if field != "devices" and field not in config:
        raise SweepError(f"{field!r} is not a config field (see configs/base.py).")
    default = DEFAULT_DEVICES if field == "devices" else config[field]
    parts = values.split(",") if many else [values]
    return field, [parse_value(field, v, default) for v in parts]


def parse_extra(text: str, config: Any) -> dict[str, Any]:
    """--extra=F=V,F=V: one more run, beyond the grid."""
    pairs = [parse_assignment(p, config, many=False) for p in text.split(",") if p]
    return {k: v[0] for k, v in pairs}


flag_value = overrides.flag_spelling


def run_name(overrides: dict[str, Any], defaults: Any, devices: int | None) -> str:
    """The overrides that change the config, sorted: the run's identity. `devices` is the
    sweep's device count: a run names its own only where it differs (the update does not
    depend on it: README, "The invariance promise"; `check_devices` keeps two counts
    from sharing a workdir)."""
    inert = set()
    if not schedules.warmup_applies(
        overrides.get("batch_size", defaults.batch_size),
        overrides.get("base_batch_size", defaults.base_batch_size),
    ):
        inert = {"warmup", "warmup_epochs"}  # no warmup at or below the base kn
    parts = [
        f"{k}={flag_value(v)}"
        for k, v in sorted(overrides.items())
        if k != "devices" and defaults[k] != v and k not in inert
    ]
    if overrides.get("devices", devices) != devices:
        parts.append(f"devices={overrides['devices']}")
    name = "-".join(parts) or "default"
    return re.sub(r"[^A-Za-z0-9=.,_+-]", "", name.replace("(", "").replace(")", ""))


def expand(grid: list[tuple[str, list[Any]]], fixed: dict[str, Any]) -> list[dict[str, Any]]:
    fields = [f for f, _ in grid]
    return [
        {**fixed, **dict(zip(fields, combo, strict=True))}
        for combo in itertools.product(*[values for _, values in grid])
    ]


def check_run(defaults: Any, overrides: dict[str, Any], devices: int | None, name: str) -> None:
    """A run's config through main.py's own validation, before any run of the sweep trains:
    a bad value stops the sweep with main's one line. Without fake devices (`devices`
    None) the device count is unknown here, so only what does not depend on it."""
    config = defaults.copy_and_resolve_references()
    for field, value in overrides.items():
        if field != "devices":
            config[field] = value
    devices = overrides.get("devices", devices)
    try:
        validate_config(config, devices) if devices else validate_fields(config)
    except ConfigError as e:
        raise SweepError(f"run {name}: {e}") from None


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


def check_devices(workdir: Path, devices: int | None, record_it: bool = True) -> None:
    """A workdir trains on one device count: record it, refuse another."""
    record = workdir / "devices.json"
    if record.exists():
        had = json.loads(record.read_text())["devices"]
        if had != devices:
            raise SweepError(
                f"{workdir} was trained on devices={had}, this sweep asks for {devices}: "
                f"rerun with --devices={had or 0} or use another --runs folder."
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


def collect(run: dict) -> dict:
    """One table row from a run's workdir."""
    workdir = Path(run["workdir"])
    row = {**run["values"], "run": workdir.name, "status": "pending"}
    if (workdir / "metrics.jsonl").exists():  # a diverged run's too: up to its last log
        row["loss_spike"] = loss_spike(read_metrics(workdir))
    if (workdir / "result.json").exists():
        result = json.loads((workdir / "result.json").read_text())
        epochs = [r for r in read_metrics(workdir) if "epoch_train_error" in r]
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
    elif (workdir / "failed.json").exists():
        row["status"] = json.loads((workdir / "failed.json").read_text())["status"]
    return row


def group_rows(rows: list[dict], fields: list[str]) -> list[dict]:
    """Mean +- std of the metric over seeds, per combination of the other grid fields."""
    keys = [f for f in fields if f != "seed"]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(flag_value(row[k]) for k in keys), []).append(row)
    out = []
    for key, members in sorted(groups.items(), key=lambda kv: [_order(v) for v in kv[0]]):
        done = [r for r in members if r["status"] == "done"]
        errors = np.array([r["error"] for r in done], dtype=float)
        train = np.array([r["train_error"] for r in done if r["train_error"] is not None])
        spikes = [r["loss_spike"] for r in members if r.get("loss_spike") is not None]
        out.append(
            {
                **dict(zip(keys, key, strict=True)),
                "runs": len(members),
                "done": len(done),
                "other": ", ".join(sorted({r["status"] for r in members} - {"done"})),
                "mean": float(errors.mean()) if len(errors) else None,
                "std": float(errors.std(ddof=1)) if len(errors) > 1 else None,
                "train_mean": float(train.mean()) if len(train) else None,
                "peak_lr": done[0]["peak_lr"] if done else None,
                "spike": max(spikes) if spikes else None,  # the worst seed's
                "seeds": [r.get("seed") for r in done],
            }
        )
    return out


def _order(value: str) -> tuple:
    """Numbers in numeric order, before words (kept in the order given)."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, "")


def pct(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def write_tables(name: str, out: Path, rows: list[dict], fields: list[str], command: str):
    out.mkdir(parents=True, exist_ok=True)
    columns = list(
        dict.fromkeys(
            [
                *fields,
                "run",
                "status",
                "error",
                "final_error",
                "train_error",
                "steps",
                "peak_lr",
                "loss_spike",
                "seconds",
            ]
        )
    )
    with (out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: flag_value(row.get(k, "")) for k in columns})
    grouped = group_rows(rows, fields)
    keys = [f for f in fields if f != "seed"]
    seconds = sum(r.get("seconds") or 0 for r in rows)
    lines = [
        f"# {name}",
        "",
        f"Command: `{command}`",
        "",
        f"Written {datetime.date.today().isoformat()}; {sum(r['status'] == 'done' for r in rows)}"
        f" of {len(rows)} runs done; {seconds / 60:.0f} min of training in total. Error = the "
        "paper's metric (median top-1 validation error of the evaluations in the last 5/90 "
        "of training), in %, mean +- std over seeds. Loss spike = the largest rise of the "
        f"logged training loss above its lowest value so far in the first {SPIKE_EPOCHS:g} "
        "epochs, the worst seed's (diverged runs: up to their last log).",
        "",
        "| "
        + " | ".join(
            [
                *keys,
                "peak lr",
                "top-1 error (%)",
                "seeds",
                "final train error (%)",
                "loss spike",
                "not done",
            ]
        )
        + " |",
        "|" + "---|" * (len(keys) + 6),
    ]
    for g in grouped:
        spread = f" +- {pct(g['std'])}" if g["std"] is not None else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    *[shown(g[k]) for k in keys],
                    "-" if g["peak_lr"] is None else f"{g['peak_lr']:.4g}",
                    f"{pct(g['mean'])}{spread}",
                    str(g["done"]),
                    pct(g["train_mean"]),
                    "-" if g["spike"] is None else f"{g['spike']:.2f}",
                    g["other"] or "",
                ]
            )
            + " |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return grouped


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
            train = [r for r in read_metrics(done[0]["workdir"]) if "train_error" in r]
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


def shown(value) -> str:
    """A field's value for a reader (tables, legends): 5/90 as 0.5556, not 17 digits.

    Takes a value or its flag spelling (grouped rows hold the spelling); the CSV keeps
    the exact value.
    """
    text = str(value)
    if isinstance(value, float) or (isinstance(value, str) and "." in value):
        try:
            return f"{float(value):.4g}"
        except ValueError:
            pass
    return text


def _label(keys: list[str], values: tuple) -> str:
    return ", ".join(f"{k}={shown(v)}" for k, v in zip(keys, values, strict=True)) or "runs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="table / figure file name")
    parser.add_argument("--config", required=True, help="config file, relative to the repo")
    parser.add_argument("--grid", action="append", default=[], help="FIELD=V1,V2,...")
    parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE for every run")
    parser.add_argument(
        "--extra", action="append", default=[], help="F=V,F=V: one more run beyond the grid"
    )
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (0: real ones)")
    parser.add_argument("--runs", default="experiments/runs", help="where run workdirs go")
    parser.add_argument("--out", default="experiments/results", help="where tables go")
    parser.add_argument("--plot", default=None, help="grid field for the x axis of a figure")
    parser.add_argument("--curves", action="store_true", help="draw training-error curves")
    parser.add_argument("--title", default="")
    parser.add_argument("--collect_only", action="store_true", help="tables from what exists")
    parser.add_argument("--retry_failed", action="store_true")
    parser.add_argument("--dry_run", action="store_true", help="list the runs, train nothing")
    args = parser.parse_args(argv)
    # The command that makes the table (not the flags that only read or list runs).
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(
        ["python", "experiments/sweep.py"]
        + [a for a in given if a not in ("--collect_only", "--dry_run")]
    )
    try:
        defaults = load_config(args.config)
        grid = [parse_assignment(g, defaults, many=True) for g in args.grid]
        fixed = dict(parse_assignment(s, defaults, many=False) for s in args.set)
        fixed = {k: v[0] for k, v in fixed.items()}
        extras = [parse_extra(e, defaults) for e in args.extra]
        if args.plot is not None and args.plot not in [f for f, _ in grid]:
            raise SweepError(f"--plot={args.plot} is not one of the --grid fields.")
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = args.devices or None
    fields = list(dict.fromkeys([f for f, _ in grid] + [k for e in extras for k in e]))
    root = ROOT / args.runs / Path(args.config).stem
    runs = [
        {"overrides": o, "workdir": str(root / run_name(o, defaults, devices))}
        for o in [*expand(grid, fixed), *({**fixed, **e} for e in extras)]
    ]
    for run in runs:  # table columns for fields a run does not set: the defaults
        run["values"] = {
            f: run["overrides"].get(f, devices if f == "devices" else defaults.get(f))
            for f in fields
        }
    began = time.time()
    try:
        for run in runs:
            check_run(defaults, run["overrides"], devices, Path(run["workdir"]).name)
        for run in runs:
            check_devices(
                Path(run["workdir"]),
                run["overrides"].get("devices", devices),
                record_it=not (args.dry_run or args.collect_only),
            )
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    preempted: list[str] = []
    for i, run in enumerate(runs, 1):
        workdir = Path(run["workdir"])
        if (workdir / "result.json").exists():
            state = "done"
        elif (workdir / "failed.json").exists() and not args.retry_failed:
            state = json.loads((workdir / "failed.json").read_text())["status"]
        elif args.dry_run or args.collect_only:
            state = "to run"
        else:
            (workdir / "failed.json").unlink(missing_ok=True)
            started = time.time()
            print(f"[{i}/{len(runs)}] {workdir.name}: training ...", flush=True)
            state = run_one(args.config, workdir, run["overrides"], devices)
            if state == "preempted":
                preempted.append(workdir.name)
                state += " (its checkpoint is saved: the same command resumes it)"
            state += f" in {time.time() - started:.0f} s"
        print(f"[{i}/{len(runs)}] {workdir.name}: {state}", flush=True)
    if args.dry_run:
        return 0
    rows = [{**collect(r), "workdir": r["workdir"]} for r in runs]
    out = ROOT / args.out
    write_tables(args.name, out, rows, fields, command)
    print(f"tables: {out / args.name}.md, .csv ({time.time() - began:.0f} s)")
    if args.plot or args.curves:
        path = plot(
            args.name,
            out,
            rows,
            fields,
            args.plot,
            args.curves,
            args.title,
            defaults.base_batch_size,
        )
        print(f"figure: {path}")
    # A diverged run is a result (Table 1's "no warmup" can diverge); a crash is not, nor
    # is a run still to finish (preempted: the same command resumes it).
    return 1 if preempted or any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
