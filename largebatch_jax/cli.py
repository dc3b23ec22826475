"""What main.py does around a run: a stop before the first step or after the last, its
flags, joining a multi-process run, starting JAX's backend, the compilation cache, and
the lines a run ends with. Importing it imports neither JAX nor absl and changes nothing;
main.py calls each part in its order."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from largebatch_jax import errors, host, private


def stop_outside_the_loop() -> None:
    """SIGTERM, SIGHUP and SIGINT before the first step or after the last (the loop
    handles its own) end the process at once with one line, from the first import on."""
    signal.signal(signal.SIGTERM, _stopped_outside_the_loop)
    signal.signal(signal.SIGHUP, _stopped_outside_the_loop)
    signal.signal(signal.SIGINT, _interrupted_outside_the_loop)


def _stopped_outside_the_loop(signum, frame):
    """SIGTERM or SIGHUP: no step is lost, so one line and exit 0, as for a preemption
    inside the loop. The process exits at once, its workdir lock released: an exception
    raised here can land in code that swallows it (a __del__) and the run would go on."""
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
    """Ctrl-C (the loop defers its own to the end of the step): one line and exit 130,
    instead of a traceback from wherever start-up was (an import, the data, a compile)."""
    del signum, frame
    from largebatch_jax import lock

    host.write_stderr(
        "interrupted (SIGINT) before the first step or after the last: nothing is lost; "
        "rerun the same command to go on\n"
    )
    lock.release_held()
    os._exit(130)


def before_jax() -> None:
    """On a host without GPU or TPU, JAX starts no accelerator plugin; the native logs'
    INFO lines are off (largebatch_jax.host). Before JAX loads."""
    host.choose_platforms()
    host.quiet_native_logs()


@dataclasses.dataclass(frozen=True)
class Flags:
    """main.py's flags (absl FlagHolders)."""

    config: Any
    workdir: Any
    distributed: Any
    cluster: Any
    coordinator_address: Any
    num_processes: Any
    process_id: Any
    heartbeat_timeout_seconds: Any
    initialization_timeout_seconds: Any


def define_flags() -> Flags:
    """Define main.py's flags (absl's global flag registry: the entry point calls this)."""
    from absl import flags
    from ml_collections import config_flags

    from largebatch_jax import cluster

    holders = Flags(
        config=config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True),
        workdir=flags.DEFINE_string(
            "workdir", None, "Directory for checkpoints, logs and results."
        ),
        distributed=flags.DEFINE_enum(
            "distributed",
            "auto",
            cluster.MODES,
            "Multi-process runs through jax.distributed: 'auto' joins one when a flag below "
            "is given or the environment is a multi-task SLURM step, an MPI job or a "
            "multi-host Cloud TPU slice; 'on' always calls jax.distributed.initialize() "
            "(JAX detects the rest); 'off' never.",
        ),
        cluster=flags.DEFINE_enum(
            "cluster",
            "auto",
            cluster.CLUSTERS,
            "Whose variables name the processes: 'auto' reads SLURM's, Open MPI 4's and a "
            "Cloud TPU slice's, and asks MPI itself through mpi4py where an MPI sets no "
            "variable JAX reads (Open MPI 5, MPICH); or force one of JAX's detections.",
        ),
        coordinator_address=flags.DEFINE_string(
            "coordinator_address",
            None,
            "host:port of process 0, where JAX cannot detect the cluster.",
        ),
        num_processes=flags.DEFINE_integer(
            "num_processes", None, "Processes in the run.", lower_bound=1
        ),
        process_id=flags.DEFINE_integer("process_id", None, "This process's index.", lower_bound=0),
        heartbeat_timeout_seconds=flags.DEFINE_integer(
            "heartbeat_timeout_seconds",
            60,
            "A process silent this long is declared dead and the others stop with an error.",
            lower_bound=1,
        ),
        initialization_timeout_seconds=flags.DEFINE_integer(
            "initialization_timeout_seconds",
            300,
            "How long the processes wait for each other to start before they stop with an error.",
            lower_bound=1,
        ),
    )
    flags.mark_flags_as_required(["config", "workdir"])
    flags.register_validator(
        "coordinator_address",
        lambda address: address is None or cluster.valid_address(address),
        "must be HOST:PORT with a port from 1 to 65535, e.g. node001:1234",
    )
    return holders


def parse_flags(argv: list[str], holders: Flags) -> list[str]:
    """absl's flag parsing, with a bad config file or field as one line and exit 2 (the
    config is loaded here, not at first use, so its errors come out here too)."""
    from absl import flags

    from largebatch_jax.flag_errors import config_error, flag_error
    from largebatch_jax.validate import check_known_fields

    try:
        rest = flags.FLAGS(argv)
        holders.config.value.to_dict()  # a config that failed to load raises at first use
        check_known_fields(holders.config.value)  # a typo in a config file, as on the command line
        return rest
    except errors.ConfigError as e:
        message = str(e)
    except flags.Error as e:
        message = flag_error(str(e))
    except Exception as e:  # whatever a config file or an override raises
        message = config_error(e, argv)
    errors.fail(message, 2)


