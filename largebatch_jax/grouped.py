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
`GroupedProgram` is what `DataParallel.map` returns for a `GroupedStep`; like a jitted
function it is called, lowered and compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from largebatch_jax.parallel import AXIS, DataParallel


def whole_power_of_two_groups(per_device: int, group_size: int) -> bool:
    """Whether `per_device` images are a power-of-two number of whole BN groups: the tree
    over all k groups then splits into the devices' blocks for any device count (exact.py)."""
    groups = per_device // group_size
    return per_device % group_size == 0 and groups > 0 and groups & (groups - 1) == 0


@dataclasses.dataclass(frozen=True)
class GroupedStep:
    """A per-device train step in three functions. `group(state, batch)`: one BN group
    of `group_size` images (batch leaves [group_size, ...]) to that group's results, each
    leaf with a leading axis of 1. `mean(results)`: this device's groups' results, a
    tuple in group order, to their mean over all groups of all devices (replicated).
    `update(state, means)`: to (new state, metrics)."""

    group_size: int
    group: Callable[[Any, dict], Any]
    mean: Callable[[tuple], Any]
    update: Callable[[Any, Any], tuple[Any, dict]]

    def groups_per_device(self, per_device: int) -> int:
        groups = per_device // self.group_size
        if not whole_power_of_two_groups(per_device, self.group_size):
            raise ValueError(
                "reduction='exact' needs a power-of-two number of BN groups per device, not "
                f"{per_device / self.group_size:g} ({per_device} images / "
                f"bn_group_size={self.group_size})."
            )
        return groups

    def map_with(
        self,
        engine: DataParallel,
        donate_state: bool = False,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> GroupedProgram:
        return GroupedProgram(self, engine, donate_state, compiler_options)


def _split(group_size: int) -> Callable[[dict], tuple]:
    """Per device: the batch -> a tuple of its groups' batches, in order (copies only)."""

    def split(batch: dict) -> tuple:
        groups = jax.tree.leaves(batch)[0].shape[0] // group_size
        return tuple(
            jax.tree.map(lambda x, i=i: x[i * group_size : (i + 1) * group_size], batch)
            for i in range(groups)
        )

    return split


class GroupedProgram:
    """A `GroupedStep` mapped over an engine's devices: call it as `(state, batch) ->
    (state, metrics)`, or `lower` it for a given state and batch."""

    def __init__(
        self,
        step: GroupedStep,
        engine: DataParallel,
        donate_state: bool,
        compiler_options: Mapping[str, Any] | None,
    ):
        self.step, self.engine = step, engine
        donate = (0,) if donate_state else ()
        options = dict(compiler_options or {}) or None
        split = _split(step.group_size)
        if engine.parallelism == "pmap":
            devices = list(engine.mesh.devices.flat)
            self.split = jax.pmap(split, AXIS, in_axes=0, out_axes=0, devices=devices)
            self.group = jax.pmap(step.group, AXIS, in_axes=(None, 0), out_axes=0, devices=devices)
            # pmap maps at least one argument: the means travel as one copy per device.
            self.mean = jax.pmap(step.mean, AXIS, in_axes=0, out_axes=0, devices=devices)
            self.update = jax.pmap(
                step.update,
                AXIS,
                in_axes=(None, 0),
                out_axes=None,
                devices=devices,
                donate_argnums=donate,
            )
            return
        mesh = engine.mesh
        self.split = jax.jit(
            jax.shard_map(split, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)),
            compiler_options=options,
        )
        self.group = jax.jit(
            jax.shard_map(step.group, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS)),
            compiler_options=options,
        )
        self.mean = jax.jit(
            jax.shard_map(step.mean, mesh=mesh, in_specs=P(AXIS), out_specs=P()),
            compiler_options=options,
        )
        self.update = jax.jit(
            jax.shard_map(step.update, mesh=mesh, in_specs=(P(), P()), out_specs=P()),
            donate_argnums=donate,
            compiler_options=options,
        )

    def groups(self, batch: dict) -> int:
        leaf = jax.tree.leaves(batch)[0]
        pmap = self.engine.parallelism == "pmap"
        per_device = leaf.shape[1] if pmap else leaf.shape[0] // self.engine.num_devices
        return self.step.groups_per_device(per_device)

    def __call__(self, state: Any, batch: dict) -> tuple[Any, dict]:
        programs = (self.split, self.group, self.mean, self.update)
        return _run(*programs, self.groups(batch), state, batch)

    def lower(self, state: Any, batch: dict) -> LoweredGroups:
        groups = self.groups(batch)
        programs = []
        parts: tuple = (batch,)
        if groups > 1:
            split = self.split.lower(batch)
            parts = split.out_info
            programs.append(Program("split", split, 1))
        group = self.group.lower(state, parts[0])
        mean = self.mean.lower((group.out_info,) * groups)
        update = self.update.lower(state, mean.out_info)
        programs += [
            Program("group", group, groups),
            Program("mean", mean, 1),
            Program("update", update, 1),
        ]
        held = _held_bytes(self.engine, state, batch, parts, group.out_info, mean.out_info)
        return LoweredGroups(programs, held)


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the chain and how many times a step runs it."""

    name: str
    program: Any  # a jax Lowered or Compiled
    runs: int


def _run(split, group, mean, update, groups: int, state: Any, batch: dict):
    parts = split(batch) if groups > 1 else (batch,)
    return update(state, mean(tuple(group(state, part) for part in parts)))


@dataclasses.dataclass(frozen=True)
class LoweredGroups:
    """The lowered chain. `held_bytes[name]`: per device, the bytes the caller holds while
    that program runs (the state, the batch, its groups and the groups' results so far),
    which its own memory analysis does not count unless they are its arguments."""

    programs: list[Program]
    held_bytes: dict[str, int]

    def as_text(self) -> str:
        return "\n".join(p.program.as_text() for p in self.programs)

    def compile(self, compiler_options: Mapping[str, Any] | None = None) -> CompiledGroups:
        compiled = [
            dataclasses.replace(p, program=p.program.compile(compiler_options))
            for p in self.programs
        ]
        return CompiledGroups(compiled)


@dataclasses.dataclass(frozen=True)
class CompiledGroups:
    """The compiled chain: called like the step it was lowered from."""

    programs: list[Program]

    def __call__(self, state: Any, batch: dict) -> tuple[Any, dict]:
        by_name = {p.name: p for p in self.programs}
        split, group = by_name.get("split"), by_name["group"]
        mean, update = by_name["mean"].program, by_name["update"].program
        split = split and split.program
        return _run(split, group.program, mean, update, group.runs, state, batch)

    def as_text(self) -> str:
        return "\n".join(p.program.as_text() for p in self.programs)


def _device_bytes(tree: Any, engine: DataParallel) -> int:
    """Per device bytes of global values placed replicated or split along axis 0."""
    total = 0
    for x in jax.tree.leaves(tree):
        size = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        sharding = getattr(x, "sharding", None)
        replicated = sharding is not None and sharding.is_fully_replicated
        total += size if replicated else size // engine.num_devices
    return total


def _held_bytes(engine: DataParallel, state, batch, parts, results, means) -> dict[str, int]:
    """What the caller holds while each program runs (see LoweredGroups)."""
    held = _device_bytes(state, engine) + _device_bytes(batch, engine)
    held += _device_bytes(parts, engine) if len(parts) > 1 else 0
    one = _device_bytes(results, engine)
    return {
        "split": held,
        "group": held + (len(parts) - 1) * one,  # at the last group
        "mean": held + len(parts) * one,
        "update": held + _device_bytes(means, engine),
    }
