"""largebatch_jax/private.py, the project's uses of private APIs: each entry resolves on
the installed versions (the real thing, not its fallback), and where its private path is
missing (the import made to fail, the name removed) the stated fallback is what is taken.
No other module of the package uses a private API; docs/design.md's table names every
entry and its tests."""

import ast
import re
import subprocess
import sys
import types
from importlib.util import find_spec
from pathlib import Path

import jax
import numpy as np
import pytest

from largebatch_jax import private
from largebatch_jax.errors import LaunchError
from tests.runs import ROOT

# --- importing private.py


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter in the checkout."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )


def test_importing_private_imports_no_library_and_changes_nothing():
    code = (
        "import os, sys; env = dict(os.environ); before = set(sys.modules)\n"
        "import largebatch_jax.private\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new & {'jax', 'jaxlib', 'grain', 'orbax', 'numpy', "
        "'jax_cuda12_plugin', 'jax_cuda13_plugin'}), dict(os.environ) == env)"
    )
    out = _python(code)
    assert out.stdout.split("\n")[0] == "[] True"


# --- hlo_cost_analysis: jax._src.lib._jax.hlo_module_cost_analysis


def _matmul_module():
    x = jax.numpy.ones((8, 16), np.float32)
    y = jax.numpy.ones((16, 4), np.float32)
    return jax.jit(lambda a, b: a @ b).lower(x, y).compiler_ir("hlo").as_hlo_module()


def test_hlo_cost_analysis_resolves():
    from jax._src.lib import _jax
    from jax.extend.backend import get_backend

    from largebatch_jax import utilization

    module = _matmul_module()
    cost = private.hlo_cost_analysis(module)
    assert cost == dict(_jax.hlo_module_cost_analysis(get_backend("cpu"), module))
    assert cost["flops"] == 2 * 8 * 16 * 4 and cost["bytes accessed"] > 0
    assert utilization.hlo_cost(module) == cost


@pytest.mark.parametrize("missing", ["module", "function"])
def test_hlo_cost_analysis_falls_back_to_no_figures(missing, monkeypatch):
    module = _matmul_module()
    if missing == "module":
        monkeypatch.setitem(sys.modules, "jax._src.lib", None)
    else:
        import jax._src.lib

        monkeypatch.setattr(jax._src.lib, "_jax", types.SimpleNamespace())
    assert private.hlo_cost_analysis(module) == {}


# --- coordination_client: jax._src.distributed.global_state.client


def test_coordination_client_resolves(monkeypatch):
    from jax._src import distributed

    from largebatch_jax import cluster

    assert distributed.global_state.client is None  # one process: jax.distributed not started
    assert private.coordination_client() is None
    store = object()
    monkeypatch.setattr(distributed.global_state, "client", store)
    assert private.coordination_client() is store
    assert cluster.kv_client() is store


def test_coordination_client_falls_back_to_a_launch_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax._src.distributed", None)
    with pytest.raises(LaunchError, match=r"jax\._src\.distributed\.global_state\.client") as e:
        private.coordination_client()
    assert e.value.exit_code == 2 and jax.__version__ in str(e.value)


# --- all_gather_invariant: jax.lax's where exported, else jax._src.lax.parallel's


def test_all_gather_invariant_resolves():
    from jax.sharding import PartitionSpec as P

    from largebatch_jax import exact

    public = getattr(jax.lax, "all_gather_invariant", None)
    if public is None:
        from jax._src.lax.parallel import all_gather_invariant as expected
    else:
        expected = public
    found = private.all_gather_invariant()
    assert found is expected and exact.all_gather_invariant is expected  # the same function
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    gather = jax.jit(  # out_specs=P(): the gathered value is typed as invariant
        jax.shard_map(
            lambda x: found(x, "i", tiled=True), mesh=mesh, in_specs=P("i"), out_specs=P()
        )
    )
    np.testing.assert_array_equal(gather(np.arange(16.0)), np.arange(16.0))


def test_all_gather_invariant_prefers_the_public_one(monkeypatch):
    public = object()
    monkeypatch.setattr(jax.lax, "all_gather_invariant", public, raising=False)
    assert private.all_gather_invariant() is public


