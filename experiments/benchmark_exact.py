"""Train-step time of reduction='exact' against 'fast', side by side in one process.

    python -m experiments.benchmark_exact --config=configs/smoke.py
    python -m experiments.benchmark_exact --config=configs/fashion_mnist.py
    python -m experiments.benchmark_exact --config=configs/imagenet.py \\
        --set batch_size=32,bn_group_size=4,image_size=64 --steps 3

Both programs are built by `builder.build_training` from the same config (only
`reduction` differs) on `--devices` fake CPU devices and fed one synthetic batch of the
config's input shape. Prints the compile time of each, then per repeat the median step
time of `--steps` steps after a warm-up step, alternating fast / exact, and the median
ratio exact / fast over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.benchmark_exact", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--config", default="configs/smoke.py")
    p.add_argument("--set", default="", help="FIELD=VALUE,... overrides (configs/overrides.py)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from largebatch_jax import host

    with host.plugin_noise_filtered():  # the accelerator plugins' loading banners
        import jax
        import numpy as np

        from configs.overrides import apply_overrides
        from experiments.sweep import load_config
        from largebatch_jax import builder, parallel
        from largebatch_jax.plan import Facts, resolve

        jax.devices()  # the backend starts here, and JAX loads its plugins

    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[: args.devices]))
    programs = {}
    for reduction in ("fast", "exact"):
        config = apply_overrides(load_config(args.config), f"{args.set},reduction={reduction}")
        plan = resolve(config, Facts(devices=args.devices, platform=jax.default_backend()))
        training = builder.build_training(config, plan, engine)
        rng = np.random.default_rng(0)
        batch = engine.shard_batch(
            {
                "image": rng.integers(
                    0, 256, (config.batch_size, *training.input_shape), dtype=np.uint8
                ),
                "label": rng.integers(0, config.num_classes, config.batch_size).astype(np.int32),
            }
        )
        start = time.perf_counter()
        compiled = training.train_step.lower(training.state, batch).compile()
        compile_s = time.perf_counter() - start
        programs[reduction] = (compiled, training.state, batch)
        print(f"{reduction}: compile {compile_s:.1f} s", flush=True)
    name = f"{args.config} {args.set}".strip()
    print(f"{name}: kn={config.batch_size} n={config.bn_group_size} on {args.devices} devices")

    def time_steps(reduction: str) -> float:
        compiled, state, batch = programs[reduction]
        state, _ = compiled(state, batch)  # warm-up
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        programs[reduction] = (compiled, state, batch)
        return statistics.median(times)

    ratios = []
    for repeat in range(args.repeats):
        fast, exact = time_steps("fast"), time_steps("exact")
        ratios.append(exact / fast)
        print(f"repeat {repeat}: fast {fast * 1e3:.1f} ms, exact {exact * 1e3:.1f} ms per step")
    print(f"exact / fast step time, median of {args.repeats}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
