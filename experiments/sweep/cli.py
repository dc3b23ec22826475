"""The sweep's command line (`python -m experiments.sweep`): parse, check every run, train
the ones not done, pack the finished ones into the archive, write the tables and the
figure from it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import experiments.sweep as package
from experiments.sweep import archive
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
    parser.add_argument(
        "--archive", default=None, help="the finished runs (default: OUT/<config name>.tar.xz)"
    )
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


def _train(args, runs: list[dict], devices: int | None, archived: Path) -> list[str]:
    """Train every run not done (or list them); returns the preempted ones. `archived`:
    the opened archive, whose runs count as done (or failed) like the workdirs'."""
    preempted: list[str] = []
    for i, run in enumerate(runs, 1):
        workdir = Path(run["workdir"])
        kept = archived / workdir.name
        if (workdir / "result.json").exists():
            state = "done"
        elif (kept / "result.json").exists():
            state = "done (archived)"
        elif (workdir / "failed.json").exists() and not args.retry_failed:
            state = json.loads((workdir / "failed.json").read_text())["status"]
        elif (kept / "failed.json").exists() and not args.retry_failed:
            state = json.loads((kept / "failed.json").read_text())["status"] + " (archived)"
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
    # The command that makes the table: not the flags that only read or list runs, nor
    # those that say where the files are (the same runs make the same table anywhere).
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "experiments.sweep", *_what(given)])
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
    out = ROOT / args.out
    path = ROOT / (args.archive or Path(args.out) / f"{Path(args.config).stem}.tar.xz")
    began = time.time()
    with archive.opened(path) as archived:
        try:
            for run in runs:
                check_run(defaults, run["overrides"], devices, Path(run["workdir"]).name)
            for run in runs:
                workdir, kept = Path(run["workdir"]), archived / Path(run["workdir"]).name
                run_devices = run["overrides"].get("devices", devices)
                check_devices(kept, run_devices, record_it=False, archive=path)
                check_devices(
                    workdir,
                    run_devices,
                    record_it=not (args.dry_run or args.collect_only or archive.finished(kept)),
                )
        except SweepError as e:
            errors.print_error(e)
            return 2
        preempted = _train(args, runs, devices, archived)
        if args.dry_run:
            return 0
        for run in runs:
            if archive.finished(Path(run["workdir"])):
                archive.add(archived, Path(run["workdir"]))
        if archive.save(path, archived):
            print(f"archive: {path}")
        return _report(args, defaults, runs, fields, archived, out, command, began, preempted)


def _report(args, defaults, runs, fields, archived, out, command, began, preempted) -> int:
    """The tables and the figure, from the archive (a run not in it: its workdir)."""
    rows = []
    for run in runs:
        kept = archived / Path(run["workdir"]).name
        files = kept if kept.exists() else Path(run["workdir"])
        rows.append({**collect(run, files), "files": str(files)})
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


def _what(given: list[str]) -> list[str]:
    """The arguments without --collect_only, --dry_run, --runs, --out and --archive."""
    kept, skip = [], False
    for arg in given:
        if skip:
            skip = False
        elif arg in ("--runs", "--out", "--archive"):
            skip = True  # its value is the next argument
        elif arg not in ("--collect_only", "--dry_run") and not arg.startswith(
            ("--runs=", "--out=", "--archive=")
        ):
            kept.append(arg)
    return kept
