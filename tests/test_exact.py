"""reduction='exact' end to end: `main.py` on the smoke config gives the same bits on 8
devices, 2 devices and 1 device with 8 accumulation steps, and a run killed on 8 devices
and resumed on 2 ends with the same parameters, and so do 2 processes x 4 devices
(gloo). main.py fixes XLA:CPU's thread count for exact mode (exact.fix_cpu_threads),
without which a convolution's bits depend on the local device count."""

import signal

import pytest

from largebatch_jax.metrics import read_metrics
from tests.runs import result, run, start, wait_for_checkpoint, without_timing

pytestmark = pytest.mark.slow

EXACT = ("--config.reduction=exact",)


def devices(count: int) -> dict:
    """`count` fake devices, and no NPROC: main.py must fix the thread count itself (with
    NPROC=2, XLA:CPU's default on 2 cores, the smoke run on 2 devices ends with other
    bits than with 16)."""
    flags = f"--xla_force_host_platform_device_count={count}"
    return {"extra_env": {"XLA_FLAGS": flags, "NPROC": None}}


@pytest.fixture(scope="module")
def eight(tmp_path_factory, fashion_mnist_dir):
    workdir = tmp_path_factory.mktemp("exact_8")
    out = run(workdir, fashion_mnist_dir, *EXACT)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir


LAYOUTS = [
    pytest.param((), devices(2), id="2_devices"),
    pytest.param(("--config.accum_steps=8",), devices(1), id="1_device_x_8_accum"),
    pytest.param((), {"processes": 2, "devices": 4}, id="2_processes_x_4_devices"),
]


@pytest.mark.parametrize("overrides,kwargs", LAYOUTS)
def test_every_layout_gives_the_same_bits(overrides, kwargs, eight, tmp_path, fashion_mnist_dir):
    out = run(tmp_path / "wd", fashion_mnist_dir, *EXACT, *overrides, timeout=600, **kwargs)
    assert out.returncode == 0, out.stderr[-3000:]
    assert result(tmp_path / "wd")["params_sha256"] == result(eight)["params_sha256"]
    ours, theirs = read_metrics(tmp_path / "wd"), read_metrics(eight)
    assert without_timing(ours) == without_timing(theirs)  # every logged value, bitwise
    assert len(ours) > 10 and any("val_loss" in r for r in ours)


def test_killed_on_8_devices_and_resumed_on_2_ends_the_same(eight, tmp_path, fashion_mnist_dir):
    proc = start(tmp_path / "wd", fashion_mnist_dir, *EXACT)
    wait_for_checkpoint(proc, tmp_path / "wd", 16)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    out = run(tmp_path / "wd", fashion_mnist_dir, *EXACT, **devices(2))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming at step" in out.stderr
    assert result(tmp_path / "wd")["params_sha256"] == result(eight)["params_sha256"]
    assert without_timing(read_metrics(tmp_path / "wd")) == without_timing(read_metrics(eight))


def test_a_thread_count_below_the_local_devices_is_refused(tmp_path, fashion_mnist_dir):
    """NPROC below the local device count: XLA:CPU would run max(NPROC, devices) threads
    and round unlike other layouts, so exact mode stops with one line, exit 2."""
    out = run(tmp_path / "wd", fashion_mnist_dir, *EXACT, extra_env={"NPROC": "4"})
    assert out.returncode == 2
    assert "NPROC=4 is below the 8 local devices" in out.stderr.strip().splitlines()[-1]
