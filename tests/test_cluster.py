"""Which launcher started a process, which GPUs are its own, and what reaches
`jax.distributed.initialize`: each scheduler's environment faked, JAX's own start-up code
run on it (its cluster detection and its choice of visible devices) with a stand-in for
the coordination service."""

import types

import jax
import pytest

from largebatch_jax import cluster
from largebatch_jax.errors import LaunchError

# The variables SLURM 22.05 gave srun's tasks on a node of 8 GPUs (tests/test_slurm.py
# reads them off a real one): one task per GPU, bound (--gpus-per-task=1), task 3 of 8.
SLURM_TASK = {
    "SLURM_JOB_ID": "3021",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_NODEID": "0",
    "SLURM_GPUS_ON_NODE": "8",
}
PER_GPU = {
    **SLURM_TASK,
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
    "SLURM_STEP_TASKS_PER_NODE": "8",
    "CUDA_VISIBLE_DEVICES": "3",
}
# One task per node with its 8 GPUs (--ntasks-per-node=1 --gpus-per-node=8), 32 nodes.
PER_NODE = {
    **SLURM_TASK,
    "SLURM_NODEID": "5",
    "SLURM_NTASKS": "32",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "1(x32)",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}
# 8 tasks on a node that all see its 8 GPUs (--ntasks-per-node=8 --gpus-per-node=8).
SHARED = {
    **PER_GPU,
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "5",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}
# Open MPI 4's mpirun on 4 nodes of 8 GPUs, no CUDA_VISIBLE_DEVICES.
OMPI = {
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_RANK": "2",
}
OMPI_PER_NODE = {
    **OMPI,
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
}
OMPI_PER_GPU = {
    **OMPI,
    "OMPI_COMM_WORLD_SIZE": "32",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "6",
}
TPU = {"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "1"}
LAUNCHER_VARIABLES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TPU_WORKER", "JAX_")


def gpu_host(tmp_path, gpus=8):
    """A root folder whose /dev has the device nodes of `gpus` NVIDIA GPUs."""
    (tmp_path / "dev").mkdir()
    for i in range(gpus):
        (tmp_path / "dev" / f"nvidia{i}").touch()
    (tmp_path / "dev" / "nvidiactl").touch()
    return str(tmp_path)


@pytest.fixture
def launched_as(monkeypatch):
    """Replace this process's launcher variables by a scheduler's."""

    def use(environ):
        import os

        for name in list(os.environ):
            if name.startswith(LAUNCHER_VARIABLES) or name == "CUDA_VISIBLE_DEVICES":
                monkeypatch.delenv(name)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)

    return use


@pytest.fixture
def jax_start(monkeypatch):
    """`jax.distributed.initialize` with JAX's own code up to the coordination service,
    which is a stand-in: records the arguments it got and, after it, the GPUs JAX lets
    the backend use (`jax_cuda_visible_devices`, 'all' when it restricts nothing)."""
    from jax._src import distributed, xla_bridge

    class Stub:
        def connect(self):
            pass

        def shutdown(self):
            pass

    runtime = types.SimpleNamespace(
        get_distributed_runtime_service=lambda *a, **k: Stub(),
        get_distributed_runtime_client=lambda *a, **k: Stub(),
    )
    monkeypatch.setattr(distributed, "_jax", runtime)
    monkeypatch.setattr(distributed, "global_state", distributed.State())
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    calls = []
    real = jax.distributed.initialize

    def recording(*args, **kwargs):
        calls.append(kwargs)
        real(*args, **kwargs)
        calls[-1]["visible devices"] = xla_bridge.CUDA_VISIBLE_DEVICES.value

    monkeypatch.setattr(jax.distributed, "initialize", recording)
    preemption = distributed._ENABLE_PREEMPTION_SERVICE
    before = xla_bridge.CUDA_VISIBLE_DEVICES.value, preemption.value
    yield calls
    jax.config.update("jax_cuda_visible_devices", before[0])
    jax.config.update("jax_enable_preemption_service", before[1])


