"""Open MPI starts the job for real: `mpirun -np 2` runs main.py on the smoke config (64
steps) as 2 ranks x 4 CPU devices and ends with the params_sha256 of one process with 8
devices (exact mode), through JAX's Open MPI detection and, for MPIs that set no variable
JAX reads (Open MPI 5, MPICH), through mpi4py."""

import sys

import pytest

from tests.engines import TWO_BY_FOUR, need
from tests.runs import LONGER, call, env, foreign_lines, result

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cluster_engines")]

MPIRUN = (
    "mpirun",
    "--allow-run-as-root",  # CI runs as root
    "--oversubscribe",
    "--bind-to",
    "none",
    "-np",
    "2",
    *(x for name in TWO_BY_FOUR for x in ("-x", name)),
)


def mpirun(workdir, data_dir, *before_python):
    need("mpirun")
    pytest.importorskip("mpi4py", reason="mpi4py not installed: pip install -e '.[mpi]'")
    command = [
        *MPIRUN,
        *before_python,
        sys.executable,
        "main.py",
        "--config=configs/smoke.py",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *LONGER,
    ]
    out = call(command, timeout=300, environ=env(**TWO_BY_FOUR))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert foreign_lines(out.stdout + out.stderr) == [], out.stderr[-3000:]
    return out


def test_mpirun_gives_the_bits_of_one_process(straight, tmp_path, fashion_mnist_dir):
    out = mpirun(tmp_path, fashion_mnist_dir)
    assert "joining a run of 2 processes started by Open MPI" in out.stderr
    assert result(tmp_path)["params_sha256"] == result(straight)["params_sha256"]


def test_an_mpi_that_sets_no_variable_jax_reads_joins_through_mpi4py(
    straight, tmp_path, fashion_mnist_dir
):
    """Open MPI 5 no longer sets OMPI_MCA_orte_hnp_uri, the variable JAX's Open MPI
    detection reads (MPICH never did): without it, main.py finds the other ranks through
    mpi4py."""
    out = mpirun(tmp_path, fashion_mnist_dir, "env", "-u", "OMPI_MCA_orte_hnp_uri")
    assert "joining a run of 2 processes started by MPI (through mpi4py)" in out.stderr
    assert result(tmp_path)["params_sha256"] == result(straight)["params_sha256"]
