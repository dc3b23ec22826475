"""Joining a multi-process run: which launcher started this process, which of its host's
GPUs are its own, `jax.distributed.initialize` with them, and the checks after the start
(every process runs the same thing; a process drives every GPU it was given).

Launchers: SLURM (`srun`), Open MPI 4 (`mpirun`), MPIs that set no variable JAX reads
(Open MPI 5, MPICH, Intel MPI: found through mpi4py), a Cloud TPU slice, or the flags.
Left to itself under SLURM or Open MPI, JAX restricts each process to the GPU numbered
by its local rank (`local_device_ids=[local rank]`): one process per node then drives GPU
0 of 8, and a task bound to its own GPU (`--gpus-per-task=1`: CUDA_VISIBLE_DEVICES holds
its one id, so the GPU is number 0 to it) asks for a GPU it cannot see. `local_devices`
gives each process its share instead. Reading the environment imports no JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from largebatch_jax import private
from largebatch_jax.errors import LaunchError

MODES = ("auto", "on", "off")
# JAX's names of the cluster detections main.py's --cluster can force ('auto': ours).
CLUSTERS = ("auto", "slurm", "ompi", "mpi4py")

# What to tell a user whose processes cannot be given their GPUs evenly.
LAYOUTS = (
    "one process per GPU (srun --ntasks-per-node=8 --gpus-per-task=1) or one per node with "
    "all its GPUs (srun --ntasks-per-node=1 --gpus-per-node=8)"
)


STARTED_BY = {
    "slurm": "started by SLURM",
    "openmpi": "started by Open MPI",
    "mpi": "started by MPI (through mpi4py)",
    "tpu": "on a Cloud TPU slice",
    "jax": "started with JAX_COORDINATOR_ADDRESS",
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process run, as its launcher's variables give it
    (None where they do not say)."""

    launcher: str  # 'slurm', 'openmpi', 'mpi' (through mpi4py), 'tpu', 'jax'
    processes: int | None = None
    process_id: int | None = None
    local_processes: int | None = None  # on this host
    local_rank: int | None = None
    method: str | None = None  # JAX's cluster_detection_method (None: JAX detects)


def valid_address(address: str) -> bool:
    """Whether `address` is HOST:PORT with a port JAX can listen on (1-65535)."""
    host, colon, port = address.rpartition(":")
    return bool(host and colon and port.isdigit() and 0 < int(port) < 65536)


def _int(env: Mapping[str, str], name: str) -> int | None:
    """A launcher's count or index (SLURM writes some counts as '2(x4)')."""
    match = re.match(r"\s*(\d+)", env.get(name, ""))
    return int(match[1]) if match else None


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's SLURM_STEP_TASKS_PER_NODE, e.g. '2(x3),1', as one count per node."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return []
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _slurm(env: Mapping[str, str]) -> Launch | None:
    tasks = _int(env, "SLURM_NTASKS") or 1
    if "SLURM_JOB_ID" not in env or tasks <= 1:
        return None
    if "SLURM_STEP_NODELIST" not in env:  # the job's batch script or an salloc shell
        raise LaunchError(
            f"this is the shell of SLURM job {env['SLURM_JOB_ID']} ({tasks} tasks), not one "
            "of its tasks: start the program with srun (srun python main.py ...), which starts "
            "one process per task; --distributed=off runs this one process alone."
        )
    per_node = tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    )
    node = _int(env, "SLURM_NODEID")
    local = per_node[node] if node is not None and node < len(per_node) else None
    return Launch("slurm", tasks, _int(env, "SLURM_PROCID"), local, _int(env, "SLURM_LOCALID"))


def _mpi(env: Mapping[str, str], forced: bool) -> Launch | None:
    """Open MPI 4 (JAX reads OMPI_MCA_orte_hnp_uri), or an MPI that sets no variable JAX
    reads: Open MPI 5 (OMPI_COMM_WORLD_*), MPICH and Intel MPI (PMI_*), through mpi4py."""
    size = _int(env, "OMPI_COMM_WORLD_SIZE") or _int(env, "PMI_SIZE")
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    rank = rank if rank is not None else _int(env, "PMI_RANK")
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or _int(env, "MPI_LOCALNRANKS")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_rank = local_rank if local_rank is not None else _int(env, "MPI_LOCALRANKID")
    if not forced and "OMPI_MCA_orte_hnp_uri" in env and size != 1:
        return Launch("openmpi", size, rank, local, local_rank)
    if not forced and (size or 1) <= 1:
        return None
    if find_spec("mpi4py") is None:
        raise LaunchError(
            f"this process is rank {rank} of an MPI job of {size} ranks whose MPI sets no "
            "variable JAX reads (Open MPI 5, MPICH, Intel MPI): install mpi4py "
            "(pip install -e '.[mpi]'), through which JAX finds the other ranks."
        )
    return Launch("mpi", size, rank, local, local_rank, method="mpi4py")