def test_all_gather_invariant_falls_back_to_a_launch_error_when_called(monkeypatch):
    monkeypatch.delattr(jax.lax, "all_gather_invariant", raising=False)
    monkeypatch.setitem(sys.modules, "jax._src.lax.parallel", None)
    stand_in = private.all_gather_invariant()
    with pytest.raises(LaunchError, match="reduction=fast") as e:
        stand_in(np.zeros(2), "i", tiled=True)
    assert e.value.exit_code == 2


# --- cuda_plugin_device_count: jax_cuda1x_plugin._versions.cuda_device_count


def test_cuda_plugin_device_count_resolves(monkeypatch):
    import importlib

    from largebatch_jax import cluster

    installed = [p for p in private.CUDA_PLUGINS if find_spec(p) is not None]
    if not installed:
        pytest.skip("no JAX CUDA plugin installed")
    versions = importlib.import_module(f"{installed[0]}._versions")
    assert callable(versions.cuda_device_count)
    monkeypatch.setattr(versions, "cuda_device_count", lambda: 3)  # no driver here
    assert private.cuda_plugin_device_count() == 3
    assert cluster.cuda_plugin_gpus() == 3


def test_cuda_plugin_device_count_falls_back_to_none(monkeypatch):
    from largebatch_jax import cluster

    for plugin in private.CUDA_PLUGINS:
        monkeypatch.setitem(sys.modules, f"{plugin}._versions", None)
    assert private.cuda_plugin_device_count() is None
    assert cluster.cuda_plugin_gpus() is None
    assert cluster.check_gpus_used("gpu", 1, cluster.cuda_plugin_gpus(), None, 0) is None


# --- JAX_LOG_SOURCES: jax/_src/distributed.py and jax/_src/profiler.py


def _record(path):
    import logging

    return logging.LogRecord("absl", logging.INFO, path, 1, "Connecting to %s", ("x",), None)


def test_jax_log_sources_resolve():
    from largebatch_jax import metrics

    site = Path(jax.__file__).resolve().parent.parent
    for source in private.JAX_LOG_SOURCES:
        text = (site / source.lstrip("/")).read_text()
        assert "logger = logging.getLogger(__name__)" in text and "logger.info(" in text
        assert not metrics._DropLibraryInfo().filter(_record(str(site) + source))


def test_jax_log_sources_moved_show_their_lines():
    """Fallback: a file jax moved matches nothing, and its INFO lines show."""
    from largebatch_jax import metrics

    moved = "/site-packages/jax/_src/distributed/client.py"
    assert not any(source in moved for source in private.JAX_LOG_SOURCES)
    assert metrics._DropLibraryInfo().filter(_record(moved))


# --- await_orbax_tmp_cleanup: CheckpointManager._maybe_await_cleanup_tmp_directory


