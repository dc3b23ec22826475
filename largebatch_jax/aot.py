"""Compile the real train and eval steps for a Cloud TPU slice on any CPU host.

    pip install -e '.[tpu]'      # libtpu, the TPU compiler (pinned through jax's tpu extra)
    python -m largebatch_jax.aot --config=configs/imagenet_8k.py --topology=v5e-256
    python -m largebatch_jax.aot --config=configs/imagenet_8k.py --topology=v4-512 \\
        --config.dtype=bfloat16 --reference
    python -m largebatch_jax.aot --config=configs/imagenet_8k.py --topology=v5e-32 \\
        --per_chip_batch=max

JAX describes the slice's devices without any TPU (`jax.experimental.topologies`), the
shared builder wires the config exactly as main.py would on that slice (mesh over the
slice's chips, backend-dependent choices such as `accum_loop` resolved for TPU), and XLA's
TPU compiler reports what the program needs per chip: memory against the chip's HBM,
FLOPs, bytes accessed and every collective. From those, a roofline lower bound on the
step time, max(FLOPs / peak, bytes / HBM bandwidth), and so an upper bound on images/s.
`--reference` compiles the Flax-example-style step (`largebatch_jax.reference`) on the
same slice at the same per-chip batch, side by side.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

# A CPU host compiles for the TPU: the TPU plugin must not look for local chips or the
# GCE metadata server, nor lock out other compiling processes (it takes a host-wide lock
# meant for processes that share real chips). Set before jax or libtpu load.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from largebatch_jax import builder, parallel


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's published per-chip figures."""

    name: str
    peak_bf16_flops: float  # FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: int
    cores_per_chip: int  # slice names count TensorCores (v4-512 = 256 chips)
    chip_config: str  # get_topology_desc's chip_config_name
    dims: int  # 2-D (v5e) or 3-D (v4, v5p) torus
    topology_prefix: str


CHIPS = {
    "v4": Chip("TPU v4", 275e12, 1.2e12, 32 * 2**30, 2, "megacore", 3, "v4"),
    "v5e": Chip("TPU v5e", 197e12, 819e9, 16 * 2**30, 1, "default", 2, "v5e"),
    "v5p": Chip("TPU v5p", 459e12, 2.76e12, 95 * 2**30, 2, "megacore", 3, "v5"),
}
_ALIASES = {"v5litepod": "v5e", "v5": "v5p"}


@dataclasses.dataclass(frozen=True)
class Slice:
    chip: Chip
    shape: tuple[int, ...]  # chips along each torus axis

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def topology_name(self) -> str:
        return f"{self.chip.topology_prefix}:{'x'.join(map(str, self.shape))}"


def slice_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The usual torus of a slice of `chips` chips: start from one host's 2x2 and double
    the shortest axis (v5e-256 -> 16x16, v4-512 = 256 chips -> 4x8x8)."""
    if chips < 4 or chips & (chips - 1):
        raise ValueError(f"a slice of {chips} chips: use a power of two >= 4.")
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        shape[shape.index(min(shape))] *= 2
        shape.sort()
    return tuple(shape) if dims == 2 else tuple(sorted(shape[:2]) + shape[2:])


def parse_topology(text: str) -> Slice:
    """'v5e-256', 'v4-512', 'v5p-128' (slice names: v5e counts chips, v4/v5p count
    TensorCores) or a torus 'v5e:4x8', 'v4:4x8x8', 'v5p:2x2x1' (chips per axis)."""
    m = re.fullmatch(r"(v\w+?)([-:])(\d+(?:x\d+)*)", text.strip().lower())
    generation = _ALIASES.get(m.group(1), m.group(1)) if m else None
    if generation not in CHIPS:
        raise ValueError(
            f"--topology={text!r} is not a TPU slice: write e.g. v5e-256, v4-512, v5p-128, "
            f"v5e:4x8 or v4:4x8x8 (generations: {', '.join(CHIPS)})."
        )
    chip = CHIPS[generation]
    if m.group(2) == "-":
        cores = int(m.group(3))
        if cores % chip.cores_per_chip:
            raise ValueError(f"--topology={text!r}: {chip.name} slices count 2 cores per chip.")
        return Slice(chip, slice_shape(cores // chip.cores_per_chip, chip.dims))
    shape = tuple(int(d) for d in m.group(3).split("x"))
    if len(shape) != chip.dims:
        raise ValueError(f"--topology={text!r}: a {chip.name} torus has {chip.dims} axes.")
    return Slice(chip, shape)


def topology_devices(tpu: Slice) -> list:
    """The slice's devices as JAX describes them on a host that has none of them."""
    from jax.experimental import topologies

    dims = tpu.shape + (1,) * (3 - len(tpu.shape))
    # Torus links: a 3-D slice wraps an axis of 4 or more chips; a v5e slice only wraps
    # the full pod's 16-chip axes (libtpu rejects wrap on a v5e:4x8).
    if tpu.chip.dims == 3:
        wrap = tuple(d >= 4 for d in dims)
    else:
        wrap = (dims[0] == 16, dims[1] == 16, False)
    desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=tpu.topology_name,
        chip_config_name=tpu.chip.chip_config,
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
        wrap=wrap,
    )
    return list(desc.devices)


