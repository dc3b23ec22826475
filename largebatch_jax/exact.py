"""Sums whose order is fixed by the index of what is summed, not by the layout
(`config.reduction='exact'`, the invariance promise made bitwise).

XLA may sum the elements of a reduce op, and the contributions of an all-reduce, in any
order, and different programs (8 devices x 1 group, 1 device x 8 groups) choose
differently. Here every sum is a fixed balanced binary tree of explicit elementwise adds:
adjacent pairs (0+1, 2+3, ...) level by level, an odd last element carried up to the next
level. Over k = D x G groups with G (groups per device) a power of two, the first
log2(G) levels stay within each device's contiguous block of groups, so the tree of the
groups equals the in-device tree followed by the same tree over the D device sums:
identical bits for every D, G and process count with the same k.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from largebatch_jax import parallel, private

# Varying -> invariant: the gathered sum is typed as the same on every device. The public
# jax.lax.all_gather_invariant where jax exports it, else its private home (jax 0.10 and
# 0.11 define it, not yet exported): `private.all_gather_invariant`.
all_gather_invariant = private.all_gather_invariant()


# The XLA:CPU intra-op pool size exact mode fixes (fix_cpu_threads): twice the 8 fake
# devices of the tests and the CPU configs. With a pool of exactly 8 threads, one of two
# concurrent 8-device runs of configs/fashion_mnist.py stopped in 3 tries of 3: the other 7
# devices' threads waited at the mean program's second collective and XLA aborted after
# 40 s; with 16, none in 3 (2026-12-07, 2-core AMD EPYC).
CPU_THREADS = 16


def fix_cpu_threads(environ: MutableMapping[str, str] | None = None) -> None:
    """Fix XLA:CPU's thread count before the first backend is created (main.py does, for
    reduction='exact'). XLA:CPU runs convolutions and dots in an Eigen pool of max(NPROC,
    else the cores; local devices) threads, and Eigen splits the work, so the order of
    its sums, by that count: the same 3x3 convolution, same compiled HLO, gave three bit
    patterns on 2 cores for 1-2, 4-5 and 3/6-8 fake devices, so 2 processes x 4 devices
    differed from 1 x 8. NPROC=CPU_THREADS makes the pool the same for every layout of up
    to CPU_THREADS local devices and on every machine (`check_cpu_threads`). A value the
    user set is kept: it must then be the same for every run compared."""
    env = os.environ if environ is None else environ
    env.setdefault("NPROC", str(CPU_THREADS))


def check_cpu_threads(
    platform: str, local_devices: int, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """Why this process's XLA:CPU pool size differs from other layouts', or None."""
    env = os.environ if environ is None else environ
    if platform != "cpu":
        return None
    nproc = env.get("NPROC")
    if nproc is None:
        return (
            "config.reduction='exact' on CPU needs a fixed XLA:CPU thread count: set "
            f"NPROC={CPU_THREADS} before JAX starts (main.py does), or set reduction='fast'."
        )
    if not nproc.isdigit() or local_devices > int(nproc):
        return (
            f"config.reduction='exact' on CPU: NPROC={nproc} is below the {local_devices} "
            f"local devices, so XLA:CPU uses {local_devices} threads and other layouts "
            f"round differently: set NPROC={max(local_devices, CPU_THREADS)} for every run "
            "compared, or set reduction='fast'."
        )
    return None


def compiler_options(platform: str) -> dict[str, Any]:
    """XLA options the exact mode compiles with on `platform`. On GPU,
    `xla_gpu_deterministic_ops` ("guarantees run-to-run determinism on GPU", its help
    text): deterministic scatters, and cuDNN convolution algorithms picked as the first
    working one rather than the fastest measured (autotuning's timing noise could pick
    another in another run). The bits then also depend on the GPU model and the XLA, CUDA
    and cuDNN versions (README, "Compiled for NVIDIA GPUs"). Nothing elsewhere: XLA:CPU
    and the TPU compiler run every op of these programs deterministically."""
    return {"xla_gpu_deterministic_ops": True} if parallel.is_gpu(platform) else {}


def map_groups(fn, xs: Any, axis_name: str | None = None) -> Any:
    """`lax.map(fn, xs)` (fn on each slice along axis 0, results stacked) as a loop whose
    trip count XLA cannot see, so that every layout runs `fn` as the same compiled loop
    body: XLA inlines a loop it knows runs once, and the inlined copy, fused with its
    surroundings, can round differently. The exact evaluation uses it (a few images per
    chunk, cheap); the train step runs its groups as programs of their own instead
    (`grouped`: on the TPU compile this loop made the forward pass run twice). Inside a
    mapped step, `axis_name` types the results as differing per device (as the loop's
    carry must be)."""
    length = jax.tree.leaves(xs)[0].shape[0]
    first = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], xs))
    stacked = jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), first)
    # The trip count through an optimization barrier: a value XLA does not fold.
    count = jax.lax.optimization_barrier(jnp.int32(length))

    def body(i, out):
        item = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), xs)
        # Barriers keep fn's computation apart from the slicing and the stacking, whose
        # shapes depend on the layout (fused together, XLA compiled the BN statistics'
        # reductions differently for one group per device than for more).
        result = jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(item)))
        return jax.tree.map(
            lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, i, 0), out, result
        )

    if axis_name is not None:
        stacked = jax.tree.map(lambda x: jax.lax.pcast(x, axis_name, to="varying"), stacked)
    return jax.lax.fori_loop(0, count, body, stacked)


def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over axis 0 in the fixed tree (adjacent pairs, odd last carried up). A level
    pairs rows through a reshape to [pairs, 2, ...], not strided slices: on the TPU
    compile of the paper's device sum (256 rows of 100,000) strided slices made the
    program 5.49 GB against 3.19 GB, the same adds."""
    while x.shape[0] > 1:
        even = x.shape[0] // 2 * 2
        pairs = x[:even].reshape(even // 2, 2, *x.shape[1:])
        paired = pairs[:, 0] + pairs[:, 1]
        x = paired if even == x.shape[0] else jnp.concatenate([paired, x[even:]])
    return x[0]


def tree_sum_leaves(stacked: Any) -> Any:
    """`tree_sum` of every leaf of a pytree stacked along axis 0 (e.g. `lax.map`'s)."""
    return jax.tree.map(tree_sum, stacked)


def vector_sum(x: jax.Array) -> jax.Array:
    """The sum of all elements of `x` in the fixed tree over its flattened index."""
    return tree_sum(x.reshape(-1))


def device_sum(tree: Any, axis_name: str, num_devices: int) -> Any:
    """Inside a mapped step: the sum over devices of each device's `tree`, in device
    order, the same bits on every device (`flat_device_sum` of the flattened tree).
    Every leaf is float32."""
    flat, unravel = ravel_pytree(tree)
    return unravel(flat_device_sum(flat, axis_name, num_devices))


def flat_device_sum(
    flat: jax.Array, axis_name: str, num_devices: int, divisor: int = 1
) -> jax.Array:
    """Inside a mapped step: the sum over devices of each device's vector `flat`, in
    device order, the same bits on every device. A deterministic all-reduce with a ring's
    bandwidth: the vector is cut into `num_devices` slices, `all_to_all` gives device j
    every device's slice j, device j sums them in the fixed tree (and divides them by
    `divisor`, for a mean), and `all_gather` returns the summed slices to all."""
    size = flat.shape[0]
    width = -(-size // num_devices)
    rows = jnp.pad(flat, (0, width * num_devices - size)).reshape(num_devices, width)
    # Row i of the result is device i's slice j (this device is j).
    gathered = jax.lax.all_to_all(rows, axis_name, split_axis=0, concat_axis=0, tiled=True)
    mine = tree_sum(gathered)
    mine = mine / divisor if divisor != 1 else mine
    return all_gather_invariant(mine, axis_name, tiled=True)[:size]