def detect(environ: Mapping[str, str] | None = None, cluster: str = "auto") -> Launch | None:
    """The multi-process launcher this process runs under, from its environment (None:
    a process on its own). `cluster` forces one of JAX's detections (CLUSTERS). Raises
    LaunchError (one line) for a SLURM job's shell started without srun and for an MPI
    job JAX cannot join without mpi4py."""
    if cluster not in CLUSTERS:
        raise LaunchError(f"--cluster={cluster!r} must be one of {', '.join(CLUSTERS)}.")
    env = os.environ if environ is None else environ
    if cluster == "slurm":
        return _slurm(env) or Launch("slurm", method="slurm")
    if cluster in ("ompi", "mpi4py"):
        found = _mpi(env, forced=cluster == "mpi4py")
        return dataclasses.replace(found or Launch("openmpi"), method=cluster)
    found = _slurm(env) or _mpi(env, forced=False)
    if found is not None:
        return found
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) > 1:
        return Launch("tpu", len(hosts), _int(env, "TPU_WORKER_ID"))
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return Launch("jax")
    return None


def visible_gpus(environ: Mapping[str, str] | None = None, root: str = "/") -> int | None:
    """How many NVIDIA GPUs this process may use: the ids in CUDA_VISIBLE_DEVICES where it
    is set (SLURM sets it to the GPUs it gives a task), else the driver's device nodes
    (/dev/nvidia0, ...). None where neither says (no NVIDIA driver)."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
        return 0 if ids[:1] in (["-1"], ["NoDevFiles"]) else len(ids)
    return _gpu_nodes(root) or None


def _gpu_nodes(root: str) -> int:
    return sum(1 for p in Path(root, "dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def local_devices(
    launch: Launch | None,
    gpus: int | None,
    environ: Mapping[str, str] | None = None,
    root: str = "/",
) -> list[int] | None:
    """`local_device_ids` for `jax.distributed.initialize`: the GPU ordinals, as this
    process sees them, that are its own. [] restricts nothing (every device the process
    sees is its own: no GPU, one process on its host, or GPUs bound to this process by its
    launcher); None leaves it to JAX (a Cloud TPU slice, where JAX restricts nothing).
    `JAX_LOCAL_DEVICE_IDS`, where set, is the user's choice and is kept.

    Processes of one host that all see the same GPUs (SLURM's --gpus-per-node with
    several tasks, mpirun on a GPU node) share them in contiguous blocks by local rank;
    LaunchError when they cannot share them evenly."""
    env = os.environ if environ is None else environ
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        return [int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(",")]
    if launch is not None and launch.launcher == "tpu":
        return None
    local = launch.local_processes if launch is not None else None
    if not gpus or not local or local <= 1:
        return []
    on_node = _int(env, "SLURM_GPUS_ON_NODE") or _gpu_nodes(root) or gpus
    if gpus < on_node:  # the launcher gave this process its own GPUs
        return []
    if launch.local_rank is None or gpus % local:
        raise LaunchError(
            f"the {local} processes on this host all see the same {gpus} GPUs, which cannot "
            f"be shared evenly between them: start {LAYOUTS}."
        )
    share = gpus // local
    return list(range(launch.local_rank * share, (launch.local_rank + 1) * share))


@dataclasses.dataclass(frozen=True)
class Joined:
    """A multi-process run this process joined: its launcher and the GPU ordinals it was
    given ([]: all it sees; None: JAX's choice)."""

    launch: Launch | None
    local_device_ids: list[int] | None


def initialize_distributed(
    mode: str = "auto",
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cluster: str = "auto",
    heartbeat_timeout_seconds: int = 60,
    initialization_timeout_seconds: int = 300,
    environ: Mapping[str, str] | None = None,
    on_join_timeout: Callable[[], None] | None = None,
    root: str = "/",
) -> Joined | None:
    """Join the multi-process run (`jax.distributed.initialize`) if there is one.

    mode 'on' always initialises (JAX fills in what the flags leave unset from the
    cluster); 'off' never; 'auto' initialises when a flag is given or `detect` finds a
    launcher. Each process is given its own GPUs (`local_devices`). JAX's preemption
    service is off: the train loop agrees on a preemption step itself
    (`train.signals.Preemption`). A process silent for `heartbeat_timeout_seconds` is
    declared dead and the others stop. When the processes have not all joined after
    `initialization_timeout_seconds`, `on_join_timeout` is called (from another thread;
    JAX would abort the process with a C++ stack trace a little later). Returns what it
    joined, or None. Bad input raises a one-line ValueError (LaunchError)."""
    if mode not in MODES:
        raise LaunchError(f"--distributed={mode!r} must be one of {MODES}.")
    if mode == "off":
        return None
    env = os.environ if environ is None else environ
    explicit = coordinator_address is not None or (num_processes or 1) > 1
    launch = None if explicit and cluster == "auto" else detect(env, cluster)
    if mode == "auto" and not explicit and launch is None:
        return None
    if launch is not None and launch.method == "mpi4py" and launch.local_processes is None:
        launch = _mpi_local(launch)
    ids = local_devices(launch, visible_gpus(env, root), env, root)
    if process_id == 0 and coordinator_address:
        check_port_free(coordinator_address)
    first = process_id if process_id is not None else (launch.process_id if launch else None)
    import jax  # the backend starts after this, with the devices chosen here
    from absl import logging

    if first in (0, None):
        logging.info(
            "joining a run of %s processes %s at %s (waiting up to %d s for all of them)%s",
            num_processes or (launch.processes if launch else None) or "the cluster's",
            STARTED_BY[launch.launcher] if launch else "started with --coordinator_address",
            coordinator_address or "the cluster's coordinator",
            initialization_timeout_seconds,
            f"; this process's GPUs: {ids}" if ids else "",
        )
    joined = threading.Event()
    if on_join_timeout is not None:
        threading.Thread(
            target=lambda: joined.wait(initialization_timeout_seconds) or on_join_timeout(),
            daemon=True,
        ).start()
    margin = 60 if on_join_timeout is not None else 0  # JAX's abort: only a backstop
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids=ids,
        cluster_detection_method=launch.method if launch else None,
        initialization_timeout=initialization_timeout_seconds + margin,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    )
    joined.set()
    return Joined(launch, ids)