# ------------------------------------------------------------------ what XLA reports

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape, e.g. '(f32[64]{0}, bf16[3,3]{1,0})'."""
    return sum(
        _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # the data it delivers (an async start's result, not its operand copy)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of a compiled (optimised) HLO module, in program order."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        shape = m.group("shape")
        if m.group("start") and m.group("kind") != "all-reduce" and shape.startswith("(("):
            shape = shape[shape.index(")") + 1 :]  # ((operands), result, ...): the result
        found.append(Collective(m.group("kind"), shape_bytes(shape)))
    return found


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per chip: what one step of a compiled program needs."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    collectives: list[Collective]
    compile_s: float

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

    def roofline_s(self, chip: Chip) -> float:
        """A lower bound on the step time: compute- or HBM-bandwidth-bound, whichever is
        slower (communication and imperfect overlap only add)."""
        return max(self.flops / chip.peak_bf16_flops, self.bytes_accessed / chip.hbm_bandwidth)


def analyse(lowered: Any) -> Compiled:
    """Compile a lowered program and read XLA's memory, cost and collective figures."""
    began = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - began
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return Compiled(
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collectives=collectives(compiled.as_text()),
        compile_s=compile_s,
    )


def is_out_of_memory(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error)


# ------------------------------------------------------------------ the programs


def batch_spec(engine: parallel.DataParallel, per_chip: int, shape: Sequence[int], dtype) -> dict:
    """A global batch of `per_chip` images per chip, as shapes placed like `shard_batch`."""
    sharded = NamedSharding(engine.mesh, P(parallel.AXIS))
    n = per_chip * engine.num_devices
    return {
        "image": jax.ShapeDtypeStruct((n, *shape), dtype, sharding=sharded),
        "label": jax.ShapeDtypeStruct((n,), np.int32, sharding=sharded),
    }


def _train_program(config: Any, engine: parallel.DataParallel, steps_per_epoch: int):
    training = builder.build_training(
        config, engine, steps_per_epoch, platform="tpu", abstract=True
    )
    per_chip = config.batch_size // engine.num_devices
    batch = batch_spec(engine, per_chip, training.input_shape, np.uint8)
    return training, analyse(training.train_step.lower(training.state, batch))


def unrolled_cost(config: Any, engine: parallel.DataParallel, steps_per_epoch: int) -> tuple:
    """FLOPs and bytes of an update of `accum_steps` micro-steps. XLA's cost analysis
    counts a loop body once, so the scanned program under-reports; the Python-unrolled
    program of A micro-steps costs C1 + (A - 1) (C2 - C1) (C1, C2: 1 and 2 micro-steps
    unrolled at the same micro-batch; every micro-step adds the same ops)."""
    micro = config.batch_size // (engine.num_devices * config.accum_steps)
    costs = []
    for a in (1, 2):
        c = config.copy_and_resolve_references()
        c.accum_steps, c.accum_loop = a, "unroll"
        c.batch_size = micro * a * engine.num_devices
        costs.append(_train_program(c, engine, steps_per_epoch)[1])
    a = config.accum_steps
    return tuple(
        one + (a - 1) * (two - one)
        for one, two in zip(
            (costs[0].flops, costs[0].bytes_accessed),
            (costs[1].flops, costs[1].bytes_accessed),
            strict=True,
        )
    )


