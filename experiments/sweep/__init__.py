"""Run a grid of configs, one workdir per run, and collect the results into tables and
a figure.

    python -m experiments.sweep --name=fig1 --config=configs/fashion_sweep.py \
        --grid=seed=0,1 --grid=warmup=gradual,none \
        --grid=batch_size=256,512,1024,2048,4096,8192 --plot=batch_size

`--grid=FIELD=V1,V2,...` (repeatable; the first is the outermost loop, runs go in grid
order) and `--set=FIELD=V` (every run) override config fields; values are parsed with the
type of the field's default (tuples as `(a;b)` or `a;b`). A run is named by its overrides
that differ from the config's defaults, so two sweeps asking for the same run share it
(warmup settings do not count at kn <= base_batch_size, where rule 2 applies none).
Runs train in RUNS/<config>/<run name>/ (checkpoints included); an interrupted or preempted
run resumes from its checkpoint, a failed one (e.g. diverged) is recorded in failed.json and
not retried unless --retry_failed. A finished run's record (result.json or failed.json,
metrics.jsonl, run_config.json, devices.json, log.txt) is packed into the archive,
ARCHIVE = OUT/<config>.tar.xz unless --archive says otherwise (archive.py), and a run in
the archive or with a result.json in its workdir is skipped. Rerunning the same command
therefore continues a sweep. From the archive it writes OUT/<name>.csv (one row per run),
OUT/<name>.md (the paper's metric, mean +- std over seeds, per grid point) and, with --plot
or --curves, OUT/<name>.png; --collect_only trains nothing and needs no workdir.
"""

from largebatch_jax import host

# The package is the command's first import (python -m experiments.sweep), and it imports
# jax: what the accelerator plugins print while loading on a CPU host is dropped.
with host.plugin_noise_filtered():
    from experiments.sweep.grid import (
        SweepError,
        check_run,
        load_config,
        parse_assignment,
        parse_value,
        run_name,
    )
    from experiments.sweep.runs import check_devices, collect, loss_spike, run_one
    from experiments.sweep.tables import group_rows, shown, write_tables

__all__ = [
    "SweepError",
    "check_devices",
    "check_run",
    "collect",
    "group_rows",
    "load_config",
    "loss_spike",
    "main",
    "parse_assignment",
    "parse_value",
    "run_name",
    "run_one",
    "shown",
    "write_tables",
]


def main(argv: list[str] | None = None) -> int:
    from experiments.sweep.cli import main as cli_main  # cli reads this package's docstring

    return cli_main(argv)
