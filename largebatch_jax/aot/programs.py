"""Our train and eval steps, and the Flax-example-style reference, compiled for a target
(a TPU slice or a GPU cluster) exactly as main.py would build them there, and what each
compiled program needs per device."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from largebatch_jax import builder, parallel
from largebatch_jax.aot import hlo
from largebatch_jax.aot.targets import Accelerator, Target
from largebatch_jax.plan import Facts, Plan, resolve
from largebatch_jax.utilization import counts_every_micro_step, hlo_cost, program_flops


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per device: what one step of a compiled program needs."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    collectives: list[hlo.Collective]
    compile_s: float
    audit: hlo.Audit
    # A chain of several programs (the exact step's, grouped.py): "name x runs" each, and
    # the one at which the most is live (its outputs and temporaries, with what the
    # caller holds then as the arguments). Empty for a single program.
    chain: tuple[str, ...] = ()
    peak: str = ""

    @property
    def memory_bytes(self) -> int:
        """Live at once: arguments, outputs not aliased to a donated argument, temps, code."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.code_bytes
        )

    def roofline_s(self, chip: Accelerator) -> float:
        """A lower bound on the step time: compute- or memory-bandwidth-bound, whichever is
        slower (communication and imperfect overlap only add)."""
        return max(self.flops / chip.peak_bf16_flops, self.bytes_accessed / chip.memory_bandwidth)


# Where the FLOPs and bytes come from, per platform (printed with the figures).
COST_SOURCES = {
    "tpu": "XLA's TPU compiler (cost analysis of the compiled program)",
    "cuda": (
        "XLA's HLO cost analysis run on this host: FLOPs of the program as lowered (before "
        "the GPU compiler, which reports none), bytes of the compiled GPU program's "
        "kernels at their fusion boundaries plus the operands and results of its "
        "library calls (cuDNN), which the analysis cannot see into"
    ),
}


def _gpu_cost(lowered: Any, compiled: Any, text: str) -> tuple[float, float]:
    """FLOPs and bytes accessed of a compiled GPU program (see COST_SOURCES['cuda'])."""
    flops = program_flops(lowered, compiled, "cuda")
    try:
        module = compiled.runtime_executable().hlo_modules()[0]
    except AttributeError:  # another jax: no bytes
        return float(flops), 0.0
    accessed = hlo_cost(module).get("bytes accessed", 0.0)
    if not accessed:
        return float(flops), 0.0
    program = hlo.parse(text)
    shapes = {ins.name: ins.shape for ins in program}
    for ins in program:
        if ins.opcode == "custom-call":  # the analysis counts each as -1 byte
            operands = sum(hlo.shape_bytes(shapes[o]) for o in ins.operands if o in shapes)
            accessed += 1 + hlo.shape_bytes(ins.shape) + operands
    return float(flops), float(accessed)


def analyse(
    lowered: parallel.LoweredChain, platform: str, options: dict[str, Any] | None = None
) -> Compiled:
    """Compile a lowered step (`DataParallel.map(...).lower`) and read its memory, cost
    and collective figures: of its one program, or of its chain of programs."""
    if len(lowered.programs) > 1:
        return _analyse_chain(lowered, platform, options)
    return analyse_program(lowered.programs[0].program, platform, options)


def analyse_program(lowered: Any, platform: str, options: dict[str, Any] | None = None) -> Compiled:
    """Compile one lowered program and read its memory, cost and collective figures."""
    began = time.perf_counter()
    compiled = lowered.compile(options or None)
    compile_s = time.perf_counter() - began
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if platform == "tpu":
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        flops = program_flops(lowered, compiled, platform)
        accessed = float(cost.get("bytes accessed", 0.0))
    else:
        flops, accessed = _gpu_cost(lowered, compiled, text)
    return Compiled(
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
        flops=flops,
        bytes_accessed=accessed,
        collectives=hlo.collectives(text),
        compile_s=compile_s,
        audit=hlo.audit(text),
    )