def test_await_orbax_tmp_cleanup_resolves(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from largebatch_jax import checkpoint

    name = "_maybe_await_cleanup_tmp_directory"
    original, calls = getattr(ocp.CheckpointManager, name), []

    def spy(manager):
        calls.append(manager)
        return original(manager)

    monkeypatch.setattr(ocp.CheckpointManager, name, spy)
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", keep=2)
    assert calls == [ckpt.manager]  # the constructor waited
    assert private.await_orbax_tmp_cleanup(ckpt.manager) is True and len(calls) == 2
    ckpt.close()


def test_await_orbax_tmp_cleanup_falls_back_to_no_wait():
    assert private.await_orbax_tmp_cleanup(types.SimpleNamespace()) is False


# --- finish_grain_unlinks: SharedMemoryArray._del_thread_pool


@pytest.fixture
def shared_memory_array(monkeypatch):
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    for attribute in ("_del_thread_pool", "_outstanding_del_requests"):  # restored after
        monkeypatch.setattr(SharedMemoryArray, attribute, getattr(SharedMemoryArray, attribute))
    return SharedMemoryArray


def test_finish_grain_unlinks_resolves(shared_memory_array):
    from multiprocessing import shared_memory

    assert "_del_thread_pool" in vars(shared_memory_array)
    shared_memory_array.enable_async_del(num_threads=1)  # grain's pool, as its workers use
    assert shared_memory_array._del_thread_pool is not None
    array = shared_memory_array((4,), np.float32)
    name = array.shm.name
    array.unlink_on_del()
    del array  # its unlink goes to the pool
    assert private.finish_grain_unlinks() is True
    assert shared_memory_array._del_thread_pool is None
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    assert private.finish_grain_unlinks() is False  # no pool: nothing to wait for


@pytest.mark.parametrize("missing", ["module", "attribute"])
def test_finish_grain_unlinks_falls_back_to_no_wait(missing, shared_memory_array, monkeypatch):
    from largebatch_jax.data import loader

    shared_memory_array.enable_async_del(num_threads=1)
    if missing == "module":
        monkeypatch.setitem(sys.modules, "grain._src.python.ipc.shared_memory_array", None)
    else:
        pool = shared_memory_array._del_thread_pool
        monkeypatch.delattr(shared_memory_array, "_del_thread_pool")
        monkeypatch.setattr(shared_memory_array, "_outstanding_del_requests", None)
        pool.close()
    assert private.finish_grain_unlinks() is False
    loader._finish_unlinking()  # the caller goes on


# --- run_exit_handlers: atexit._run_exitfuncs


def test_run_exit_handlers_resolves():
    import atexit

    assert callable(atexit._run_exitfuncs)
    code = (
        "import atexit, os, sys\n"
        "from largebatch_jax import private\n"
        "atexit.register(print, 'handler ran')\n"
        "print(private.run_exit_handlers())\n"
        "sys.stdout.flush(); os._exit(0)\n"
    )
    out = _python(code)
    assert out.stdout.splitlines() == ["handler ran", "True"]


def test_run_exit_handlers_falls_back_to_none_run(monkeypatch):
    import atexit

    monkeypatch.delattr(atexit, "_run_exitfuncs")
    assert private.run_exit_handlers() is False


# --- the package uses private APIs only through private.py

# Uses still to move to private.py: (path, what); none.
PENDING: set[tuple[str, str]] = set()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> set[str]:
    """What `source` reaches of other code's private names: imports of private modules or
    names, underscore attributes of anything but self, cls and os (os._exit is public),
    getattr-style lookups of underscore names, and module paths with a private part."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if any(map(_is_private, node.module.split("."))) or any(
                _is_private(a.name) for a in node.names
            ):
                found.add(f"from {node.module} import")
        elif isinstance(node, ast.Import):
            found |= {
                f"import {a.name}" for a in node.names if any(map(_is_private, a.name.split(".")))
            }
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os")):
                found.add(ast.unparse(node))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "getattr",
            "hasattr",
            "setattr",
            "delattr",
        ):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and _is_private(str(name.value)):
                found.add(f"{ast.unparse(node.func)}(..., {name.value!r})")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"\S*[./]_[a-z]\S*", node.value)  # a path, not prose
        ):
            found.add(repr(node.value))
    return found


def test_the_scan_finds_each_kind_of_private_use():
    source = (
        "from jax._src import distributed\nimport jax._src.lib\nfrom atexit import _run\n"
        "atexit._run_exitfuncs()\ngetattr(m, '_x', None)\nf'{p}._versions'\n"
        "self._ok, cls._ok, os._exit(0), obj.__class__, getattr(m, '__doc__')\n"
        "x = '/jax/_src/profiler.py'\n"
    )
    assert private_uses(source) == {
        "from jax._src import",
        "import jax._src.lib",
        "from atexit import",
        "atexit._run_exitfuncs",
        "getattr(..., '_x')",
        "'._versions'",
        "'/jax/_src/profiler.py'",
    }


def test_no_module_but_private_py_uses_a_private_api():
    package = ROOT / "largebatch_jax"
    found = {
        (path.relative_to(ROOT).as_posix(), use)
        for path in sorted(package.rglob("*.py"))
        if path != package / "private.py"
        for use in private_uses(path.read_text())
    }
    assert found <= PENDING, f"move these to largebatch_jax/private.py: {found - PENDING}"


# --- docs/design.md's table


def test_the_design_table_names_every_entry_and_its_tests():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Private APIs", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
    named = {m for r in rows for m in re.findall(r"`private\.(\w+)", r)}
    entries = {
        n
        for n, v in vars(private).items()
        if not n.startswith("_")
        and getattr(v, "__module__", private.__name__) == private.__name__
        and (callable(v) or n.isupper())
        and n != "CUDA_PLUGINS"  # part of cuda_plugin_device_count
    }
    assert named == entries
    tests = {m for r in rows for m in re.findall(r"`(test_\w+)`", r)}
    mine = set(re.findall(r"^def (test_\w+)", Path(__file__).read_text(), re.M))
    assert tests and tests <= mine
    assert len(rows) == len(entries)
