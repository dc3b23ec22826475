"""Every use the project makes of its libraries' private APIs, one entry each: what it
reaches, why no public API does, the versions it was checked on and its fallback when
the private path is gone (the caller then degrades as the entry says, or the run stops
with a one-line error that names the path). tests/test_private.py checks, for each
entry, that it resolves on the installed versions (the real thing, not the fallback) and
that the fallback is what is taken when the private path is missing; docs/design.md
("Private APIs") has the table.

Checked on: jax and jaxlib 0.10.2 (this venv; the jax paths also in the source of jax
0.11.2, the GPU machine's), orbax-checkpoint 0.12.8, grain 0.2.18, jax-cuda12-plugin
0.10.2, Python 3.11.

Importing this module imports only the standard library and `largebatch_jax.errors`,
and changes nothing: each entry imports its library when called.
"""

from __future__ import annotations

import atexit
import gc
import importlib
from collections.abc import Callable
from typing import Any

from largebatch_jax.errors import LaunchError


def _module(name: str) -> Any:
    """The module `name`, or None where this version has none."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _jax_version() -> str:
    import jax

    return jax.__version__


def hlo_cost_analysis(module: Any) -> dict[str, float]:
    """XLA's HLO cost analysis of an HloModule ('flops', 'bytes accessed', ...), run by
    the CPU client (it analyses any backend's HLO).

    Reaches `jax._src.lib._jax.hlo_module_cost_analysis` (jaxlib's binding). No public
    API: `Compiled.cost_analysis` is the compiler's analysis, which the GPU compiler does
    not give, and `Lowered.cost_analysis` (which calls this binding) runs on the lowering's
    own backend, refuses a PJRT plugin's (the CUDA plugin, libtpu) and takes no HloModule
    of a compiled program (aot/programs.py's bytes). Checked on jax 0.10.2; jax 0.11.2's
    `Lowered.cost_analysis` calls it the same way.
    Fallback: {} (no FLOPs, no bytes accessed: the log shows no TFLOP/s or MFU, the AOT
    report no bytes; the rest stays)."""
    from jax.extend.backend import get_backend

    try:
        lib = importlib.import_module("jax._src.lib")
        return dict(lib._jax.hlo_module_cost_analysis(get_backend("cpu"), module))
    except (ImportError, AttributeError):
        return {}


def coordination_client() -> Any:
    """This process's client of JAX's coordination service (its key-value store and
    barriers: `key_value_set`, `blocking_key_value_get`, ...), or None in a run of one
    process (jax.distributed not started).

    Reaches `jax._src.distributed.global_state.client`. No public API: jax exposes the
    store to nothing but its own internals (`jax.experimental.multihost_utils` reaches it
    the same way). Checked on jax 0.10.2 and in the source of jax 0.11.2.
    Fallback: none can stand in (a run of several processes cannot check that they
    agree, nor agree on a stop step, without it): a LaunchError (exit code 2) naming the
    path and the installed jax. Callers ask only in a run of several processes."""
    try:
        return importlib.import_module("jax._src.distributed").global_state.client
    except (ImportError, AttributeError):
        raise LaunchError(
            f"jax {_jax_version()} has no jax._src.distributed.global_state.client, the "
            "coordination service's key-value store a run of several processes needs: "
            "install the jax of constraints.txt."
        ) from None


def _all_gather_invariant_missing(*args: Any, **kwargs: Any) -> Any:
    del args, kwargs
    raise LaunchError(
        f"reduction='exact' needs all_gather_invariant, which jax {_jax_version()} has "
        "neither as jax.lax.all_gather_invariant nor in jax._src.lax.parallel: run with "
        "--config.reduction=fast, or install the jax of constraints.txt."
    )


def all_gather_invariant() -> Callable[..., Any]:
    """JAX's all_gather_invariant (varying -> invariant: the gathered value is typed as
    the same on every device, so the exact sum's result needs no further collective).

    The public `jax.lax.all_gather_invariant` where this jax exports it, else the private
    `jax._src.lax.parallel.all_gather_invariant`: the same function either way (exact.py's
    bit-exact path). No public API yet: jax 0.10.2 and 0.11.2 define it but do not export
    it. Fallback when neither exists: a stand-in that raises a LaunchError (exit code 2)
    when a step calls it, naming reduction='fast', which does not use it; importing
    exact.py still works."""
    import jax

    public = getattr(jax.lax, "all_gather_invariant", None)
    if public is not None:
        return public
    private = getattr(_module("jax._src.lax.parallel"), "all_gather_invariant", None)
    return private if private is not None else _all_gather_invariant_missing


# The CUDA plugins whose private `_versions` module counts the GPUs, newest first.
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def cuda_plugin_device_count() -> int | None:
    """How many GPUs JAX's CUDA plugin sees on this host, whatever JAX was told to use
    (CUDA_VISIBLE_DEVICES applies; JAX_LOCAL_DEVICE_IDS does not).

    Reaches `jax_cuda1x_plugin._versions.cuda_device_count` (what the plugin itself calls
    before it starts). No public API: jax.devices() gives only the devices JAX was told
    to use, the very figure this is compared with. Checked on jax-cuda12-plugin 0.10.2.
    Fallback: None (also with no plugin or no driver): the check that a process drives
    all of its GPUs (cluster.check_gpus_used) says nothing."""
    for plugin in CUDA_PLUGINS:
        try:
            return int(importlib.import_module(f"{plugin}._versions").cuda_device_count())
        except Exception:  # not installed, no such module or function, or no driver
            continue
    return None


# The source files of JAX's INFO log lines that say nothing about a run: its
# distributed start (two per process) and its profiler (two per trace written). A log
# record tells its source only by the file's path (`LogRecord.pathname`, what the filter
# reads) or the logger's name: jax's private modules either way. Checked on jax 0.10.2
# and in the source of jax 0.11.2 (both log through `logging.getLogger(__name__)` there).
# Fallback when jax moves them: the paths match nothing and those INFO lines show in the
# log (nothing else changes).
JAX_LOG_SOURCES = ("/jax/_src/distributed.py", "/jax/_src/profiler.py")


def await_orbax_tmp_cleanup(manager: Any) -> bool:
    """Wait for the removal of a cut save's temporary directories, which an orbax
    `CheckpointManager` opened with `cleanup_tmp_directories=True` runs in a thread of
    its own (a run that stops at start-up would exit under it, and the thread would log
    an error). True: waited.

    Reaches `CheckpointManager._maybe_await_cleanup_tmp_directory`. No public API: the
    manager's `wait_until_finished` waits for saves only. Checked on orbax-checkpoint
    0.12.8. Fallback: False, nothing waited (a run stopping at start-up may log orbax's
    error from that thread; the next run removes what is left)."""
    wait = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if wait is None:
        return False
    wait()
    return True


def finish_grain_unlinks() -> bool:
    """Wait for grain to unlink the shared memory of the batches its worker processes
    made that the program dropped (grain does it in a thread pool of its own; at exit the
    resource tracker reports the unlinks still queued as leaked). Also collects garbage
    first, so that batches in reference cycles are dropped and their unlinks queued.
    The next prefetching iterator starts a new pool. True: a pool was waited for.

    Reaches `grain._src.python.ipc.shared_memory_array.SharedMemoryArray._del_thread_pool`.
    No public API: grain offers only `enable_async_del`, which starts the pool. Checked
    on grain 0.2.18. Fallback: False, nothing waited (the resource tracker may warn of
    leaked shared memory at exit; the memory is freed all the same)."""
    shared = _module("grain._src.python.ipc.shared_memory_array")
    array = getattr(shared, "SharedMemoryArray", None)
    pool = getattr(array, "_del_thread_pool", None)
    if pool is None:  # no such attribute, or no pool started
        return False
    gc.collect()  # batches in reference cycles: dropped now, their unlinks queued
    pool.close()
    pool.join()
    array._del_thread_pool = None
    return True


def run_exit_handlers() -> bool:
    """Run Python's exit handlers now (JAX's clean-up among them), before an `os._exit`
    that waits for no library thread. True: they ran.

    Reaches `atexit._run_exitfuncs`. No public API: only an interpreter exit runs them,
    and it first joins every non-daemon thread (orbax's, on a file system gone read-only,
    for up to its 300 s timeout). Checked on Python 3.11.
    Fallback: False, none ran (the process ends without JAX's clean-up: in a run of
    several processes, the others see it as lost)."""
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is None:
        return False
    run()
    return True
