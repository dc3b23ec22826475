"""Train and evaluate one run of the paper's recipe.

    python main.py --config=configs/imagenet_8k.py --workdir=/tmp/rn50_8k
    python main.py --config=configs/imagenet.py:batch_size=8192,warmup=constant --workdir=...
    python main.py --config=configs/fashion_mnist.py --workdir=/tmp/fmnist --config.batch_size=1024

Any field can be overridden with --config.FIELD=VALUE. Rerunning the same command resumes
from the newest checkpoint in the workdir; rerunning a finished run prints its result at
once. Under SLURM, MPI or on a Cloud TPU slice every process runs the same command
(docs/many_machines.md). Exit codes (docs/faults.md): 0 done, or preempted by SIGTERM with
a checkpoint saved; 1 a failed run (e.g. NaN loss); 2 bad config / data / workdir (also a
full disk, a workdir in use); 75 another process of the run is gone; 130 SIGINT; 134
JAX's abort of a multi-process run (a process silent past the heartbeat: dead, or the
whole job paused).
"""

import atexit
import os
import re
import signal
import sys
from pathlib import Path
from typing import NoReturn


def _stopped_outside_the_loop(signum, frame):
    """SIGTERM or SIGHUP before the first step or after the last (the loop handles its own): no
    step is lost, so one line and exit 0, as for a preemption inside the loop. The
    process exits at once, its workdir lock released: an exception raised here can land
    in code that swallows it (a __del__) and the run would go on."""
    del frame
    from largebatch_jax import lock

    print(
        f"preempted ({signal.Signals(signum).name}) before the first step or after the last: "
        "nothing is lost; rerun the same command to go on",
        flush=True,
    )
    lock.release_held()
    os._exit(0)


def _interrupted_outside_the_loop(signum, frame):
    """Ctrl-C before the first step or after the last (the loop defers its own to the end
    of the step): one line and exit 130, instead of a traceback from wherever start-up
    was (an import, the data, a compile)."""
    del signum, frame
    from largebatch_jax import host, lock

    host.write_stderr(
        "interrupted (SIGINT) before the first step or after the last: nothing is lost; "
        "rerun the same command to go on\n"
    )
    lock.release_held()
    os._exit(130)


signal.signal(signal.SIGTERM, _stopped_outside_the_loop)
signal.signal(signal.SIGHUP, _stopped_outside_the_loop)
signal.signal(signal.SIGINT, _interrupted_outside_the_loop)

from largebatch_jax import errors, host  # noqa: E402

