"""The sweep's command line (`python -m experiments.sweep`): parse, check every run, train
the ones not done, write the tables and the figure."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import experiments.sweep as package
from experiments.sweep.figures import plot
from experiments.sweep.grid import (
    ROOT,
    SweepError,
    check_run,
    expand,
    load_config,
    parse_assignment,
    parse_extra,
    run_name,
)
from experiments.sweep.runs import check_devices, collect, run_one
from experiments.sweep.tables import write_tables
from largebatch_jax import errors


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.sweep", description=package.__doc__.split("\n\n")[0]
    )
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
    return parser


def _plan(args, defaults, grid, fixed, extras, devices) -> tuple[list[str], list[dict]]:
    """The table's fields, and every run: its overrides, workdir and table values."""
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
    return fields, runs


def _train(args, runs: list[dict], devices: int | None) -> list[str]:
    """Train every run not done (or list them); returns the preempted ones."""
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
    return preempted


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The command that makes the table (not the flags that only read or list runs).
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(
        ["python", "-m", "experiments.sweep"]
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
        errors.print_error(e)
        return 2
    devices = args.devices or None
    fields, runs = _plan(args, defaults, grid, fixed, extras, devices)
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
        errors.print_error(e)
        return 2
    preempted = _train(args, runs, devices)
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
