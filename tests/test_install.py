"""The notebooks' installer (scripts/install_for_runtime.py) picks the extra for the
runtime's hardware and keeps a TensorFlow the runtime already has; the project's own
pyproject.toml is what it reads."""

import importlib.util
import tomllib

from tests.runs import ROOT

spec = importlib.util.spec_from_file_location(
    "install_for_runtime", ROOT / "scripts" / "install_for_runtime.py"
)
installer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(installer)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def names(command: list[str]) -> set[str]:
    return {installer.requirement_name(r) for r in command if not r.startswith("-")} - {"install"}


def test_a_gpu_runtime_with_tensorflow_gets_the_cuda_extra_and_keeps_its_tensorflow():
    (package, deps), what = installer.pip_commands(PYPROJECT, ("cuda",), True, ROOT)
    assert package == ["install", "--quiet", "--no-deps", "-e", str(ROOT)]
    assert "jax[cuda12]==0.10.2" in deps and "tensorflow-cpu" not in names(deps)
    assert {"flax", "optax", "tensorflow-datasets", "grain"} <= names(deps)
    assert what == (
        "installing largebatch_jax with the 'cuda12' extra (this host has an NVIDIA GPU); "
        "keeping the runtime's TensorFlow"
    )


def test_a_tpu_runtime_gets_libtpu_and_a_cpu_runtime_says_so_in_one_line():
    (_, deps), what = installer.pip_commands(PYPROJECT, ("tpu",), False, ROOT)
    assert "jax[tpu]==0.10.2" in deps and "tensorflow-cpu" in names(deps)
    assert "'tpu' extra (this host has TPU chips)" in what
    (_, deps), what = installer.pip_commands(PYPROJECT, (), False, ROOT)
    assert not any("[cuda" in r or "[tpu]" in r for r in deps)
    assert what.startswith("installing largebatch_jax for CPU only: this host has no GPU or TPU")
    assert "\n" not in what
