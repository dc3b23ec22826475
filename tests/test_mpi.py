"""Open MPI starts the job for real: `mpirun -np 2` runs main.py on the smoke config (64
steps) as 2 ranks x 2 CPU devices and ends with the params_sha256 of one process with 8
devices (exact mode), through JAX's Open MPI detection and, for MPIs that set no variable
JAX reads (Open MPI 5, MPICH), through mpi4py."""

import subprocess
import sys
from pathlib import Path

import pytest

from largebatch_jax.launch import free_port
from tests.engines import TWO_BY_TWO, need
from tests.runs import LONGER, ROOT, env, foreign_lines, result

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_engines")]

MPIRUN = (
    "mpirun",
    "--allow-run-as-root",  # CI runs as root
    "--oversubscribe",
    "--bind-to",
    "none",
    "-np",
    "2",
    *(x for name in TWO_BY_TWO for x in ("-x", name)),
)


def mpirun(workdir, data_dir, *options):
    """`mpirun -np 2 OPTIONS python main.py` on the smoke config, started. Each job has its
    own session folder: two jobs started at once both create Open MPI's default one
    (/tmp/ompi.HOST.UID), and the second fails with EEXIST (seen once in CI)."""
    session = Path(f"{workdir}_ompi")
    session.mkdir(parents=True, exist_ok=True)
    command = [
        *MPIRUN,
        "--mca",
        "orte_tmpdir_base",
        str(session),
        *options,
        sys.executable,
        "main.py",
        "--config=configs/smoke.py",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *LONGER,
        # one evaluation and one checkpoint, at the end: less time, the same parameters
        "--config.eval_every_epochs=4.0",
        "--config.checkpoint_every_steps=64",
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=env(**TWO_BY_TWO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_mpirun_gives_the_bits_of_one_process_through_jax_and_through_mpi4py(
    straight, tmp_path, fashion_mnist_dir
):
    """Open MPI 4 sets the variable JAX's Open MPI detection reads
    (OMPI_MCA_orte_hnp_uri); Open MPI 5 no longer does, MPICH never did: without it,
    main.py finds the other ranks through mpi4py. The two jobs run side by side."""
    need("mpirun")
    pytest.importorskip("mpi4py", reason="mpi4py not installed: pip install -e '.[mpi]'")
    jobs = {
        "Open MPI": mpirun(tmp_path / "ompi", fashion_mnist_dir),
        "MPI (through mpi4py)": mpirun(
            tmp_path / "mpi4py",
            fashion_mnist_dir,
            # mpi4py's rank 0 picks a port from its host name; the two jobs share this host
            *("-x", f"JAX_COORDINATOR_PORT={free_port()}"),
            *("env", "-u", "OMPI_MCA_orte_hnp_uri"),
        ),
    }
    for started_by, job in jobs.items():
        stdout, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stdout[-2000:] + stderr[-3000:]
        assert f"joining a run of 2 processes started by {started_by} at" in stderr
        assert foreign_lines(stdout + stderr) == [], stderr[-3000:]
    for workdir in ("ompi", "mpi4py"):
        assert result(tmp_path / workdir)["params_sha256"] == result(straight)["params_sha256"]
