"""Every test sees 8 CPU devices: XLA_FLAGS must be set before jax is first imported."""

import atexit
import os
import shutil
import tempfile

# pytest imports tracemalloc lazily to report an exception raised in a __del__; if that
# happens inside tfds's lazy-import context (etils), the import itself fails and the test
# errors (seen once in CI). Importing it first makes the report path import-free.
import tracemalloc  # noqa: F401

import pytest

from largebatch_jax import host

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Each pytest process compiles for TPU slices (tests/test_aot.py) and loads libtpu.
host.tpu_compiler_only()
# Exact mode (the default) on CPU needs XLA:CPU's thread count fixed before JAX starts, as
# main.py fixes it (exact.fix_cpu_threads): the same for the tests' in-process runs.
os.environ.setdefault("NPROC", "16")  # exact.CPU_THREADS
# One persistent compilation cache per test session, shared by every subprocess run
# (tests/runs.py passes os.environ on): dozens of runs compile the same smoke program,
# and a cached executable is the one XLA would build again (the same params_sha256).
# Fresh each session, so nothing outlives it or leaks between sessions.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="largebatch_jax_test_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

with host.plugin_noise_filtered():  # what the CUDA plugin prints when `import jax` loads it
    import jax

# Tests that initialise models directly (not through step.create_train_state, which
# chooses its stream itself) use the project's stream: the same weights, and fast on CPU.
jax.config.update("jax_threefry_partitionable", False)


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.device_count()}"


@pytest.fixture(scope="session")
def fashion_mnist_dir(tmp_path_factory):
    """Fashion-MNIST prepared once per session with the real tfds builder (from the local
    IDX files, or tfds's download where the network allows)."""
    from largebatch_jax.data import sources

    data_dir = tmp_path_factory.mktemp("tfds")
    try:
        sources.prepare("fashion_mnist", str(data_dir))
    except Exception as e:  # neither the IDX files nor the network
        pytest.skip(
            f"Fashion-MNIST unavailable ({type(e).__name__}: {e}); install Debian's "
            "dataset-fashion-mnist (make data)"
        )
    return str(data_dir)


@pytest.fixture(scope="session")
def straight(tmp_path_factory, fashion_mnist_dir):
    """The uninterrupted 64-step smoke run (tests.runs.LONGER): the reference whose
    params_sha256 and curves every interrupted or faulted run must end with. It keeps
    all 8 checkpoints, so that tests can cut a copy back to any of them."""
    from tests.runs import LONGER, run

    workdir = tmp_path_factory.mktemp("straight")
    out = run(workdir, fashion_mnist_dir, *LONGER, "--config.keep_checkpoints=8")
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir
