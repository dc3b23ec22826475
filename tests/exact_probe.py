"""Run by test_multihost.py, alone (1 process x 8 devices) or under the launcher: the
exact cross-device sum (exact.device_sum: all_to_all + tree + all_gather) of values
whose sum depends on the order, and a 3x3 convolution, on the same global data; process
0 writes their sha256 digests to OUT. Like main.py in exact mode, it fixes XLA:CPU's
thread count first (exact.fix_cpu_threads)."""

import argparse
import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from largebatch_jax import cluster, exact, parallel


def digest(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--coordinator_address")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    args = parser.parse_args()
    exact.fix_cpu_threads()
    cluster.initialize_distributed(
        "auto", args.coordinator_address, args.num_processes, args.process_id
    )
    engine = parallel.DataParallel(parallel.create_mesh())
    rng = np.random.default_rng(0)
    values = rng.normal(size=(8, 5000)) * 10.0 ** rng.integers(-6, 7, size=(8, 5000))
    values = values.astype(np.float32)
    images = rng.normal(size=(32, 7, 7, 16)).astype(np.float32)
    kernel = rng.normal(size=(3, 3, 16, 16)).astype(np.float32)
    share = slice(
        jax.process_index() * jax.local_device_count(),
        (jax.process_index() + 1) * jax.local_device_count(),
    )

    def summed(x):
        return exact.device_sum({"v": x[0]}, parallel.AXIS, jax.lax.axis_size(parallel.AXIS))["v"]

    def conv(x):
        return jax.lax.conv_general_dilated(
            x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    mesh = engine.mesh
    total = jax.jit(jax.shard_map(summed, mesh=mesh, in_specs=P(parallel.AXIS), out_specs=P()))(
        engine.shard_batch(values[share])
    )
    per_device = 32 // 8
    convolved = jax.jit(
        jax.shard_map(conv, mesh=mesh, in_specs=P(parallel.AXIS), out_specs=P(parallel.AXIS))
    )(engine.shard_batch(images[share.start * per_device : share.stop * per_device]))
    out = {
        "device_sum": digest(multihost_utils.process_allgather(total, tiled=True)[:5000]),
        "conv": digest(multihost_utils.process_allgather(convolved, tiled=True)),
        "tree_of_rows": digest(exact.tree_sum(values)),
    }
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
