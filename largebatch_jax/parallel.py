"""The data-parallel engine: a step's per-device programs, run on every device of every
process.

A step (step.py) is a `Chain` of per-device programs run one after another: one program
for the fast step, the exact step's split, group, mean and update (grouped.py). Each
program sees one device's share of the global minibatch and communicates only through
named collectives on `AXIS`. The engine maps every program over a 1-D mesh of devices,
either with `jax.shard_map` inside `jax.jit` (default) or `jax.pmap`, in one place
(`DataParallel.program`); both take the same replicated state and the same global batch
and return the same (replicated) results, so nothing downstream knows which one ran. A
mapped chain is called, lowered and compiled like one jitted function.
"""

from __future__ import annotations

import collections
import dataclasses
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

# How a program's argument or result lies across the devices: split along its leading
# axis, replicated, or per-device copies of one value handed from program to program in
# a chain (jax.pmap maps at least one argument of every program: it hands them as a
# device axis; shard_map as a replicated value).
SPLIT, REPLICATED, COPIES = "split", "replicated", "copies"
_PMAP_AXES = {SPLIT: 0, COPIES: 0, REPLICATED: None}
_SHARD_SPECS = {SPLIT: P(AXIS), COPIES: P(), REPLICATED: P()}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One per-device program of a step: `fn`, how each of its arguments (`ins`) and its
    result (`out`) lie across the devices, and whether its first argument is the state
    it replaces (donated where the engine maps the step with `donate_state`)."""

    fn: Callable
    ins: tuple[str, ...]
    out: str
    takes_state: bool = False


Drive = Callable[[Callable[..., Any], Any, Any, int], Any]


@dataclasses.dataclass(frozen=True)
class Chain:
    """A per-device step as programs run one after another. `stages`: the programs by
    name. `drive(call, state, batch, per_device)`: runs them, `call(name, *args)` for
    each run, `per_device` the images of the batch on each device; returns what the step
    returns. `held(engine, state, batch, outputs, runs)`: per device, the bytes the
    caller holds while each program runs (for the memory of a compiled chain); None for
    one program. `Chain.of(fn)` is a one-program step `fn(state, batch)`."""

    stages: Mapping[str, Stage]
    drive: Drive
    held: Callable[..., dict[str, int]] | None = None

    @classmethod
    def of(cls, fn: Callable, takes_state: bool = True) -> Chain:
        return cls({"step": Stage(fn, (REPLICATED, SPLIT), REPLICATED, takes_state)}, _drive_one)


def _drive_one(call: Callable[..., Any], state: Any, batch: Any, per_device: int) -> Any:
    del per_device
    return call("step", state, batch)


@dataclasses.dataclass(frozen=True)
class ChainProgram:
    """One program of a lowered or compiled chain and how many times a step runs it."""

    name: str
    program: Any  # a jax Lowered or Compiled
    runs: int


@dataclasses.dataclass(frozen=True)
class CompiledChain:
    """A compiled chain: called like the step it was lowered from."""

    chain: Chain
    per_device: Callable[[Any], int]
    programs: list[ChainProgram]

    def __call__(self, state: Any, batch: Any) -> Any:
        by_name = {p.name: p.program for p in self.programs}
        return self.chain.drive(
            lambda name, *args: by_name[name](*args), state, batch, self.per_device(batch)
        )

    def as_text(self) -> str:
        return "\n".join(p.program.as_text() for p in self.programs)


@dataclasses.dataclass(frozen=True)
class LoweredChain:
    """A lowered chain: its programs in the order of their first run, and `held_bytes`
    (see `Chain.held`; empty for one program)."""

    chain: Chain
    per_device: Callable[[Any], int]
    programs: list[ChainProgram]
    held_bytes: dict[str, int]

    def as_text(self) -> str:
        return "\n".join(p.program.as_text() for p in self.programs)

    def compile(self, compiler_options: Mapping[str, Any] | None = None) -> CompiledChain:
        compiled = [
            dataclasses.replace(p, program=p.program.compile(compiler_options))
            for p in self.programs
        ]
        return CompiledChain(self.chain, self.per_device, compiled)


class MappedChain:
    """A chain mapped over an engine's devices: call it as `(state, batch) -> result`, or
    `lower` it for a given state and batch (shapes or arrays)."""

    def __init__(self, chain: Chain, engine: DataParallel, programs: Mapping[str, Callable]):
        self.chain, self.engine, self.programs = chain, engine, dict(programs)

    def __call__(self, state: Any, batch: Any) -> Any:
        return self.chain.drive(
            lambda name, *args: self.programs[name](*args),
            state,
            batch,
            self.engine.per_device(batch),
        )

    def lower(self, state: Any, batch: Any) -> LoweredChain:
        """Each program lowered once, for the arguments of its first run (every run of a
        program takes the same shapes), the next one's from its results' shapes."""
        lowered: dict[str, Any] = {}
        runs: collections.Counter[str] = collections.Counter()

        def call(name: str, *args: Any) -> Any:
            if name not in lowered:
                lowered[name] = self.programs[name].lower(*args)
            runs[name] += 1
            return lowered[name].out_info

        self.chain.drive(call, state, batch, self.engine.per_device(batch))
        programs = [ChainProgram(name, lowered[name], runs[name]) for name in lowered]
        held = {}
        if self.chain.held is not None:
            outputs = {name: lowered[name].out_info for name in lowered}
            held = self.chain.held(self.engine, state, batch, outputs, dict(runs))
        return LoweredChain(self.chain, self.engine.per_device, programs, held)


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

    def per_device(self, batch: Any) -> int:
        """Images of a global batch (as `shard_batch` places it) on each device."""
        leaf = jax.tree.leaves(batch)[0]
        if self.parallelism == "pmap":
            return leaf.shape[1]
        return leaf.shape[0] // self.num_devices

    def program(
        self, stage: Stage, donate: bool = False, compiler_options: Mapping[str, Any] | None = None
    ) -> Callable:
        """One program of a step mapped over the devices: `jax.pmap`, or `jax.shard_map`
        inside `jax.jit` with XLA's `compiler_options`; `donate`: its first argument."""
        donated = (0,) if donate else ()
        if self.parallelism == "pmap":
            return jax.pmap(
                stage.fn,
                axis_name=AXIS,
                in_axes=tuple(_PMAP_AXES[i] for i in stage.ins),
                out_axes=_PMAP_AXES[stage.out],
                devices=list(self.mesh.devices.flat),
                donate_argnums=donated,
            )
        mapped = jax.shard_map(
            stage.fn,
            mesh=self.mesh,
            in_specs=tuple(_SHARD_SPECS[i] for i in stage.ins),
            out_specs=_SHARD_SPECS[stage.out],
        )
        options = dict(compiler_options or {}) or None
        return jax.jit(mapped, donate_argnums=donated, compiler_options=options)

    def map(
        self,
        step: Chain,
        donate_state: bool = False,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> MappedChain:
        """Run a step's programs on every device: state replicated, batch split along its
        leading axis; a program's replicated results must be reduced over AXIS.
        `donate_state`: the programs that take the state give its buffers to the new one.
        `compiler_options`: XLA options compiled into every program (`jax.jit`'s)."""
        if self.parallelism == "pmap" and compiler_options:
            raise ValueError(
                f"parallelism='pmap' cannot compile with XLA options {dict(compiler_options)}"
                " (the exact mode on GPU needs them): use parallelism='shard_map'."
            )
        programs = {
            name: self.program(stage, donate_state and stage.takes_state, compiler_options)
            for name, stage in step.stages.items()
        }
        return MappedChain(step, self, programs)
