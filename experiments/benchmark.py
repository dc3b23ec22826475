"""Train-step throughput: ours against a reference step written the way the Flax ImageNet
example writes one, side by side in one process.

    python -m experiments.benchmark --model=resnet50 --per_device_batch=4 --devices=8
    python -m experiments.benchmark --model=resnet50 --per_device_batch=128 --devices=0 \\
        --dtype=bfloat16                                    # the real devices (a GPU)
    python -m experiments.benchmark --input=real --config=configs/fashion_mnist.py --devices=8

Per implementation: compile time, steady-state step time (median of --steps after one
warm-up step) and images/s, XLA's FLOPs per image and the implied achieved FLOP/s, and
XLA's memory estimate per device. The reference (`largebatch_jax.reference`) is a plain
linen ResNet v1.5 with `nn.BatchNorm(axis_name=...)` (statistics synchronised over the
global batch), `optax.sgd` with Nesterov momentum, weight decay as an L2 term in the loss,
under `jax.pmap` with `lax.pmean` of the gradients. Ours is the program `main.py` runs
for `--config` (default configs/imagenet.py: ResNet-50, per-worker BN), built by the same
`builder.build_training`, with kn = per_device_batch x devices and `--conv_impl` both ways;
the flags below override the config's fields.

`--input=real` times our training loop's input path on a config's dataset (loader ->
`shard_batch` -> step) against the same step fed one synthetic batch over and over: the
difference is the fraction of wall time the host keeps the devices waiting, with and
without prefetching the next batch onto the devices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.benchmark", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--config",
        default=None,
        help="the config whose program is timed (default: configs/imagenet.py for "
        "--input=synthetic, configs/fashion_mnist.py for --input=real)",
    )
    p.add_argument("--per_device_batch", type=int, default=4, help="synthetic: kn / devices")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices; 0 = real devices")
    # Fields of the config to override (unset: the config's own); synthetic only, but
    # --reduction (fast: XLA's all-reduce; exact: the default) for both inputs.
    for field, kind in (
        ("model", str),
        ("accum_steps", int),
        ("image_size", int),
        ("num_classes", int),
        ("width", int),
        ("accum_loop", str),
        ("reduction", str),
    ):
        p.add_argument(f"--{field}", type=kind, default=None)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--repeats", type=int, default=1, help="alternate ours/reference this often")
    p.add_argument("--conv_impl", default="both", choices=("both", "xla", "matmul"))
    p.add_argument("--no_reference", action="store_true")
    p.add_argument("--input", default="synthetic", choices=("synthetic", "real"))
    p.add_argument(
        "--profile",
        default=None,
        help="synthetic: trace 3 steps of ours (the first program) into this folder "
        "(tensorboard --logdir it, or its perfetto_trace.json.gz in ui.perfetto.dev)",
    )
    p.add_argument(
        "--aot_json",
        default=None,
        help="figures of the same configuration compiled without the device "
        "(python -m largebatch_jax.aot ... --json=FILE): printed beside ours, so that a run "
        "on the hardware checks the compiler's memory estimate",
    )
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices:  # before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from largebatch_jax import host  # noqa: E402

with host.plugin_noise_filtered():  # the accelerator plugins' loading banners on a CPU host
    import jax
    import numpy as np

    from largebatch_jax import parallel
    from largebatch_jax.aot.targets import accelerator_of
    from largebatch_jax.builder import build_training, input_shape
    from largebatch_jax.plan import Facts, resolve
    from largebatch_jax.reference import build_reference
    from largebatch_jax.utilization import memory_in_use, step_flops

# ------------------------------------------------------------------ measurement


def synthetic_batch(global_batch: int, shape: tuple, num_classes: int, pixels: bool):
    """Random images of `shape`: uint8 pixels as our loader hands them out (the step
    normalises on the device), or float32 already normalised (the reference's input, as
    the Flax example's tf.data pipeline gives it)."""
    rng = np.random.default_rng(0)
    size = (global_batch, *shape)
    image = rng.integers(0, 256, size, np.uint8) if pixels else rng.normal(size=size)
    return {
        "image": image.astype(np.uint8 if pixels else np.float32),
        "label": rng.integers(0, num_classes, global_batch).astype(np.int32),
    }


def compile_and_time(fn, state, batch, steps: int) -> dict:
    """AOT-compile `fn`, run one warm-up step, then time `steps` steps one by one. FLOPs
    per device from XLA's cost analysis as the training loop reads them
    (`utilization.step_flops`); memory as XLA plans it."""
    began = time.perf_counter()
    lowered = fn.lower(state, batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - began
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - began)
    return {
        "compile_s": compile_s,
        "step_s": statistics.median(times),
        "flops": step_flops(lowered, compiled, jax.default_backend()),
        "memory_bytes": planned_memory(compiled),
        "state": state,
        "compiled": compiled,
    }


def planned_memory(compiled) -> int:
    """XLA's plan of a compiled step's memory per device (arguments, outputs not aliased
    to a donated argument, temporaries): its largest program's (for the exact mode's
    chain a lower bound: `largebatch_jax.aot` adds what the caller holds between
    programs)."""
    return max(_program_memory(p.program) for p in compiled.programs)


def _program_memory(program) -> int:
    memory = program.memory_analysis()
    if memory is None:
        return 0
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )


