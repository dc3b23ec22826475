"""The exact train step as a chain of compiled programs: one run per BN group, then one
that sums the groups and one that updates (`reduction='exact'`, `step.make_train_step`).

Why not one program: a group of n images must round the same way in every layout (8
devices x 1 group, 4 x 2, 1 x 8). Inside one program XLA fuses a group's reductions with
whatever consumes them, and the consumers depend on the number of groups per device
(measured on XLA:CPU, which drops optimization barriers before fusing: BN statistics of 4
devices x 2 groups differed in the last bit from 8 x 1). A loop over the groups keeps them
apart, at a loop's price: XLA:CPU runs a model several times slower inside a loop body, and
the TPU compiler computed the forward pass twice. A program for one group of n images is
the same program in every layout, and its results are the program's outputs, into which
nothing can be fused.

Per step: `split` (only with several groups per device: pure copies), the group program
once per group, `mean` (the fixed tree over groups and devices) and `update` (the
optimizer, the norms), each once. `update` is a program of its own for the same reason
as `group`: its inputs and shapes are the same in every layout, so XLA may reduce in any
order it likes (the norms are XLA reductions) and still rounds the same everywhere.
`grouped_step` is this chain as the engine's `parallel.Chain`; `DataParallel.map` maps,
calls, lowers and compiles it like any step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from largebatch_jax.parallel import COPIES, REPLICATED, SPLIT, Chain, DataParallel, Stage


def whole_power_of_two_groups(per_device: int, group_size: int) -> bool:
    """Whether `per_device` images are a power-of-two number of whole BN groups: the tree
    over all k groups then splits into the devices' blocks for any device count (exact.py)."""
    groups = per_device // group_size
    return per_device % group_size == 0 and groups > 0 and groups & (groups - 1) == 0


def grouped_step(
    group_size: int,
    group: Callable[[Any, dict], Any],
    mean: Callable[[tuple], Any],
    update: Callable[[Any, Any], tuple[Any, dict]],
) -> Chain:
    """A per-device train step in programs. `group(state, batch)`: one BN group of
    `group_size` images (batch leaves [group_size, ...]) to that group's results, each
    leaf with a leading axis of 1. `mean(results)`: this device's groups' results, a
    tuple in group order, to their mean over all groups of all devices (replicated).
    `update(state, means)`: to (new state, metrics). With several groups per device a
    `split` program (copies only) cuts the device's batch into them first."""

    def drive(call: Callable[..., Any], state: Any, batch: dict, per_device: int) -> Any:
        groups = groups_per_device(per_device, group_size)
        parts = call("split", batch) if groups > 1 else (batch,)
        return call("update", state, call("mean", tuple(call("group", state, p) for p in parts)))

    stages = {
        "split": Stage(_split(group_size), (SPLIT,), SPLIT),
        "group": Stage(group, (REPLICATED, SPLIT), SPLIT),
        "mean": Stage(mean, (SPLIT,), COPIES),
        "update": Stage(update, (REPLICATED, COPIES), REPLICATED, takes_state=True),
    }
    return Chain(stages, drive, _held_bytes)


def groups_per_device(per_device: int, group_size: int) -> int:
    groups = per_device // group_size
    if not whole_power_of_two_groups(per_device, group_size):
        raise ValueError(
            "reduction='exact' needs a power-of-two number of BN groups per device, not "
            f"{per_device / group_size:g} ({per_device} images / "
            f"bn_group_size={group_size})."
        )
    return groups


def _split(group_size: int) -> Callable[[dict], tuple]:
    """Per device: the batch -> a tuple of its groups' batches, in order (copies only)."""

    def split(batch: dict) -> tuple:
        groups = jax.tree.leaves(batch)[0].shape[0] // group_size
        return tuple(
            jax.tree.map(lambda x, i=i: x[i * group_size : (i + 1) * group_size], batch)
            for i in range(groups)
        )

    return split


def _device_bytes(tree: Any, engine: DataParallel) -> int:
    """Per device bytes of global values placed replicated or split along axis 0."""
    total = 0
    for x in jax.tree.leaves(tree):
        size = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        sharding = getattr(x, "sharding", None)
        replicated = sharding is not None and sharding.is_fully_replicated
        total += size if replicated else size // engine.num_devices
    return total


def _held_bytes(
    engine: DataParallel, state: Any, batch: Any, outputs: dict[str, Any], runs: dict[str, int]
) -> dict[str, int]:
    """What the caller holds while each program runs: the state, the batch, its groups
    and the groups' results so far (at the last group), or the means."""
    parts = outputs.get("split", (batch,))
    held = _device_bytes(state, engine) + _device_bytes(batch, engine)
    held += _device_bytes(parts, engine) if len(parts) > 1 else 0
    one = _device_bytes(outputs["group"], engine)
    groups = runs["group"]
    return {
        "split": held,
        "group": held + (groups - 1) * one,
        "mean": held + groups * one,
        "update": held + _device_bytes(outputs["mean"], engine),
    }
