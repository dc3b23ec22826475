"""The model alone: forward + backward of ResNet-50, ours against the reference's, on one
device, side by side in one process (no optimizer, no collectives, no input pipeline).

    python -m experiments.benchmark_model                    # 4 images, 224x224, 1 CPU device
    python -m experiments.benchmark_model --batch=128 --dtype=bfloat16    # a GPU

Rows: the reference's model (`largebatch_jax.reference`, flax `nn.BatchNorm`), ours
(per-worker BN over groups of n = --batch), and ours with flax's `nn.BatchNorm` in place
of our BN (how much of a gap is the BN). Each repeat builds and compiles every row again;
medians over repeats, as ratios to the reference.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from largebatch_jax import host

with host.plugin_noise_filtered():  # the accelerator plugins' loading banners on a CPU host
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import linen as nn
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from largebatch_jax import reference
    from largebatch_jax.models import resnet
    from largebatch_jax.parallel import AXIS
    from largebatch_jax.step import one_random_stream

    jax.devices()  # the backend starts here, and JAX loads its plugins


class FlaxBatchNorm(nn.Module):
    """flax's `nn.BatchNorm` behind our BN's interface (statistics over the whole batch)."""

    group_size: int
    momentum: float = 0.9
    epsilon: float = 1e-5
    axis_name: str | None = None
    scale_init: object = nn.initializers.ones
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, use_running_average: bool):
        return nn.BatchNorm(
            use_running_average=use_running_average,
            momentum=self.momentum,
            epsilon=self.epsilon,
            scale_init=self.scale_init,
            dtype=self.dtype,
        )(x)


@contextlib.contextmanager
def batchnorm(cls: type) -> Iterator[None]:
    """Our ResNet's layers build `cls` for every BN while tracing inside this block."""
    ours = resnet.BatchNorm
    resnet.BatchNorm = cls
    try:
        yield
    finally:
        resnet.BatchNorm = ours


def build(name: str, batch: int, dtype: str) -> nn.Module:
    if name == "reference":
        return reference.ReferenceResNet50(1000, resnet.DTYPES[dtype])
    return resnet.create_model("resnet50", 1000, batch, dtype=dtype)


def grad_fn(model: nn.Module, mesh: Mesh):
    def loss(params, stats, x, y):
        logits, updated = model.apply(
            {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updated

    # One device mapped over AXIS, so the reference's BN finds its axis name.
    mapped = jax.shard_map(
        jax.grad(loss, has_aux=True),
        mesh=mesh,
        in_specs=(P(), P(), P(AXIS), P(AXIS)),
        out_specs=P(),
        check_vma=False,
    )
    return jax.jit(mapped)


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.benchmark_model", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    shape = (args.image_size, args.image_size, 3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, *shape)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 1000, args.batch).astype(np.int32))
    print(
        f"resnet50 forward+backward | 1 x {jax.devices()[0].device_kind} | {args.batch} "
        f"images, {args.dtype}, {args.image_size}x{args.image_size} | jax {jax.__version__} | "
        f"{time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    names = ("reference", "ours", "ours, flax BN")
    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name in names:
            model = build(name, args.batch, args.dtype)
            init = functools.partial(model.init, train=False)
            swap = name == "ours, flax BN"
            with batchnorm(FlaxBatchNorm) if swap else contextlib.nullcontext():
                with one_random_stream():
                    variables = jax.jit(init)(jax.random.key(0), jnp.zeros((1, *shape)))
                call = (variables["params"], variables["batch_stats"], x, y)
                began = time.perf_counter()
                compiled = grad_fn(model, mesh).lower(*call).compile()
                compile_s = time.perf_counter() - began
            jax.block_until_ready(compiled(*call))
            steps = []
            for _ in range(args.steps):
                began = time.perf_counter()
                jax.block_until_ready(compiled(*call))
                steps.append(time.perf_counter() - began)
            times.setdefault(name, []).append(statistics.median(steps))
            print(
                f"{name:16s} {1000 * times[name][-1]:9.1f} ms  compile {compile_s:5.1f} s",
                flush=True,
            )
    base = statistics.median(times["reference"])
    for name in names:
        t = statistics.median(times[name])
        print(f"median {name:16s} {1000 * t:9.1f} ms  {t / base:.2f}x the reference", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
