"""Helpers for the end-to-end tests: run `main.py` (one process x 8 CPU devices) or the
local launcher (N processes) in subprocesses, and read what a run left in its workdir."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "largebatch_jax.launch"]


# The smoke config made 64 steps long, an evaluation per epoch: the tests' uninterrupted
# reference run (conftest's `straight`) and the runs they interrupt.
LONGER = (
    "--config.num_epochs=4.0",
    "--config.decay_epochs=(2.0,3.0)",
    "--config.eval_every_epochs=1.0",
)


def env(**extra):
    """The tests' environment for a run; an `extra` value of None removes that variable
    (JAX_PLATFORMS=None: main.py chooses the platform as it does for a user)."""
    values = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        # A run starts without the TPU compile settings conftest gives the pytest processes.
        "TPU_SKIP_MDS_QUERY": None,
        "ALLOW_MULTIPLE_LIBTPU_LOAD": None,
        **extra,
    }
    return {k: v for k, v in values.items() if v is not None}


# What libtpu, the CUDA plugin and JAX's backend start print on a host without them.
PLUGIN_LINE = re.compile(
    r"cudart_stub|cuda drivers|\bCUDA\b|libtpu|TPU_|\bTPU\b|jax_plugins|Unable to initialize"
    r" backend|absl::InitializeLog|InitGoogle|oneDNN|Source Location Trace"
)


# A log line of the project's own (absl's format, from one of its modules).
PROJECT_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ (\w+)\.py:\d+\] ")
PROJECT_MODULES = {p.stem for p in ROOT.glob("largebatch_jax/**/*.py")} | {"main"}


def foreign_lines(text: str) -> list[str]:
    """The lines of a run's (or a prepare's) output that are not the project's: its log
    lines, `error:`, `warning:`, `done`, `preempted`, `preparing`, `prepared` lines."""
    own = ("error: ", "warning: ", "done", "preempted", "preparing ", "prepared ")
    return [
        x
        for x in text.splitlines()
        if not x.startswith(own) and not ((m := PROJECT_LINE.match(x)) and m[1] in PROJECT_MODULES)
    ]


def command(workdir, data_dir, *overrides, config="configs/smoke.py", processes=0, devices=8):
    """`main.py` with a config and overrides; through the launcher when processes > 0."""
    main = [
        "main.py",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *overrides,
    ]
    if processes:
        return [
            *LAUNCH,
            f"--processes={processes}",
            f"--devices_per_process={devices}",
            "--",
            *main,
        ]
    return [sys.executable, *main]


def call(args, timeout=300, environ=None):
    """A command from the repository root with the tests' environment (or `environ`), its
    output captured as text."""
    return subprocess.run(
        args,
        cwd=ROOT,
        env=env() if environ is None else environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run(workdir, data_dir, *overrides, timeout=300, extra_env=None, **kwargs):
    """`main.py` (see `command`) to its end."""
    return call(command(workdir, data_dir, *overrides, **kwargs), timeout, env(**(extra_env or {})))


def start(workdir, data_dir, *overrides, extra_env=None, **kwargs):
    return subprocess.Popen(
        command(workdir, data_dir, *overrides, **kwargs),
        cwd=ROOT,
        env=env(**(extra_env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(workdir):
    return json.loads((Path(workdir) / "result.json").read_text())


def checkpoint_steps(workdir):
    folder = Path(workdir) / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []
    )


def wait_for_checkpoint(proc, workdir, step, timeout=240):
    """Return once a checkpoint >= `step` exists in `workdir`; fail if `proc` ends first."""
    _wait(
        proc,
        lambda: any(s >= step for s in checkpoint_steps(workdir)),
        f"checkpoint {step}",
        timeout,
    )


def metrics_size(workdir) -> int:
    path = Path(workdir) / "metrics.jsonl"
    return path.stat().st_size if path.exists() else 0


def wait_for_logged_step(proc, workdir, step, since=0, timeout=240):
    """Return once metrics.jsonl (append-only) has a row past `step` written after its
    first `since` bytes (by a rerun, not by the run it resumes)."""

    def logged():
        path = Path(workdir) / "metrics.jsonl"
        new = path.read_bytes()[since:].decode().splitlines() if path.exists() else []
        return any(json.loads(x)["step"] > step for x in new if x.endswith("}"))

    _wait(proc, logged, f"a new metrics row past step {step}", timeout)


def _wait(proc, done, what, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if done():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {what}: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("error:")]


def without_timing(rows):
    """metrics.jsonl rows without the figures that time the run (they differ from run to
    run; every other value is the same bits)."""
    from largebatch_jax.train.reporting import TIMING_SCALARS

    return [{k: v for k, v in r.items() if k not in TIMING_SCALARS} for r in rows]


def final_state(workdir, step=None):
    """The newest checkpoint's (or that of `step`) train state, on one device of this
    process (whatever processes and devices saved it)."""
    import jax
    import orbax.checkpoint as ocp

    step = max(checkpoint_steps(workdir)) if step is None else step
    path = Path(workdir, "checkpoints", str(step), "state")
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
        checkpointer.metadata(path).item_metadata,
    )
    return checkpointer.restore(path, target)


def prepare_with_a_bad_record(root: Path, data_dir: Path, name: str, bad: str) -> None:
    """Prepares image_folder/`name` from `root` holding the undecodable image `bad` (as
    one prepared before prepare checked images, or a file that changed between the scan
    and the copy): the scan's check is bypassed."""
    from largebatch_jax.data import folder

    found = folder.scan(root)
    split = "train" if bad.startswith("train/") else "validation"
    found.files[split].append(bad)
    folder.builder(found, name, str(data_dir)).download_and_prepare()