def _mpi_local(launch: Launch) -> Launch:
    """The ranks on this host and this rank among them, from MPI itself (for MPIs that set
    no variable for them)."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    return dataclasses.replace(
        launch,
        processes=MPI.COMM_WORLD.Get_size(),
        process_id=MPI.COMM_WORLD.Get_rank(),
        local_processes=node.Get_size(),
        local_rank=node.Get_rank(),
    )


def check_port_free(coordinator_address: str) -> None:
    """LaunchError (one line) when the coordinator's port is taken on this host (process
    0 runs the coordinator; JAX would crash binding it)."""
    port = coordinator_address.rsplit(":", 1)[-1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(port)))
        except OSError as e:
            raise LaunchError(
                f"--coordinator_address={coordinator_address}: port {port} cannot be used on "
                f"this host ({e.strerror}; another run's coordinator or another program "
                "holds it): choose a free port."
            ) from None


def cuda_plugin_gpus() -> int | None:
    """How many GPUs JAX's CUDA plugin sees on this host, whatever JAX was told to use
    (None: no CUDA plugin, or it cannot tell). A private API of the plugin's
    (`private.cuda_plugin_device_count`)."""
    return private.cuda_plugin_device_count()


def check_gpus_used(
    platform: str, used: int, visible: int | None, joined: Joined | None, process: int
) -> str | None:
    """One line when this process drives fewer GPUs than it was given: `used` (JAX's
    local devices) against `visible` (what the CUDA plugin sees) or the share `joined`
    planned. Where the platform is not a GPU, or nothing says how many there are: None."""
    if platform not in ("gpu", "cuda", "rocm") or not visible:
        return None
    planned = joined.local_device_ids if joined is not None else None
    given = len(planned) if planned else visible
    if used >= given:
        return None
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"process {process} drives {used} of the {given} GPUs it was given ({visible} visible"
        + (f", CUDA_VISIBLE_DEVICES={where}" if where is not None else "")
        + (
            f", JAX_LOCAL_DEVICE_IDS={os.environ['JAX_LOCAL_DEVICE_IDS']}"
            if os.environ.get("JAX_LOCAL_DEVICE_IDS")
            else ""
        )
        + f"): start {LAYOUTS}, or set CUDA_VISIBLE_DEVICES to the GPUs each process should use."
    )


def kv_client() -> Any:
    """The coordination service's client of this process (its key-value store and
    barriers), or None in a run of one process. Through JAX's internals: the store has no
    public API yet (`private.coordination_client`; a LaunchError where it is gone)."""
    return private.coordination_client()


_AGREEMENTS = itertools.count()  # each check's keys are new in the job's key-value store


def check_processes_agree(values: Mapping[str, Any], timeout_seconds: int = 300) -> None:
    """Raise a ValueError naming the first entry of `values` (JSON-able) on which some
    process differs from process 0: every process must run the same config on the same
    number of devices, or the collectives would silently mix different computations.

    The values travel through the coordination service's key-value store, not a
    collective: a collective needs the very agreement (the same devices per process)
    that this checks."""
    import jax

    if jax.process_count() == 1:
        return
    client = kv_client()
    prefix = f"largebatch_jax/agree/{next(_AGREEMENTS)}"
    mine = {k: json.dumps(v, sort_keys=True, default=str) for k, v in values.items()}
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(mine, sort_keys=True))
    everyone = [
        json.loads(client.blocking_key_value_get(f"{prefix}/{p}", timeout_seconds * 1000))
        for p in range(jax.process_count())
    ]
    for key in sorted(set().union(*everyone)):
        reference = everyone[0].get(key)
        for p, theirs in enumerate(everyone[1:], start=1):
            if theirs.get(key) != reference:
                raise ValueError(
                    f"process {p} has {key}={_short(theirs.get(key))} but process 0 has "
                    f"{_short(reference)}: start every process with the same command and "
                    "the same number of devices."
                )


def _short(text: str | None, limit: int = 120) -> str:
    text = "<missing>" if text is None else text
    return text if len(text) <= limit else text[: limit - 3] + "..."