def compile_ours(config: Any, engine: parallel.DataParallel, steps_per_epoch: int) -> dict:
    """Our train and eval steps for `config` on the slice, as main.py builds them there
    (memory and collectives of that program; its FLOPs and bytes from `unrolled_cost`
    where it loops over micro-steps)."""
    training, train = _train_program(config, engine, steps_per_epoch)
    looped = config.accum_steps > 1 and (
        parallel.resolve_accum_loop(config.accum_loop, "tpu") == "scan"
    )
    if looped:
        flops, accessed = unrolled_cost(config, engine, steps_per_epoch)
        train = dataclasses.replace(train, flops=flops, bytes_accessed=accessed)
    eval_per_chip = max(1, config.eval_batch_size // engine.num_devices)
    eval_batch = batch_spec(engine, eval_per_chip, training.input_shape, np.uint8)
    eval_batch["mask"] = jax.ShapeDtypeStruct(
        eval_batch["label"].shape, np.bool_, sharding=eval_batch["label"].sharding
    )
    evaluate = analyse(training.eval_step.lower(training.state, eval_batch))
    return {"train": train, "eval": evaluate, "state": training.state, "extrapolated": looped}


def compile_reference(config: Any, engine: parallel.DataParallel, per_chip: int) -> Compiled:
    """The Flax-example-style step (no accumulation) at `per_chip` images per chip."""
    from largebatch_jax.reference import build_reference

    ref = build_reference(
        engine,
        per_chip * engine.num_devices,
        config.image_size,
        config.num_classes,
        config.dtype,
        abstract=True,
    )
    return analyse(
        ref.train_step.lower(ref.state, batch_spec(engine, per_chip, ref.image_shape, np.float32))
    )


def gradient_and_statistics_bytes(state: Any) -> int:
    """What the step's one all-reduce must carry: a gradient per parameter, the BN
    running statistics, and the loss and error scalars (float32)."""
    leaves = jax.tree.leaves((state.params, state.batch_stats))
    return sum(x.size * np.dtype(x.dtype).itemsize for x in leaves) + 2 * 4


# ------------------------------------------------------------------ report


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:.0f} B"


def describe(name: str, c: Compiled, chip: Chip, images: int) -> list[str]:
    roof = c.roofline_s(chip)
    bound = (
        "compute"
        if c.flops / chip.peak_bf16_flops >= c.bytes_accessed / chip.hbm_bandwidth
        else "HBM"
    )
    lines = [
        f"{name}: compiled in {c.compile_s:.1f} s",
        f"  memory per chip: arguments {_size(c.argument_bytes)}, outputs {_size(c.output_bytes)} "
        f"(aliased {_size(c.alias_bytes)}), temporaries {_size(c.temp_bytes)}, code "
        f"{_size(c.code_bytes)}; total {_size(c.memory_bytes)} of {_size(chip.hbm_bytes)} HBM "
        f"({c.memory_bytes / chip.hbm_bytes:.0%})",
        f"  FLOPs per step {c.flops / 1e9:,.3f} G ({c.flops / images / 1e9:.3f} G per image), "
        f"bytes accessed {c.bytes_accessed / 1e9:,.3f} GB "
        f"({c.bytes_accessed / images / 1e6:.2f} MB per image)",
    ]
    kinds: dict[str, list[int]] = {}
    for col in c.collectives:
        kinds.setdefault(col.kind, []).append(col.bytes)
    for kind, sizes in kinds.items():
        lines.append(
            f"  {kind}: {len(sizes)} op(s), {_size(sum(sizes))} ("
            + ", ".join(_size(s) for s in sorted(sizes, reverse=True)[:4])
            + (", ..." if len(sizes) > 4 else "")
            + ")"
        )
    if not kinds:
        lines.append("  no collectives")
    lines.append(
        f"  roofline: >= {1e3 * roof:.2f} ms per step ({bound}-bound), <= "
        f"{images / roof:,.0f} images/s per chip"
    )
    return lines


def with_micro_batch(config: Any, chips: int, micro: int) -> Any:
    """`config` at `micro` images per chip per micro-step, kn unchanged: the accum_steps
    that then make up kn (a ValueError where they cannot)."""
    if micro <= 0 or config.batch_size % (chips * micro):
        raise ValueError(
            f"--per_chip_batch={micro}: batch_size={config.batch_size} is not a multiple of "
            f"{chips} chips x {micro}; choose a divisor of {config.batch_size // chips}."
        )
    config = config.copy_and_resolve_references()
    config.accum_steps = config.batch_size // (chips * micro)
    return config


def fits(config: Any, engine: parallel.DataParallel, chip: Chip, micro: int) -> Compiled | None:
    """One micro-step of `micro` images per chip, compiled; None if it does not fit."""
    config = config.copy_and_resolve_references()
    config.batch_size, config.accum_steps = micro * engine.num_devices, 1
    try:
        training = builder.build_training(config, engine, 1, platform="tpu", abstract=True)
        c = analyse(
            training.train_step.lower(
                training.state, batch_spec(engine, micro, training.input_shape, np.uint8)
            )
        )
    except Exception as e:
        if is_out_of_memory(e):
            return None
        raise
    return c if c.memory_bytes <= chip.hbm_bytes else None


