"""The data-parallel engine: one per-device function, run on every device of every process.

The per-device function (train.py) sees one device's share of the global minibatch and
communicates only through named collectives on `AXIS`. The engine maps it over a 1-D
mesh of devices, either with `jax.shard_map` inside `jax.jit` (default) or `jax.pmap`;
both take the same replicated state and the same global batch and return the same
(replicated) results, so nothing downstream knows which one ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
PARALLELISMS = ("shard_map", "pmap")


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
    """A 1-D mesh over all devices of all processes, in `jax.devices()` order (process-major,
    so each process's devices hold a contiguous share of every global batch)."""
    devices = list(jax.devices() if devices is None else devices)
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

    def shard_batch(self, local_batch: Any) -> Any:
        """This process's contiguous share of the global batch -> one global array.

        `local_batch` leaves are [local_devices * per_device, ...] in device order. The
        pmap path gets a leading device axis, [devices, per_device, ...].
        """

        def put(x):
            x = np.asarray(x)
            if self.parallelism == "pmap":
                x = x.reshape(self.num_local_devices, -1, *x.shape[1:])
            global_shape = (x.shape[0] * self.num_devices // self.num_local_devices, *x.shape[1:])
            return jax.make_array_from_process_local_data(self.sharded, x, global_shape)

        return jax.tree.map(put, local_batch)

    def map(self, per_device_fn: Callable, donate_state: bool = False) -> Callable:
        """Run `per_device_fn(state, batch)` on every device: state replicated, batch split
        along its leading axis; outputs must be reduced over AXIS (they are replicated)."""
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
        return jax.jit(mapped, donate_argnums=donate)
