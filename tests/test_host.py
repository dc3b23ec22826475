"""A CPU host: main.py starts no accelerator plugin and prints none of their noise, even
with libtpu and the CUDA plugin installed (make test's install puts both there; the smoke run of
test_main checks a whole run's output), and it says in one line when an ImageNet-size run
is about to train on CPU devices only."""

import importlib.util
import os
import subprocess
import sys

from largebatch_jax import host
from tests import runs


def test_visible_accelerators_reads_device_nodes_and_the_pci_bus(tmp_path):
    assert host.visible_accelerators(str(tmp_path)) == ()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").touch()
    assert host.visible_accelerators(str(tmp_path)) == ("cuda",)
    card = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    card.mkdir(parents=True)
    (card / "vendor").write_text("0x1ae0\n")
    (card / "device").write_text("0x0042\n")  # Google's gVNIC network card: no TPU
    assert host.visible_accelerators(str(tmp_path)) == ("cuda",)
    (card / "device").write_text("0x0063\n")  # a TPU v5e chip
    assert host.visible_accelerators(str(tmp_path)) == ("cuda", "tpu")


def test_choose_platforms_restricts_jax_to_the_cpu_only_where_nothing_else_is():
    env: dict[str, str] = {}
    assert host.choose_platforms(env, accelerators=()) == "cpu"
    assert env == {"JAX_PLATFORMS": "cpu"}
    env = {}
    assert host.choose_platforms(env, accelerators=("cuda",)) is None and env == {}
    env = {"JAX_PLATFORMS": "tpu"}  # the user's choice stays
    assert host.choose_platforms(env, accelerators=()) is None and env == {"JAX_PLATFORMS": "tpu"}


def test_the_filter_drops_plugin_noise_and_keeps_everything_else(capfd):
    noise = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1796590558.301582    2698 cudart_stub.cc:31] Could not find cuda drivers on"
        " your machine, GPU will not be used.\n"
    )
    kept = "E0000 00:00:1.0  1 something.cc:1] a real error\nplain text from C\n"
    with host.plugin_noise_filtered():
        os.write(2, (noise + kept).encode())
    assert capfd.readouterr().err == kept


def test_cpu_only_warning_names_the_install_for_the_hardware():
    assert host.cpu_only_warning("cpu", 8, "resnet8", 14, ()) is None  # not ImageNet-size
    assert host.cpu_only_warning("gpu", 8, "resnet50", 224, ("cuda",)) is None
    bare = host.cpu_only_warning("cpu", 8, "resnet50", 224, ())
    assert "resnet50 at 224x224 is about to train on 8 CPU device(s)" in bare
    assert host.INSTALL["cuda"] in bare and host.INSTALL["tpu"] in bare
    gpu_host = host.cpu_only_warning("cpu", 1, "resnet50", 224, ("cuda",))
    assert "this host has an NVIDIA GPU" in gpu_host and host.INSTALL["cuda"] in gpu_host


def test_both_plugins_are_installed_where_ci_requires_them():
    """make test's install puts libtpu and the CUDA plugin in the venv, so that the runs of the
    tests (test_main's smoke run, the one below) show that their noise is gone."""
    if os.environ.get("REQUIRE_GPU_COMPILER") != "1":
        return
    for plugin in ("libtpu", "jax_cuda12_plugin"):
        assert importlib.util.find_spec(plugin) is not None, plugin


def test_an_imagenet_config_on_cpu_says_so_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "main.py", "--config=configs/imagenet_8k.py", f"--workdir={tmp_path}/wd",
         f"--config.data_dir={tmp_path}/no_data"],
        cwd=runs.ROOT, env=runs.env(JAX_PLATFORMS=None), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 2  # the data is not prepared
    warnings = [x for x in out.stderr.splitlines() if x.startswith("warning:")]
    assert warnings == [host.cpu_only_warning("cpu", 8, "resnet50", 224, ())]
    others = [x for x in out.stderr.splitlines() if not x.startswith("warning:")]
    assert [x for x in others if runs.PLUGIN_LINE.search(x)] == []