@pytest.mark.parametrize(
    "environ,ids,visible",
    [
        # Bound to GPU 3, which it sees as its only GPU: JAX alone would ask for GPU 3.
        (PER_GPU, [], "all"),
        # One task per node: JAX alone would give it GPU 0 of its 8.
        (PER_NODE, [], "all"),
        # 8 tasks that all see the node's 8 GPUs: one each, by local rank (JAX's choice too).
        (SHARED, [5], "5"),
        # mpirun, one rank per node (JAX alone: GPU 0 of 8), and one rank per GPU.
        (OMPI_PER_NODE, [], "all"),
        (OMPI_PER_GPU, [6], "6"),
    ],
    ids=["slurm_per_gpu", "slurm_per_node", "slurm_shared", "ompi_per_node", "ompi_per_gpu"],
)
def test_every_gpu_of_a_node_is_some_process_s(
    launched_as, jax_start, tmp_path, environ, ids, visible
):
    launched_as(environ)
    joined = cluster.initialize_distributed("auto", root=gpu_host(tmp_path))
    (call,) = jax_start
    assert call["local_device_ids"] == ids == joined.local_device_ids
    assert call["visible devices"] == visible
    assert call["cluster_detection_method"] is None  # JAX reads SLURM's / Open MPI's variables
    from jax._src import distributed

    assert distributed._ENABLE_PREEMPTION_SERVICE.value is False  # train.signals agrees itself


def test_a_cloud_tpu_slice_is_left_to_jax(launched_as, jax_start, monkeypatch):
    """On a TPU VM JAX restricts no device, and nothing here asks it to."""
    from jax._src.clusters import cloud_tpu_cluster
    from jax._src.clusters import cluster as jax_cluster

    launched_as(TPU)
    monkeypatch.setattr(jax_cluster, "running_in_cloud_tpu_vm", True)
    tpu = cloud_tpu_cluster.GceTpuCluster
    for name, value in (
        ("is_env_present", True),
        ("get_coordinator_address", "t0:8476"),
        ("get_process_count", 4),
        ("get_process_id", 1),
    ):
        monkeypatch.setattr(tpu, name, classmethod(lambda cls, *a, v=value, **k: v))
    joined = cluster.initialize_distributed("auto")
    (call,) = jax_start
    assert joined.launch.launcher == "tpu"
    assert call["local_device_ids"] is None
    assert call["visible devices"] == "all"


def test_jax_alone_leaves_gpus_idle(launched_as, jax_start, tmp_path):
    """What the plan fixes: JAX's own default under SLURM, one task per node (GPU 0 of 8),
    and one bound task per GPU (a GPU number it cannot see)."""
    jax.config.update("jax_enable_preemption_service", False)
    for environ, alone in ((PER_NODE, "0"), (PER_GPU, "3")):
        launched_as(environ)
        jax.distributed.initialize()
        assert jax_start[-1]["visible devices"] == alone
        from jax._src import distributed

        distributed.global_state.client = distributed.global_state.service = None


@pytest.mark.parametrize(
    "environ,launcher,rank,local,method",
    [
        ({}, None, None, None, None),
        (PER_NODE, "slurm", 5, 1, None),
        (
            {**PER_GPU, "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"},
            "slurm",
            3,
            1,
            None,
        ),
        ({**PER_GPU, "SLURM_NTASKS": "1"}, None, None, None, None),
        (OMPI_PER_GPU, "openmpi", 2, 8, None),
        # Open MPI 5 sets no OMPI_MCA_orte_hnp_uri; MPICH and Intel MPI set PMI_*.
        ({**OMPI_PER_GPU, "OMPI_MCA_orte_hnp_uri": None}, "mpi", 2, 8, "mpi4py"),
        ({"PMI_SIZE": "4", "PMI_RANK": "1", "MPI_LOCALNRANKS": "2"}, "mpi", 1, 2, "mpi4py"),
        ({"OMPI_COMM_WORLD_SIZE": "1"}, None, None, None, None),
        (TPU, "tpu", 1, None, None),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, None, None, None, None),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "jax", None, None, None),
    ],
)
def test_launcher_detection(environ, launcher, rank, local, method):
    found = cluster.detect({k: v for k, v in environ.items() if v is not None})
    if launcher is None:
        assert found is None
        return
    assert (found.launcher, found.process_id, found.local_processes, found.method) == (
        launcher,
        rank,
        local,
        method,
    )


