"""The data-parallel engine: one per-device function, run on every device of every process.

The per-device function (step.py) sees one device's share of the global minibatch and
communicates only through named collectives on `AXIS`. The engine maps it over a 1-D
mesh of devices, either with `jax.shard_map` inside `jax.jit` (default) or `jax.pmap`;
both take the same replicated state and the same global batch and return the same
(replicated) results, so nothing downstream knows which one ran.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from queue import Queue
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
PARALLELISMS = ("shard_map", "pmap")
ACCUM_LOOPS = ("scan", "unroll")


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def is_gpu(platform: str) -> bool:
    """Whether a platform name (a device's, or an ahead-of-time target's) is a GPU."""
    return platform in GPU_PLATFORMS


def resolve_accum_loop(accum_loop: str, backend: str) -> str:
    """'auto': a Python loop on CPU, `lax.scan` elsewhere. XLA:CPU runs the model several
    times slower inside a while loop (the lowering of scan) than as straight-line code:
    measured here on ResNet-8 (kn=256, 14x14, 1 device), 290-520 ms per step under a
    length-1 scan against 44-65 ms without it. On GPU/TPU the scan keeps compile time
    independent of accum_steps (kn=8k on 8 GPUs accumulates 32 micro-steps)."""
    if accum_loop != "auto":
        return accum_loop
    return "unroll" if backend == "cpu" else "scan"


def micro_batch_size(
    batch_size: int, num_devices: int, accum_steps: int, bn_group_size: int
) -> int:
    """Images per device per micro-step: kn / (devices * accum_steps), in whole BN groups.

    Raises a ValueError naming the field and the numbers when kn does not divide.
    """
    for field, value in (
        ("batch_size", batch_size),
        ("num_devices", num_devices),
        ("accum_steps", accum_steps),
        ("bn_group_size", bn_group_size),
    ):
        if not isinstance(value, int | np.integer) or value <= 0:
            raise ValueError(f"{field}={value!r} must be a positive integer.")
    per_step = num_devices * accum_steps
    if batch_size % per_step:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by devices x accum_steps = "
            f"{num_devices} x {accum_steps} = {per_step}."
        )
    micro = batch_size // per_step
    if bn_group_size > micro:
        raise ValueError(
            f"bn_group_size={bn_group_size} is larger than the per-device micro-batch {micro} "
            f"(batch_size={batch_size} / ({num_devices} devices x {accum_steps} accum_steps)): "
            "lower bn_group_size or accum_steps."
        )
    if micro % bn_group_size:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by devices x accum_steps x "
            f"bn_group_size = {num_devices} x {accum_steps} x {bn_group_size}."
        )
    return micro


def create_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over all devices of all processes, ordered by (process, device id), so
    that process p's devices hold the p-th contiguous share of every global batch, the
    share `data.loader.process_share` gives it."""
    devices = sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    )
    return Mesh(np.array(devices), (AXIS,))


class DataParallel:
    """Places state and batches on a mesh and maps per-device functions over it."""

    def __init__(self, mesh: Mesh, parallelism: str = "shard_map"):
        if parallelism not in PARALLELISMS:
            raise ValueError(f"parallelism={parallelism!r} is not one of {PARALLELISMS}.")
        if mesh.axis_names != (AXIS,):
            raise ValueError(f"mesh axes {mesh.axis_names} must be ({AXIS!r},).")
        self.mesh = mesh
        self.parallelism = parallelism
        self.replicated = NamedSharding(mesh, P())
        self.sharded = NamedSharding(mesh, P(AXIS))

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def num_local_devices(self) -> int:
        return len(self.mesh.local_devices)

    def replicate(self, tree: Any) -> Any:
        """The same value on every device (every process must pass the same value)."""
        return jax.device_put(tree, self.replicated)

    def abstract_replicated(self, tree: Any) -> Any:
        """Shapes and dtypes of `tree` placed as `replicate` places it (for lowering)."""
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), tree
        )

    def shard_batch(self, local_batch: Any) -> Any:
        """This process's contiguous share of the global batch -> one global array.

        `local_batch` leaves are [local_devices * per_device, ...] in device order. The
        pmap path gets a leading device axis, [devices, per_device, ...]. Annotated
        `host_to_device` in a profile.
        """

        def put(x):
            x = np.asarray(x)
            if self.parallelism == "pmap":
                x = x.reshape(self.num_local_devices, -1, *x.shape[1:])
            global_shape = (x.shape[0] * self.num_devices // self.num_local_devices, *x.shape[1:])
            return jax.make_array_from_process_local_data(self.sharded, x, global_shape)

        with jax.profiler.TraceAnnotation("host_to_device"):
            return jax.tree.map(put, local_batch)

    def prefetch(self, local_batches: Iterator[Any], size: int = 2) -> Iterator[Any]:
        """`shard_batch` of the next `size` batches in a background thread, so that the
        host-to-device copy of batch t+1 overlaps the step on batch t. Yields
        (global batch, whatever else the iterator yields alongside it) unchanged in order;
        the iterator's items are (local_batch, extra) pairs."""
        queue: Queue = Queue(maxsize=max(1, size))
        done = object()

        def produce():
            try:
                for local, extra in local_batches:
                    queue.put((self.shard_batch(local), extra))
            except BaseException as e:  # re-raised in the consumer
                queue.put(e)
            queue.put(done)

        threading.Thread(target=produce, daemon=True).start()
        while (item := queue.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item

    def map(
        self,
        per_device_fn: Callable,
        donate_state: bool = False,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> Callable:
        """Run `per_device_fn(state, batch)` on every device: state replicated, batch split
        along its leading axis; outputs must be reduced over AXIS (they are replicated).
        `compiler_options`: XLA options compiled into the program (`jax.jit`'s)."""
        if self.parallelism == "pmap" and compiler_options:
            raise ValueError(
                f"parallelism='pmap' cannot compile with XLA options {dict(compiler_options)}"
                " (the exact mode on GPU needs them): use parallelism='shard_map'."
            )
        if hasattr(per_device_fn, "map_with"):  # a chain of programs (grouped.GroupedStep)
            return per_device_fn.map_with(self, donate_state, compiler_options)
        donate = (0,) if donate_state else ()
        if self.parallelism == "pmap":
            return jax.pmap(
                per_device_fn,
                axis_name=AXIS,
                in_axes=(None, 0),
                out_axes=None,
                devices=list(self.mesh.devices.flat),
                donate_argnums=donate,
            )
        mapped = jax.shard_map(
            per_device_fn, mesh=self.mesh, in_specs=(P(), P(AXIS)), out_specs=P()
        )
        return jax.jit(
            mapped, donate_argnums=donate, compiler_options=dict(compiler_options or {}) or None
        )