def stop(error: object, code: int) -> NoReturn:
    """One `error:` line and the exit code (the table in docs/faults.md), at once: Python's
    exit handlers run (JAX's clean-up), but nothing waits for the threads of libraries,
    which a save cut by the fault can leave waiting (orbax's signalling threads: up to
    its 300 s coordination timeout, on a file system gone read-only)."""
    errors.print_error(error)
    private.run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join(holders: Flags) -> Any:
    """Join the multi-process run this process belongs to, if any (cluster.py): its
    `cluster.Joined`, or None for a run of one process."""
    from largebatch_jax import cluster

    def not_joined() -> None:
        """The processes have not all joined in time: one line and exit 2, from the
        thread that waited (the main thread is blocked inside JAX, which would abort
        later). Nothing to clean up yet: no workdir is touched before they join."""
        print(
            f"error: the {holders.num_processes.value or ''} processes did not all join the "
            f"run at {holders.coordinator_address.value or 'the cluster coordinator'} within "
            f"{holders.initialization_timeout_seconds.value} s: start every process with the "
            "same --coordinator_address and --num_processes and its own --process_id, or "
            "give them longer with --initialization_timeout_seconds.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)

    return cluster.initialize_distributed(
        holders.distributed.value,
        holders.coordinator_address.value,
        holders.num_processes.value,
        holders.process_id.value,
        holders.cluster.value,
        heartbeat_timeout_seconds=holders.heartbeat_timeout_seconds.value,
        initialization_timeout_seconds=holders.initialization_timeout_seconds.value,
        on_join_timeout=not_joined,
    )


def rank(holders: Flags) -> int:
    """This process's index in its run before the run is joined: the flag, or what its
    launcher says (0 where nothing says)."""
    from largebatch_jax import cluster

    if holders.process_id.value is not None:
        return holders.process_id.value
    try:
        launch = cluster.detect(cluster=holders.cluster.value)
    except ValueError:
        return 0
    return (launch.process_id or 0) if launch is not None else 0


def start_backend(config: Any, workdir: Path, joined: Any, heartbeat_seconds: int) -> None:
    """Start JAX's backend; in a run of several processes, filter the console (gloo's
    lines, JAX's abort on a lost process: console.py); stop in one line where a GPU given
    to this process is idle; warn where an ImageNet-size run is about to train on CPU."""
    import jax

    from largebatch_jax import cluster, console

    with host.plugin_noise_filtered():
        devices = jax.devices()
    if joined is not None:
        console.start(1, f"--drop={console.GLOO_NOISE.pattern}")
        console.start(
            2,
            f"--rank={jax.process_index()}",
            f"--checkpoints={workdir / 'checkpoints'}",
            f"--heartbeat={heartbeat_seconds}",
        )
    platform = devices[0].platform
    unused = cluster.check_gpus_used(
        platform, jax.local_device_count(), cluster.cuda_plugin_gpus(), joined, jax.process_index()
    )
    if unused:
        stop(unused, 2)
    warning = host.cpu_only_warning(
        platform, len(devices), config.model, config.image_size, host.visible_accelerators()
    )
    if warning and jax.process_index() == 0:
        print(warning, file=sys.stderr, flush=True)


def compilation_cache(enabled: bool, workdir: Path) -> None:
    """JAX's persistent compilation cache: where JAX_COMPILATION_CACHE_DIR says, else in
    WORKDIR/compilation_cache, so that a resumed or requeued run of the same command loads
    its programs instead of compiling them again (process 0 writes, every process reads);
    off with config.compilation_cache=False."""
    import jax

    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
    elif not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(workdir / "compilation_cache"))


def final_line(result: dict, workdir: Path) -> str:
    """The line a run ends with: preempted with its checkpoint, or done with its result."""
    from largebatch_jax.train import result as run_result

    if "preempted" in result:
        return (
            f"preempted: checkpoint saved at step {result['preempted']} in "
            f"{result['checkpoints']}; rerun the same command to resume"
        )
    return (
        f"{run_result.summary(result)}; results in {workdir}/result.json; curves: "
        f"tensorboard --logdir {workdir}, or python -m largebatch_jax.plot {workdir}"
    )


_UNRAISABLE_SEEN: set[str] = set()


def unraisable_in_one_line(unraisable: sys.UnraisableHookArgs) -> None:
    """Exceptions that no code can catch (raised in callbacks on C++ threads: tensorstore's,
    dozens of them when orbax stops a save on a full disk) as one log line per distinct
    message instead of a traceback each; the error that stopped the run is reported by
    the main thread."""
    from absl import logging

    error = unraisable.exc_value
    what = f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0]
    if what not in _UNRAISABLE_SEEN:
        _UNRAISABLE_SEEN.add(what)
        logging.warning("ignored an exception in a background callback: %s", what)