def _analyse_chain(
    chain: parallel.LoweredChain, platform: str, options: dict[str, Any] | None
) -> Compiled:
    """A step made of several programs run one after another (the exact mode's): FLOPs,
    bytes and collectives of every run added up; memory at the program where the most
    is live, counting what the caller holds meanwhile (`LoweredChain.held_bytes`)."""
    parts = [(p, analyse_program(p.program, platform, options)) for p in chain.programs]

    def live(part) -> int:
        p, c = part
        return chain.held_bytes[p.name] + c.output_bytes - c.alias_bytes + c.temp_bytes

    top, peak = max(parts, key=live)
    return Compiled(
        argument_bytes=chain.held_bytes[top.name],
        output_bytes=peak.output_bytes,
        alias_bytes=peak.alias_bytes,
        temp_bytes=peak.temp_bytes,
        code_bytes=sum(c.code_bytes for _, c in parts),
        flops=sum(p.runs * c.flops for p, c in parts),
        bytes_accessed=sum(p.runs * c.bytes_accessed for p, c in parts),
        collectives=[col for p, c in parts for _ in range(p.runs) for col in c.collectives],
        compile_s=sum(c.compile_s for _, c in parts),
        audit=hlo.merge_audits([(c.audit, p.runs) for p, c in parts]),
        chain=tuple(f"{p.name} x {p.runs}" for p, _ in parts),
        peak=top.name,
    )


# ------------------------------------------------------------------ the programs


@dataclasses.dataclass(frozen=True)
class Site:
    """Where programs compile: the target's devices as the engine's mesh, and the XLA
    options every compile there takes (the GPU compile's PTX assembler)."""

    target: Target
    engine: parallel.DataParallel
    options: dict[str, Any]

    @property
    def platform(self) -> str:
        return self.target.platform


def site(target: Target, options: dict[str, Any] | None = None) -> Site:
    engine = parallel.DataParallel(parallel.create_mesh(target.devices()))
    return Site(target, engine, dict(options or {}))


def batch_spec(engine: parallel.DataParallel, per_device: int, shape: Sequence[int], dtype) -> dict:
    """A global batch of `per_device` images per device, as shapes placed like
    `shard_batch` places them."""
    sharded = NamedSharding(engine.mesh, P(parallel.AXIS))
    n = per_device * engine.num_devices
    return {
        "image": jax.ShapeDtypeStruct((n, *shape), dtype, sharding=sharded),
        "label": jax.ShapeDtypeStruct((n,), np.int32, sharding=sharded),
    }


def plan_for(config: Any, where: Site) -> Plan:
    """The config's plan on the target's devices, with its dataset's known size (no data
    is loaded): every check main.py makes there, in one line."""
    return resolve(config, Facts(devices=where.engine.num_devices, platform=where.platform))


def _train_program(config: Any, plan: Plan, where: Site):
    training = builder.build_training(config, plan, where.engine, abstract=True)
    per_device = plan.micro_batch * plan.accum_steps
    batch = batch_spec(where.engine, per_device, training.input_shape, np.uint8)
    lowered = training.train_step.lower(training.state, batch)
    return training, analyse(lowered, where.platform, where.options)


def unrolled_cost(config: Any, plan: Plan, where: Site) -> tuple[float, float]:
    """FLOPs and bytes of an update of `accum_steps` micro-steps. XLA's cost analysis
    counts a loop body once, so the scanned program under-reports; the Python-unrolled
    program of A micro-steps costs C1 + (A - 1) (C2 - C1) (C1, C2: 1 and 2 micro-steps
    unrolled at the same micro-batch; every micro-step adds the same ops)."""
    costs = []
    for a in (1, 2):
        c = config.copy_and_resolve_references()
        c.accum_steps, c.accum_loop = a, "unroll"
        c.batch_size = plan.micro_batch * a * plan.devices
        costs.append(_train_program(c, plan_for(c, where), where)[1])
    a = plan.accum_steps
    one, two = costs
    return (
        one.flops + (a - 1) * (two.flops - one.flops),
        one.bytes_accessed + (a - 1) * (two.bytes_accessed - one.bytes_accessed),
    )