def largest_micro_batch(config: Any, engine: parallel.DataParallel, chip: Chip) -> int:
    """The largest per-chip micro-batch, n x a power of two and at most kn / chips, whose
    train step fits the chip's HBM (each candidate compiled, doubling from n)."""
    ceiling = config.batch_size // engine.num_devices
    best, micro = 0, config.bn_group_size
    while micro <= ceiling:
        c = fits(config, engine, chip, micro)
        print(f"  {micro} images per chip: " + ("fits" if c else "does not fit"), flush=True)
        if c is None:
            break
        best, micro = micro, micro * 2
    if not best:
        raise ValueError(
            f"bn_group_size={config.bn_group_size} images per chip do not fit {chip.name}'s "
            "HBM: lower bn_group_size or image_size."
        )
    return best


def run(config: Any, topology: str, per_chip_batch: str | None, reference: bool) -> int:
    tpu = parse_topology(topology)
    engine = parallel.DataParallel(parallel.create_mesh(topology_devices(tpu)))
    chips = engine.num_devices
    if per_chip_batch == "max":
        print(f"largest micro-batch per chip on {tpu.topology_name}:", flush=True)
        config = with_micro_batch(config, chips, largest_micro_batch(config, engine, tpu.chip))
    elif per_chip_batch:
        config = with_micro_batch(config, chips, int(per_chip_batch))
    micro = parallel.micro_batch_size(
        config.batch_size, chips, config.accum_steps, config.bn_group_size
    )
    print(
        f"{config.model} kn={config.batch_size} n={config.bn_group_size} {config.dtype} "
        f"{config.image_size}x{config.image_size} on {tpu.chip.name} {tpu.topology_name} "
        f"({chips} chips): {micro} images per chip x {config.accum_steps} accum_steps "
        f"(accum_loop resolved for TPU: "
        f"{parallel.resolve_accum_loop(config.accum_loop, 'tpu')}) | jax {jax.__version__}",
        flush=True,
    )
    ours = compile_ours(config, engine, builder.known_steps_per_epoch(config))
    images = config.batch_size // chips
    lines = describe("train step (ours)", ours["train"], tpu.chip, images)
    if ours["extrapolated"]:
        lines.append(
            f"  (FLOPs and bytes: {config.accum_steps} micro-steps, extrapolated from the 1- and "
            "2-micro-step unrolled programs; XLA counts a loop body once)"
        )
    lines += describe(
        "eval step (ours)", ours["eval"], tpu.chip, max(1, config.eval_batch_size // chips)
    )
    expected = gradient_and_statistics_bytes(ours["state"])
    reduces = [c.bytes for c in ours["train"].collectives if c.kind == "all-reduce"]
    lines.append(
        f"gradients + BN statistics + 2 scalars: {_size(expected)}; the train step's "
        f"all-reduces carry {', '.join(_size(b) for b in reduces) or 'nothing'}"
        + (
            ""
            if expected in reduces
            else " (XLA sends identical gradients once: a block's "
            "last BN bias and its projection shortcut's BN bias get the same gradient)"
        )
    )
    if reference:
        ref = compile_reference(config, engine, micro)
        lines += describe("train step (reference, Flax example style)", ref, tpu.chip, micro)
        mine = ours["train"]
        # Per image: the reference has no accumulation, one step is one micro-batch.
        steps = config.accum_steps
        for label, a, b in (
            ("bytes accessed", mine.bytes_accessed / steps, ref.bytes_accessed),
            ("temporaries", mine.temp_bytes, ref.temp_bytes),
            ("roofline time", mine.roofline_s(tpu.chip) / steps, ref.roofline_s(tpu.chip)),
        ):
            lines.append(f"ours / reference, {label} per micro-batch: {a / b:.2f}x")
    print("\n".join(lines), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from absl import app, flags
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file("config", None, "Config file.")
    topology = flags.DEFINE_string(
        "topology", None, "TPU slice: v5e-256, v4-512, v5p-128, or a torus such as v5e:4x8."
    )
    per_chip = flags.DEFINE_string(
        "per_chip_batch",
        None,
        "Images per chip per micro-step (accum_steps then follows from kn), or 'max': the "
        "largest that fits. Default: the config's batch_size / chips / accum_steps.",
    )
    reference = flags.DEFINE_bool(
        "reference", False, "Also compile the Flax-example-style reference step."
    )
    flags.mark_flags_as_required(["config", "topology"])

    def _main(args):
        if len(args) > 1:
            raise app.UsageError(f"unexpected arguments: {args[1:]}")
        # Executables for a described (not attached) TPU cannot go through the persistent
        # compilation cache: every lookup fails with a warning.
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            return run(config_flag.value, topology.value, per_chip.value, reference.value)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2

    app.run(lambda args: sys.exit(_main(args)), argv)
    return 0


if __name__ == "__main__":
    main()