def host_fed(m: dict, engine, host_batch: dict, steps: int, profile: str | None) -> None:
    """The compiled step of `m` fed a host batch copied to the devices every step, as the
    training loop feeds it: the share of wall time in that copy (the log's input wait,
    without a loader), and the devices' peak memory in use after it (GPU, TPU). With
    `profile`, the first 3 of those steps traced there, annotated as the loop annotates
    them."""
    compiled, state = m["compiled"], m["state"]
    traced = min(3, steps) if profile else 0
    began, copying = time.perf_counter(), 0.0
    for i in range(steps):
        if i == 0 and traced:
            jax.profiler.start_trace(profile, create_perfetto_trace=True)
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            t = time.perf_counter()
            batch = engine.shard_batch(host_batch)
            copying += time.perf_counter() - t
            state, metrics = compiled(state, batch)
        if traced and i == traced - 1:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
    jax.block_until_ready(metrics)
    wall = time.perf_counter() - began
    m["state"] = state
    memory = memory_in_use(jax.local_devices())
    line = f"{'':34s} host-fed: {1000 * wall / steps:8.1f} ms/step, input wait {copying / wall:.0%}"
    if memory is not None:
        line += f", peak memory {memory[0] / 2**30:.2f} of {memory[1] / 2**30:.2f} GiB"
    if profile:
        line += f"; its first {traced} steps traced in {profile}"
    print(line, flush=True)