def test_a_slurm_batch_shell_without_srun_is_one_line():
    """`python main.py` in an `sbatch -n 2` script: the batch shell has the job's task
    count but no step (no SLURM_STEP_NODELIST); JAX would say 'coordinator_address should
    be defined'."""
    shell = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    with pytest.raises(LaunchError) as error:
        cluster.detect(shell)
    assert str(error.value).startswith("this is the shell of SLURM job 77 (2 tasks)")
    assert "start the program with srun" in str(error.value) and "\n" not in str(error.value)
    assert cluster.initialize_distributed("off", environ=shell) is None


def test_an_mpi_without_mpi4py_is_one_line(monkeypatch):
    monkeypatch.setattr(cluster, "find_spec", lambda name: None)
    with pytest.raises(LaunchError, match=r"install mpi4py \(pip install -e '\.\[mpi\]'\)"):
        cluster.detect({"PMI_SIZE": "4", "PMI_RANK": "1"})
    # Forced through --cluster=mpi4py, Open MPI 4 too.
    with pytest.raises(LaunchError, match="rank 2 of an MPI job of 32 ranks"):
        cluster.detect(OMPI_PER_GPU, "mpi4py")


def test_uneven_shares_of_a_node_s_gpus_are_refused(tmp_path):
    three = cluster.Launch("slurm", 3, 1, local_processes=3, local_rank=1)
    with pytest.raises(LaunchError) as error:
        cluster.local_devices(three, 8, {"SLURM_GPUS_ON_NODE": "8"}, gpu_host(tmp_path))
    assert "the 3 processes on this host all see the same 8 GPUs" in str(error.value)
    assert "--gpus-per-task=1" in str(error.value) and "--gpus-per-node=8" in str(error.value)
    # Two tasks with 4 GPUs each (--gpus-per-task=4): each has its own, all of them.
    two = cluster.Launch("slurm", 2, 1, local_processes=2, local_rank=1)
    assert cluster.local_devices(two, 4, {"SLURM_GPUS_ON_NODE": "8"}, "/nonexistent") == []
    # The user's JAX_LOCAL_DEVICE_IDS is kept.
    assert cluster.local_devices(two, 8, {"JAX_LOCAL_DEVICE_IDS": "0,1"}) == [0, 1]


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5b2c,GPU-77aa"}, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
        ({}, 8),
    ],
)
def test_visible_gpus(tmp_path, environ, expected):
    assert cluster.visible_gpus(environ, gpu_host(tmp_path)) == expected


def test_no_gpu_and_no_driver_restricts_nothing():
    assert cluster.visible_gpus({}, "/nonexistent") is None
    assert cluster.local_devices(cluster.Launch("slurm", 2, 0, 2, 0), None, {}) == []


def test_tasks_per_node():
    assert cluster.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert cluster.tasks_per_node("8") == [8]
    assert cluster.tasks_per_node("garbage") == []


@pytest.mark.parametrize(
    "used,visible,ids,error",
    [
        (8, 8, [], None),
        (1, 8, [], "process 3 drives 1 of the 8 GPUs it was given (8 visible"),
        (1, 8, [5], None),
        (1, 1, [], None),
        (2, 8, [4, 5, 6, 7], "process 3 drives 2 of the 4 GPUs it was given"),
    ],
)
def test_a_process_that_leaves_its_gpus_idle_stops(used, visible, ids, error):
    joined = cluster.Joined(cluster.Launch("slurm"), ids)
    found = cluster.check_gpus_used("gpu", used, visible, joined, 3)
    if error is None:
        assert found is None
    else:
        assert found.startswith(error) and "--gpus-per-node=8" in found and "\n" not in found
    assert cluster.check_gpus_used("cpu", 1, 8, joined, 3) is None  # fake CPU devices
    assert cluster.check_gpus_used("tpu", 1, 8, joined, 3) is None


def test_initialize_distributed_does_nothing_on_a_single_machine():
    assert cluster.initialize_distributed("auto", environ={}) is None
    assert cluster.initialize_distributed("off", "127.0.0.1:1", 2, 0) is None
    with pytest.raises(ValueError, match="--distributed='maybe'"):
        cluster.initialize_distributed("maybe")
    with pytest.raises(ValueError, match="--cluster='pbs'"):
        cluster.detect({}, "pbs")