def compile_ours(config: Any, plan: Plan, where: Site) -> dict:
    """Our train and eval steps for `config` on the target, as main.py builds them there
    (memory and collectives of that program; its FLOPs and bytes from `unrolled_cost`
    where it loops over micro-steps)."""
    training, train = _train_program(config, plan, where)
    looped = not counts_every_micro_step(plan.reduction, plan.accum_steps, plan.accum_loop)
    if looped:
        flops, accessed = unrolled_cost(config, plan, where)
        train = dataclasses.replace(train, flops=flops, bytes_accessed=accessed)
    engine = where.engine
    eval_batch = batch_spec(engine, plan.eval_batch_per_device, training.input_shape, np.uint8)
    eval_batch["mask"] = jax.ShapeDtypeStruct(
        eval_batch["label"].shape, np.bool_, sharding=eval_batch["label"].sharding
    )
    evaluate = analyse(
        training.eval_step.lower(training.state, eval_batch), where.platform, where.options
    )
    return {"train": train, "eval": evaluate, "state": training.state, "extrapolated": looped}


def compile_reference(config: Any, where: Site, per_device: int) -> Compiled:
    """The Flax-example-style step (no accumulation) at `per_device` images per device."""
    from largebatch_jax.reference import build_reference

    engine = where.engine
    ref = build_reference(
        engine,
        per_device * engine.num_devices,
        config.image_size,
        config.num_classes,
        config.dtype,
        abstract=True,
    )
    batch = batch_spec(engine, per_device, ref.image_shape, np.float32)
    return analyse(ref.train_step.lower(ref.state, batch), where.platform, where.options)


def gradient_and_statistics_bytes(state: Any) -> int:
    """What the step's one all-reduce must carry: a gradient per parameter, the BN
    running statistics, and the loss and error scalars (float32)."""
    leaves = jax.tree.leaves((state.params, state.batch_stats))
    return sum(x.size * np.dtype(x.dtype).itemsize for x in leaves) + 2 * 4


def is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error)


def with_micro_batch(config: Any, devices: int, micro: int) -> Any:
    """`config` at `micro` images per device per micro-step, kn unchanged: the
    accum_steps that then make up kn (a ValueError where they cannot)."""
    if micro <= 0 or config.batch_size % (devices * micro):
        raise ValueError(
            f"per-device batch {micro}: batch_size={config.batch_size} is not a multiple of "
            f"{devices} devices x {micro}; choose a divisor of {config.batch_size // devices}."
        )
    config = config.copy_and_resolve_references()
    config.accum_steps = config.batch_size // (devices * micro)
    return config


def fits(config: Any, where: Site, micro: int) -> Compiled | None:
    """One micro-step of `micro` images per device, compiled; None if it does not fit."""
    config = config.copy_and_resolve_references()
    config.batch_size, config.accum_steps = micro * where.engine.num_devices, 1
    try:
        compiled = _train_program(config, plan_for(config, where), where)[1]
    except Exception as e:
        if is_out_of_memory(e):
            return None
        raise
    return compiled if compiled.memory_bytes <= where.target.chip.memory_bytes else None


def largest_micro_batch(config: Any, where: Site) -> int:
    """The largest per-device micro-batch, n x a power of two and at most kn / devices,
    whose train step fits the device's memory (each candidate compiled, doubling from n)."""
    ceiling = config.batch_size // where.engine.num_devices
    best, micro = 0, config.bn_group_size
    while micro <= ceiling:
        c = fits(config, where, micro)
        print(f"  {micro} images per device: " + ("fits" if c else "does not fit"), flush=True)
        if c is None:
            break
        best, micro = micro, micro * 2
    if not best:
        raise ValueError(
            f"bn_group_size={config.bn_group_size} images per device do not fit "
            f"{where.target.chip.name}'s memory: lower bn_group_size or image_size."
        )
    return best