def load_config(path: str):
    """A config file's `get_config()` (ml_collections, like main.py's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_config", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def synthetic_config(args, num_devices: int, conv_impl: str | None = None):
    """The config timed on synthetic batches: --config with the flags' overrides and
    kn = per_device_batch x devices (n capped at the per-device micro-batch)."""
    config = load_config(args.config or "configs/imagenet.py")
    fields = ("model", "accum_steps", "image_size", "num_classes", "width", "accum_loop")
    for field in (*fields, "reduction"):
        if getattr(args, field) is not None:
            config[field] = getattr(args, field)
    if args.dtype is not None:
        config.dtype = args.dtype
    if conv_impl is not None:
        config.conv_impl = conv_impl
    config.batch_size = args.per_device_batch * num_devices
    config.bn_group_size = min(config.bn_group_size, args.per_device_batch // config.accum_steps)
    return config


def ours(config, engine, train_images: int | None = None):
    """What the builder main.py's training loop uses gives for `config` (`Training`), on
    `train_images` (default: the dataset's known size)."""
    facts = Facts(engine.num_devices, jax.default_backend(), train_images=train_images)
    return build_training(config, resolve(config, facts), engine)


def reference(config, mesh) -> tuple:
    """The Flax-example-style step (`largebatch_jax.reference`) under `jax.pmap`, as the
    example runs it, with its state; the batch goes through the same engine."""
    engine = parallel.DataParallel(mesh, "pmap")
    ref = build_reference(
        engine, config.batch_size, config.image_size, config.num_classes, config.dtype
    )
    return ref, engine


def bf16_peak_flops(device) -> float | None:
    """The device's dense bf16 peak FLOP/s (the data sheets' figures of
    `largebatch_jax.aot.targets`), or None where it has none (CPU)."""
    chip = accelerator_of(device.platform, device.device_kind)
    return chip.peak_bf16_flops if chip else None


def compare_with_aot(path: str, memory_bytes: int) -> None:
    """This compile's memory per device beside the deviceless compile's of the same
    configuration (`--aot_json`)."""
    import json

    figures = json.loads(Path(path).read_text())
    aot = figures["train"]["memory_bytes"]
    print(
        f"{'':34s} memory per device: this compile {memory_bytes / 2**20:,.1f} MiB, the "
        f"deviceless compile for {figures['target']} {aot / 2**20:,.1f} MiB "
        f"({memory_bytes / aot:.3f}x)",
        flush=True,
    )


def report(
    name: str, m: dict, images_per_step: int, per_device: int, peak: float | None = None
) -> dict:
    """One row: images/s, step time, compile time, FLOPs per image, achieved FLOP/s over
    all devices, and MFU (achieved / the devices' bf16 peak) where `peak` is known."""
    flops_per_image = m["flops"] / per_device if m["flops"] else 0.0
    devices = images_per_step // per_device
    achieved = flops_per_image * images_per_step / m["step_s"]
    row = {
        "name": name,
        "images_per_s": images_per_step / m["step_s"],
        "step_ms": 1000 * m["step_s"],
        "compile_s": m["compile_s"],
        "gflops_per_image": flops_per_image / 1e9,
        "achieved_tflops": achieved / 1e12,
        "mfu": achieved / (devices * peak) if peak else None,
        "memory_mib": m["memory_bytes"] / 2**20,
    }
    mfu = f"  MFU {row['mfu']:5.1%}" if row["mfu"] is not None else ""
    print(
        f"{name:34s} {row['images_per_s']:9.1f} img/s  step {row['step_ms']:8.1f} ms  "
        f"compile {row['compile_s']:6.1f} s  {row['gflops_per_image']:6.2f} GFLOP/img  "
        f"{row['achieved_tflops']:7.3f} TFLOP/s{mfu}  {row['memory_mib']:8.1f} MiB/device",
        flush=True,
    )
    return row


def synthetic(args) -> int:
    with host.plugin_noise_filtered():
        engine = parallel.DataParallel(parallel.create_mesh())  # the backend starts here
    devices = list(engine.mesh.devices.flat)
    d = engine.num_devices
    config = synthetic_config(args, d)
    global_batch = config.batch_size
    peak = bf16_peak_flops(devices[0])
    print(
        f"{config.model} | {d} x {devices[0].device_kind} ({jax.default_backend()}) | "
        f"{args.per_device_batch} images/device, accum {config.accum_steps}, {config.dtype}, "
        f"{config.image_size}x{config.image_size} | jax {jax.__version__} | "
        f"{time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    host_batch = synthetic_batch(global_batch, input_shape(config), config.num_classes, True)
    impls = ["xla", "matmul"] if args.conv_impl == "both" else [args.conv_impl]
    rows: dict[str, list[dict]] = {}
    with_reference = not args.no_reference and config.model == "resnet50"
    for _ in range(args.repeats):
        for impl in impls:
            training = ours(synthetic_config(args, d, impl), engine)
            m = compile_and_time(
                training.train_step, training.state, engine.shard_batch(host_batch), args.steps
            )
            rows.setdefault(f"ours (conv_impl={impl})", []).append(
                report(f"ours (conv_impl={impl})", m, global_batch, args.per_device_batch, peak)
            )
            if args.aot_json and impl == "xla":
                compare_with_aot(args.aot_json, m["memory_bytes"])
            if impl == impls[0]:
                host_fed(m, engine, host_batch, args.steps, args.profile)
                args.profile = None  # one trace per command
            del m
        if with_reference and config.accum_steps == 1:
            ref, ref_engine = reference(config, engine.mesh)
            normalised = synthetic_batch(global_batch, ref.image_shape, config.num_classes, False)
            batch = ref_engine.shard_batch(normalised)
            m = compile_and_time(ref.train_step, ref.state, batch, args.steps)
            rows.setdefault("reference (Flax example style)", []).append(
                report(
                    "reference (Flax example style)", m, global_batch, args.per_device_batch, peak
                )
            )
    if "reference (Flax example style)" in rows:
        ref = statistics.median(r["images_per_s"] for r in rows["reference (Flax example style)"])
        for name, rs in rows.items():
            if name.startswith("ours"):
                ratio = statistics.median(r["images_per_s"] for r in rs) / ref
                print(f"ratio {name} / reference: {ratio:.2f}", flush=True)
    return 0


def real_input(args) -> int:
    """Our loop's input path against the same step on a fixed device batch."""
    from largebatch_jax import train
    from largebatch_jax.data import loader

    config = load_config(args.config or "configs/fashion_mnist.py")
    if args.reduction is not None:
        config.reduction = args.reduction
    engine = parallel.DataParallel(parallel.create_mesh(), config.parallelism)
    data = train.load_data(config)
    training = ours(config, engine, len(data.train))
    step = training.train_step
    initial = jax.device_get(training.state)  # every variant starts from a fresh copy
    src, augment = data.train, data.augment
    steps = max(args.steps, 20)
    print(
        f"{config.dataset} {config.model} kn={config.batch_size} on {engine.num_devices} "
        f"devices, {steps} steps",
        flush=True,
    )

    def fresh():
        return engine.replicate(initial)

    def feed(prefetch: int):
        it = loader.TrainLoader(
            src, augment, config.batch_size, config.seed, steps + 2, workers=config.workers
        )
        local = ({k: v for k, v in b.items() if k != "index"} for b in it)
        if prefetch:
            return (batch for batch, _ in engine.prefetch(((b, None) for b in local), prefetch))
        return (engine.shard_batch(b) for b in local)

    results = {}
    variants = (
        ("synthetic (device-resident batch)", None, False),
        ("real, host sync every step", 0, True),  # before: metrics fetched every step
        ("real, no prefetch", 0, False),  # the loop as it runs (metrics stay on device)
        ("real, prefetch 2", 2, False),
    )
    for name, prefetch, sync in variants:
        state = fresh()
        if prefetch is None:
            fixed = next(feed(0))
            batches = iter([fixed] * (steps + 1))
        else:
            batches = feed(prefetch)
        state, metrics = step(state, next(batches))  # compile + warm-up
        jax.block_until_ready(metrics)
        began = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, next(batches))
            if sync:
                jax.device_get(metrics)
        jax.block_until_ready(metrics)
        results[name] = (time.perf_counter() - began) / steps
        print(
            f"{name:36s} {1000 * results[name]:8.1f} ms/step  "
            f"{config.batch_size / results[name]:8.0f} img/s",
            flush=True,
        )
    base = results["synthetic (device-resident batch)"]
    for name, _, _ in variants[1:]:
        print(
            f"host keeps the devices waiting ({name}): "
            f"{max(0.0, 1 - base / results[name]):.0%} of wall time",
            flush=True,
        )
    return 0


def main() -> int:
    args = ARGS or parse_args()
    return real_input(args) if args.input == "real" else synthetic(args)


if __name__ == "__main__":
    sys.exit(main())