# Before JAX loads: on a host without GPU or TPU, JAX starts no accelerator plugin, and
# what the installed plugins print while loading is filtered out (largebatch_jax.host).
host.choose_platforms()
host.quiet_native_logs()
with host.plugin_noise_filtered():
    import jax
    from absl import app, flags, logging
    from ml_collections import config_flags

    from largebatch_jax import cluster, console, exact, train
    from largebatch_jax import workdir as wd
    from largebatch_jax.data.loader import UnreadableImageError
    from largebatch_jax.data.sources import DatasetNotPreparedError
    from largebatch_jax.fields import FIELDS
    from largebatch_jax.metrics import filter_library_logs
    from largebatch_jax.validate import ConfigError, check_known_fields, unknown_field

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    cluster.MODES,
    "Multi-process runs through jax.distributed: 'auto' joins one when a flag below is "
    "given or the environment is a multi-task SLURM step, an MPI job or a multi-host "
    "Cloud TPU slice; 'on' always calls jax.distributed.initialize() (JAX detects the "
    "rest); 'off' never.",
)
_CLUSTER = flags.DEFINE_enum(
    "cluster",
    "auto",
    cluster.CLUSTERS,
    "Whose variables name the processes: 'auto' reads SLURM's, Open MPI 4's and a Cloud "
    "TPU slice's, and asks MPI itself through mpi4py where an MPI sets no variable JAX "
    "reads (Open MPI 5, MPICH); or force one of JAX's detections.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, where JAX cannot detect the cluster."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.", lower_bound=0)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds",
    60,
    "A process silent this long is declared dead and the others stop with an error.",
    lower_bound=1,
)
_JOIN_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout_seconds",
    300,
    "How long the processes wait for each other to start before they stop with an error.",
    lower_bound=1,
)
flags.mark_flags_as_required(["config", "workdir"])
flags.register_validator(
    "coordinator_address",
    lambda address: address is None or cluster.valid_address(address),
    "must be HOST:PORT with a port from 1 to 65535, e.g. node001:1234",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if config.reduction == "exact":
        exact.fix_cpu_threads()  # before the backend starts
    filter_library_logs()
    try:
        workdir = wd.resolve(_WORKDIR.value)
        done = train.result.finished_in(workdir, config)
        joined = None if done is not None else _join()
    except (ValueError, wd.WorkdirError) as e:
        _stop(e, 2)
    if done is not None:  # at once: no backend, no waiting for the other processes
        if _rank() == 0:
            print(_done_line(done, workdir), flush=True)
        return
    _start_backend(config, workdir, joined)
    _compilation_cache(config.compilation_cache, workdir)
    try:
        result = train.train_and_evaluate(config, workdir)
    except (ConfigError, DatasetNotPreparedError, UnreadableImageError, wd.WorkdirError) as e:
        _stop(e, 2)
    except train.NonFiniteLossError as e:
        _stop(e, 1)
    except train.RunInterruptedError as e:
        _stop(e, 130)
    if jax.process_index() != 0:
        return
    if "preempted" in result:
        print(
            f"preempted: checkpoint saved at step {result['preempted']} in "
            f"{result['checkpoints']}; rerun the same command to resume",
            flush=True,
        )
    else:
        print(_done_line(result, workdir), flush=True)


def _done_line(result: dict, workdir: Path) -> str:
    return (
        f"{train.result.summary(result)}; results in {workdir}/result.json; curves: "
        f"tensorboard --logdir {workdir}, or python -m largebatch_jax.plot {workdir}"
    )


def _stop(error: object, code: int) -> NoReturn:
    """One `error:` line and the exit code (the table in docs/faults.md), at once: Python's
    exit handlers run (JAX's clean-up), but nothing waits for the threads of libraries,
    which a save cut by the fault can leave waiting (orbax's signalling threads: up to
    its 300 s coordination timeout, on a file system gone read-only)."""
    errors.print_error(error)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _join() -> "cluster.Joined | None":
    """Join the multi-process run this process belongs to, if any (cluster.py)."""
    return cluster.initialize_distributed(
        _DISTRIBUTED.value,
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        _CLUSTER.value,
        heartbeat_timeout_seconds=_HEARTBEAT.value,
        initialization_timeout_seconds=_JOIN_TIMEOUT.value,
        on_join_timeout=_not_joined,
    )


def _start_backend(config, workdir: Path, joined: "cluster.Joined | None") -> None:
    """Start JAX's backend; in a run of several processes, filter the console (gloo's
    lines, JAX's abort on a lost process: console.py); stop in one line where a GPU given
    to this process is idle; warn where an ImageNet-size run is about to train on CPU."""
    with host.plugin_noise_filtered():
        devices = jax.devices()
    if joined is not None:
        console.start(1, f"--drop={console.GLOO_NOISE.pattern}")
        console.start(
            2,
            f"--rank={jax.process_index()}",
            f"--checkpoints={workdir / 'checkpoints'}",
            f"--heartbeat={_HEARTBEAT.value}",
        )
    platform = devices[0].platform
    unused = cluster.check_gpus_used(
        platform, jax.local_device_count(), cluster.cuda_plugin_gpus(), joined, jax.process_index()
    )
    if unused:
        _stop(unused, 2)
    warning = host.cpu_only_warning(
        platform, len(devices), config.model, config.image_size, host.visible_accelerators()
    )
    if warning and jax.process_index() == 0:
        print(warning, file=sys.stderr, flush=True)


def _compilation_cache(enabled: bool, workdir: Path) -> None:
    """JAX's persistent compilation cache: where JAX_COMPILATION_CACHE_DIR says, else in
    WORKDIR/compilation_cache, so that a resumed or requeued run of the same command loads
    its programs instead of compiling them again (process 0 writes, every process reads);
    off with config.compilation_cache=False."""
    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
    elif not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(workdir / "compilation_cache"))


def _rank() -> int:
    """This process's index in its run before the run is joined: the flag, or what its
    launcher says (0 where nothing says)."""
    if _PROCESS_ID.value is not None:
        return _PROCESS_ID.value
    try:
        launch = cluster.detect(cluster=_CLUSTER.value)
    except ValueError:
        return 0
    return (launch.process_id or 0) if launch is not None else 0


def _not_joined() -> None:
    """The processes have not all joined in time: one line and exit 2, from the thread
    that waited (the main thread is blocked inside JAX, which would abort later)."""
    print(
        f"error: the {_NUM_PROCESSES.value or ''} processes did not all join the run at "
        f"{_COORDINATOR.value or 'the cluster coordinator'} within {_JOIN_TIMEOUT.value} s: "
        "start every process with the same --coordinator_address and --num_processes and "
        "its own --process_id, or give them longer with --initialization_timeout_seconds.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(2)  # nothing to clean up yet: no workdir is touched before the processes join


def config_error(error: BaseException, argv: list[str]) -> str:
    """One line for what loading --config or applying --config.FIELD raised."""
    text = str(error).strip().strip("'\"").replace("\\n", "\n")
    # ml_collections words it either way, by version and code path.
    typo = re.search(r"'(\w+)'.*?Did you mean \"(\w+)\"", text, re.S)
    field = typo[1] if typo else None
    if typo is None:
        typo = re.search(r"Did you mean \"(\w+)\" instead of \"(\w+)\"", text)
        field = typo[2] if typo else None
    if isinstance(error, AttributeError | KeyError) and field:
        return unknown_field(field, "--config.")
    if isinstance(error, AttributeError | KeyError):  # no near field for ml_collections
        unknown = [f for a in argv if (f := _overridden(a)) and f not in FIELDS]
        if unknown:
            return unknown_field(unknown[0], "--config.")
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is not None and "has no attribute 'get_config" in text:
        return (
            f"--config={spec}: the file defines no get_config(): a config file returns its "
            "ConfigDict from get_config(), as configs/smoke.py does."
        )
    if spec is not None:
        path = Path(spec.split(":", 1)[0])
        if not path.is_file():
            return f"--config={spec}: no such config file {str(path)!r}."
        try:
            source = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"--config={spec}: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                f"{e.start}; UTF-16?): save it as UTF-8."
            )
        if "\x00" in source:
            return f"--config={spec}: {path} holds NUL bytes: save it as UTF-8 text."
        try:
            compile(source, str(path), "exec")
        except SyntaxError as e:
            return f"--config={spec}: syntax error in {path} line {e.lineno}: {e.msg}."
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def _overridden(arg: str) -> str | None:
    """The field an argument `--config.FIELD[.SUB]=VALUE` sets, or None."""
    match = re.match(r"--config\.(\w+)", arg)
    return match[1] if match else None


def flag_error(text: str) -> str:
    """absl's flag error in one line; for a config file that failed, with its reason (the
    last line of the traceback absl puts under it)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if len(lines) < 2 or "parsing config file" not in lines[0]:
        return lines[0] if lines else text
    reason = lines[-1]
    if "get_config() takes 0 positional arguments" in reason:
        reason = "this config file takes no FIELD=VALUE after ':'; use --config.FIELD=VALUE"
    return f"{lines[0].removesuffix(':').replace('Error whilst parsing', 'cannot parse')}: {reason}"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad config file or field as one line and exit 2 (the
    config is loaded here, not at first use, so its errors come out here too)."""
    try:
        rest = flags.FLAGS(argv)
        _CONFIG.value.to_dict()  # a config that failed to load raises at first use
        check_known_fields(_CONFIG.value)  # a typo in a config file, as on the command line
        return rest
    except ConfigError as e:
        message = str(e)
    except flags.Error as e:
        message = flag_error(str(e))
    except Exception as e:  # whatever a config file or an override raises
        message = config_error(e, argv)
    errors.fail(message, 2)


_UNRAISABLE_SEEN: set[str] = set()


def unraisable_in_one_line(unraisable: "sys.UnraisableHookArgs") -> None:
    """Exceptions that no code can catch (raised in callbacks on C++ threads: tensorstore's,
    dozens of them when orbax stops a save on a full disk) as one log line per distinct
    message instead of a traceback each; the error that stopped the run is reported by
    the main thread."""
    error = unraisable.exc_value
    what = f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0]
    if what not in _UNRAISABLE_SEEN:
        _UNRAISABLE_SEEN.add(what)
        logging.warning("ignored an exception in a background callback: %s", what)


if __name__ == "__main__":
    sys.unraisablehook = unraisable_in_one_line
    app.run(main, flags_parser=parse_flags)
