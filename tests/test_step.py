"""The data-parallel step: the update depends on kn and n only, never on the hardware.

This is the project's core promise (README, "The invariance promise"): one SGD update
of kn=32 images in BN groups of n=4 gives the same parameters, BN statistics and metrics
whether it runs on 8 devices x 4 images, 4 x 8, 1 x 32, or 2 devices x 2 accumulation
steps x 8.
"""

import functools
import hashlib
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import linen as nn

from largebatch_jax import exact, optim, parallel
from largebatch_jax import step as step_lib
from largebatch_jax.models import create_model
from largebatch_jax.plan import Facts, check_layout, learning_rate, micro_batch, resolve

KN, N, CLASSES, SIZE = 32, 4, 10, 8
RNG = np.random.default_rng(0)
BATCHES = [
    {
        "image": RNG.normal(size=(KN, SIZE, SIZE, 1)).astype(np.float32),
        "label": RNG.integers(0, CLASSES, size=KN).astype(np.int32),
    }
    for _ in range(3)
]
SCHEDULE_CONFIG = ml_collections.ConfigDict(
    dict(
        base_lr=0.1,
        base_batch_size=16,
        batch_size=KN,
        lr_scaling="linear",
        lr_multiplier=1.0,
        warmup="gradual",
        warmup_epochs=0.5,
        lr_decay="step",
        decay_epochs=(1.0,),
        decay_factor=0.1,
        num_epochs=2.0,
    )
)
LR_FN = learning_rate(SCHEDULE_CONFIG, steps_per_epoch=4).schedule()
TX = optim.create_optimizer(LR_FN, weight_decay=1e-4)
TXS = {"sgd": TX, "lars": optim.create_optimizer(LR_FN, optimizer="lars", weight_decay=1e-4)}


def model(bn_group_size=N, bn_sync=False):
    # gamma 1 everywhere so that the very first update reaches every layer.
    return create_model(
        "resnet8",
        CLASSES,
        bn_group_size,
        zero_init_residual=False,
        width=4,
        bn_axis_name=parallel.AXIS if bn_sync else None,
    )


@functools.cache
def initial_state(optimizer="sgd"):
    state = step_lib.create_train_state(jax.random.key(0), model(), TXS[optimizer], (SIZE, SIZE, 1))
    return jax.device_get(state)  # host copy: every run replicates (and donates) its own


@functools.cache
def run(
    devices,
    accum_steps,
    parallelism="shard_map",
    bn_group_size=N,
    bn_sync=False,
    steps=2,
    accum_loop="auto",  # what main.py uses on this backend (a Python loop on CPU)
    reduction="fast",
    optimizer="sgd",
):
    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[:devices]), parallelism)
    micro_batch(KN, devices, accum_steps, bn_group_size)
    net = model(bn_group_size, bn_sync)
    tx = TXS[optimizer]
    step = engine.map(
        step_lib.make_train_step(
            net, tx, LR_FN, accum_steps, accum_loop, reduction=reduction, bn_group_size=N
        ),
        donate_state=True,
    )
    state = engine.replicate(initial_state(optimizer))
    history = []
    for batch in BATCHES[:steps]:
        state, metrics = step(state, engine.shard_batch(batch))
        history.append(jax.device_get(metrics))
    return jax.device_get(state), history


def assert_trees_close(a, b, rtol=1e-4, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def digest(tree) -> str:
    """sha256 over every leaf's bytes, in pytree order: equal only if bit-identical."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def max_rel_diff(a, b):
    return max(
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "devices,accum_steps",
    [(4, 1), (1, 1), (2, 2)],
    ids=["4dev_x_8img", "1dev_x_32img", "2dev_x_2accum_x_8img"],
)
def test_update_depends_on_kn_and_n_not_on_devices(devices, accum_steps):
    ref_state, ref_metrics = run(8, 1)  # 8 devices x 4 images
    state, metrics = run(devices, accum_steps)
    assert int(state.step) == 2
    assert_trees_close(state.params, ref_state.params)
    assert_trees_close(state.batch_stats, ref_state.batch_stats)
    assert_trees_close(state.opt_state, ref_state.opt_state)
    assert_trees_close(metrics, ref_metrics)
    # ... and the update did move everything (the comparison is not vacuous).
    assert max_rel_diff(ref_state.params, initial_state().params) > 1e-3
    assert max_rel_diff(ref_state.batch_stats, initial_state().batch_stats) > 1e-2


@pytest.mark.parametrize("devices,accum_steps", [(2, 2), (1, 8)])
def test_unrolled_accumulation_is_the_scanned_one(devices, accum_steps):
    # The CPU default (a Python loop over micro-steps) adds the same terms in the same
    # order as lax.scan, and both equal the 8-device update without accumulation.
    scanned, ms = run(devices, accum_steps, accum_loop="scan")
    unrolled, mu = run(devices, accum_steps, accum_loop="unroll")
    assert_trees_close(unrolled.params, scanned.params, rtol=1e-6, atol=1e-7)
    assert_trees_close(unrolled.batch_stats, scanned.batch_stats, rtol=1e-6, atol=1e-7)
    assert_trees_close(mu, ms, rtol=1e-6, atol=1e-7)
    ref, _ = run(8, 1, accum_loop="unroll")
    assert_trees_close(unrolled.params, ref.params)
    assert int(unrolled.step) == 2


def test_accum_loop_is_checked_and_auto_unrolls_on_cpu_only():
    assert parallel.resolve_accum_loop("auto", "cpu") == "unroll"
    assert parallel.resolve_accum_loop("auto", "gpu") == "scan"
    assert parallel.resolve_accum_loop("auto", "tpu") == "scan"
    assert parallel.resolve_accum_loop("scan", "cpu") == "scan"
    with pytest.raises(ValueError, match="accum_loop='loop' is not one of"):
        step_lib.make_train_step(model(), TX, LR_FN, 2, "loop")


def test_per_worker_bn_differs_from_global_batch_bn():
    per_worker, _ = run(8, 1)
    synced, _ = run(8, 1, bn_sync=True)
    assert max_rel_diff(per_worker.params, synced.params) > 1e-3
    assert max_rel_diff(per_worker.batch_stats, synced.batch_stats) > 1e-2
    # Synced BN over 8 x 4 images is BN over one group of all 32 (the Flax example).
    one_group, _ = run(1, 1, bn_group_size=KN)
    assert_trees_close(synced.params, one_group.params)
    assert_trees_close(synced.batch_stats, one_group.batch_stats)


def test_shard_map_and_pmap_give_the_same_update():
    a, ma = run(8, 1, "shard_map", steps=3)
    b, mb = run(8, 1, "pmap", steps=3)
    assert_trees_close(a.params, b.params, rtol=1e-6, atol=1e-7)
    assert_trees_close(a.batch_stats, b.batch_stats, rtol=1e-6, atol=1e-7)
    assert_trees_close(ma, mb, rtol=1e-6, atol=1e-7)
    assert int(b.step) == 3


def test_metrics_are_the_whole_minibatch_ones():
    _, history = run(8, 1)
    first = history[0]
    np.testing.assert_allclose(first["learning_rate"], float(LR_FN(0)), rtol=1e-7)
    np.testing.assert_allclose(history[1]["learning_rate"], float(LR_FN(1)), rtol=1e-7)
    # Remark 3: the loss is the mean over all kn images; recompute it on one device.
    net = model()
    state = initial_state()
    images, labels = BATCHES[0]["image"], BATCHES[0]["label"]

    @jax.jit
    def loss_and_grads(params):
        def loss_fn(p):
            logits, _ = net.apply(
                {"params": p, "batch_stats": state.batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    (loss, logits), grads = loss_and_grads(state.params)
    np.testing.assert_allclose(first["train_loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(
        first["train_error"], np.mean(np.argmax(logits, -1) != labels), rtol=1e-6
    )
    # The averaged gradient is the mean over kn (not a sum over devices).
    np.testing.assert_allclose(first["grad_norm"], optax.tree.norm(grads), rtol=1e-4)


def test_eval_counts_every_real_image_once():
    engine = parallel.DataParallel(parallel.create_mesh(), "shard_map")
    net = model()
    state = engine.replicate(initial_state())
    eval_step = engine.map(step_lib.make_eval_step(net))
    batch = dict(BATCHES[0], mask=(np.arange(KN) < 27).astype(np.float32))  # 5 padded
    sums = jax.device_get(eval_step(state, engine.shard_batch(batch)))
    host = initial_state()
    logits = net.apply(
        {"params": host.params, "batch_stats": host.batch_stats},
        BATCHES[0]["image"][:27],
        train=False,
    )
    labels = BATCHES[0]["label"][:27]
    assert sums["count"] == 27
    np.testing.assert_allclose(
        sums["loss_sum"],
        optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum(),
        rtol=1e-5,
    )
    assert sums["top1_errors"] == np.sum(np.argmax(logits, -1) != labels)
    top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
    assert sums["top5_errors"] == np.sum(~np.any(top5 == labels[:, None], axis=-1))


@pytest.mark.parametrize(
    "args,message",
    [
        ((30, 8, 1, 2), r"batch_size=30 is not divisible by devices x accum_steps = 8 x 1"),
        (
            (64, 8, 2, 3),
            r"batch_size=64 is not divisible by devices x accum_steps x "
            r"bn_group_size = 8 x 2 x 3",
        ),
        ((32, 8, 1, 8), r"bn_group_size=8 is larger than the per-device micro-batch 4"),
        ((32, 8, 0, 4), r"accum_steps=0 must be a positive integer"),
    ],
)
def test_bad_geometry_names_the_field_and_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        micro_batch(*args)


def test_bad_parallelism():
    with pytest.raises(ValueError, match="parallelism='pjit'"):
        parallel.DataParallel(parallel.create_mesh(), "pjit")


def test_prefetch_keeps_order_and_extras_and_raises_errors():
    engine = parallel.DataParallel(parallel.create_mesh())
    items = [({"x": np.full((16, 2), i, np.float32)}, {"step": i}) for i in range(5)]
    out = list(engine.prefetch(iter(items), size=2))
    assert [extra["step"] for _, extra in out] == list(range(5))
    assert [float(batch["x"][0, 0]) for batch, _ in out] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out[0][0]["x"].sharding == engine.sharded

    def broken():
        yield items[0]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(engine.prefetch(broken(), size=2))


# ------------------------------------------------------------------ reduction='exact'

EXACT_LAYOUTS = {  # (devices, accum_steps, parallelism): every layout of kn=32, n=4
    "4dev_x_8img": (4, 1, "shard_map"),
    "2dev_x_16img": (2, 1, "shard_map"),
    "1dev_x_32img": (1, 1, "shard_map"),
    "2dev_x_2accum_x_8img": (2, 2, "shard_map"),
    "1dev_x_8accum_x_4img": (1, 8, "shard_map"),
    "8dev_pmap": (8, 1, "pmap"),
}


@pytest.mark.parametrize("layout", list(EXACT_LAYOUTS))
def test_exact_mode_is_bit_identical_on_every_layout(layout):
    """The invariance promise, bitwise: two updates of kn=32, n=4 on 8 devices x 4
    images and on every other layout give the same bits of parameters, BN statistics,
    optimizer state and metrics."""
    ref_state, ref_metrics = run(8, 1, reduction="exact")
    state, metrics = run(*EXACT_LAYOUTS[layout], reduction="exact")
    assert int(state.step) == 2
    for part in ("params", "batch_stats", "opt_state"):
        assert digest(getattr(state, part)) == digest(getattr(ref_state, part)), part
    assert digest(metrics) == digest(ref_metrics)
    assert max_rel_diff(ref_state.params, initial_state().params) > 1e-3  # it moved


@pytest.mark.parametrize("layout", list(EXACT_LAYOUTS))
def test_exact_mode_with_lars_is_bit_identical_on_every_layout(layout):
    """LARS's per-layer trust ratios are norms, reductions XLA orders as it likes; the
    update is a program of its own with the same inputs in every layout, so they round
    the same way everywhere: the same bits as on 8 devices x 4 images."""
    ref_state, ref_metrics = run(8, 1, reduction="exact", optimizer="lars")
    state, metrics = run(*EXACT_LAYOUTS[layout], reduction="exact", optimizer="lars")
    for part in ("params", "batch_stats", "opt_state"):
        assert digest(getattr(state, part)) == digest(getattr(ref_state, part)), part
    assert digest(metrics) == digest(ref_metrics)
    sgd_state, _ = run(8, 1, reduction="exact")
    assert max_rel_diff(ref_state.params, sgd_state.params) > 1e-3  # LARS, not SGD


def test_exact_mode_is_the_same_math_as_fast():
    fast, fast_metrics = run(8, 1)
    exact_state, exact_metrics = run(8, 1, reduction="exact")
    assert_trees_close(exact_state.params, fast.params)
    assert_trees_close(exact_state.batch_stats, fast.batch_stats)
    assert_trees_close(exact_metrics, fast_metrics)


def tree_sum_reference(values: np.ndarray) -> np.float32:
    """The documented tree in plain float32 numpy: adjacent pairs, odd last carried up."""
    level = [np.float32(v) for v in values]
    while len(level) > 1:
        pairs = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2 :]
    return level[0]


def test_exact_sums_are_the_fixed_tree_not_a_reduce():
    """exact.tree_sum is the documented tree, bit for bit, on values whose sum depends
    on the order (a wide dynamic range); a reduce (jnp.sum, any order XLA picks) gives
    other bits on some of them, so replacing the tree by a reduce fails here."""
    rng = np.random.default_rng(0)
    differs_from_reduce = 0
    for length in range(1, 40):
        values = (rng.normal(size=length) * 10.0 ** rng.integers(-6, 8, size=length)).astype(
            np.float32
        )
        got = np.asarray(jax.jit(exact.tree_sum)(jnp.asarray(values)))
        assert got.tobytes() == tree_sum_reference(values).tobytes(), length
        differs_from_reduce += got.tobytes() != np.asarray(jnp.sum(values)).tobytes()
    assert differs_from_reduce > 0
    # the vector form, on every element of a parameter-like array
    block = (rng.normal(size=(3, 5, 7)) * 1e4).astype(np.float32)
    assert np.asarray(exact.vector_sum(jnp.asarray(block))).tobytes() == (
        tree_sum_reference(block.reshape(-1)).tobytes()
    )


def test_exact_step_sums_through_the_tree_with_no_all_reduce(monkeypatch):
    """The exact step's sums go through exact.tree_sum (over groups, devices, the norms)
    and its program has no all-reduce: a reduce put back in the step fails here."""
    calls = []
    real = exact.tree_sum
    monkeypatch.setattr(exact, "tree_sum", lambda x: calls.append(x.shape) or real(x))
    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[:4]), "shard_map")
    step = engine.map(
        step_lib.make_train_step(model(), TX, LR_FN, reduction="exact", bn_group_size=N)
    )
    state = engine.replicate(initial_state())
    hlo = step.lower(state, engine.shard_batch(BATCHES[0])).compile().as_text()
    assert "all-reduce" not in hlo
    assert "all-to-all" in hlo and "all-gather" in hlo
    groups_per_device = KN // 4 // N
    leaves = len(jax.tree.leaves((initial_state().params, initial_state().batch_stats)))
    over_groups = [c for c in calls if c and c[0] == groups_per_device]
    assert len(over_groups) >= leaves + 2  # every gradient and BN leaf, loss and error
    assert any(c == (4, c[1]) for c in calls if len(c) == 2)  # the devices' slices


def test_exact_mode_needs_a_power_of_two_of_groups_per_device():
    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[:8]), "shard_map")
    step = engine.map(
        step_lib.make_train_step(model(), TX, LR_FN, reduction="exact", bn_group_size=N)
    )
    batch = {k: np.concatenate([v, v, v]) for k, v in BATCHES[0].items()}  # 3 groups each
    with pytest.raises(ValueError, match="power-of-two number of BN groups per device"):
        step(engine.replicate(initial_state()), engine.shard_batch(batch))


def test_exact_mode_fixes_the_cpu_thread_count_and_refuses_one_below_the_devices():
    """XLA:CPU runs max(NPROC, local devices) threads; exact mode sets NPROC unless the
    user did, and refuses a value that the local devices would override."""
    environ = {}
    exact.fix_cpu_threads(environ)
    assert environ == {"NPROC": str(exact.CPU_THREADS)}
    kept = {"NPROC": "16"}
    exact.fix_cpu_threads(kept)
    assert kept == {"NPROC": "16"}
    assert exact.check_cpu_threads("cpu", 8, {"NPROC": "8"}) is None
    assert exact.check_cpu_threads("gpu", 8, {}) is None
    assert "set NPROC=16 before JAX starts" in exact.check_cpu_threads("cpu", 8, {})
    assert "NPROC=16 for every run" in exact.check_cpu_threads("cpu", 16, {"NPROC": "8"})


def exact_eval(devices: int) -> dict:
    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[:devices]), "shard_map")
    state, _ = run(8, 1, reduction="exact")  # trained BN statistics
    eval_step = engine.map(step_lib.make_eval_step(model(), None, "exact", N))
    batch = dict(BATCHES[2], mask=(np.arange(KN) < 27).astype(np.float32))
    return jax.device_get(eval_step(engine.replicate(state), engine.shard_batch(batch)))


def test_exact_eval_is_bit_identical_on_every_layout_and_counts_each_image_once():
    sums = {d: exact_eval(d) for d in (8, 2, 1)}
    assert digest(sums[2]) == digest(sums[8]) and digest(sums[1]) == digest(sums[8])
    engine = parallel.DataParallel(parallel.create_mesh(), "shard_map")
    state, _ = run(8, 1, reduction="exact")
    fast = engine.map(step_lib.make_eval_step(model()))
    batch = dict(BATCHES[2], mask=(np.arange(KN) < 27).astype(np.float32))
    expected = jax.device_get(fast(engine.replicate(state), engine.shard_batch(batch)))
    assert sums[8]["count"] == 27
    assert_trees_close(sums[8], expected)


@pytest.mark.parametrize(
    "changes,devices,message",
    [
        ({"batch_size": 96}, 8, r"power-of-two number of BN groups per device, but batch_size=96"),
        ({"bn_sync": True}, 8, r"does not apply with bn_sync=True"),
        ({"eval_batch_size": 80}, 8, r"eval_batch_size=80 gives 10 images per device"),
        ({"parallelism": "pmap"}, 8, r"on GPU compiles with XLA's determinism option"),
    ],
)
def test_exact_mode_config_limits_are_one_line(changes, devices, message):
    from configs import smoke
    from largebatch_jax.errors import ConfigError

    config = smoke.get_config()
    config.reduction = "exact"
    check_layout(config, devices, "gpu")  # the smoke config itself is fine
    config.update(changes)
    if "parallelism" in changes:  # pmap is fine on the other platforms
        check_layout(config, devices, "tpu")
    with pytest.raises(ConfigError, match=message):
        check_layout(config, devices, "gpu")


def test_exact_mode_takes_lars():
    from configs import smoke

    config = smoke.get_config()
    config.optimizer = "lars"
    assert config.reduction == "exact"  # the default
    for platform in ("cpu", "gpu", "tpu"):
        check_layout(config, 8, platform)


class _Tiny(nn.Module):
    """A dense layer and a BatchNorm: what create_train_state needs, fast to compile."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        return nn.BatchNorm(use_running_average=not train)(x)


def test_initialisation_draws_the_same_weights_whatever_the_processs_random_setting():
    """create_train_state picks its random stream itself (the package sets no JAX flag
    on import): a program that left JAX's default threefry on gets the same weights."""

    def bare_init():
        init = jax.jit(functools.partial(_Tiny().init, train=False))
        return init(jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 1)))["params"]

    before = jax.config.jax_threefry_partitionable
    states, bare = [], []
    try:
        for partitionable in (False, True):
            jax.config.update("jax_threefry_partitionable", partitionable)
            states.append(
                step_lib.create_train_state(jax.random.key(0), _Tiny(), TX, (SIZE, SIZE, 1))
            )
            bare.append(bare_init())
    finally:
        jax.config.update("jax_threefry_partitionable", before)
    same = jax.tree.map(lambda a, b: bool((a == b).all()), states[0].params, states[1].params)
    assert all(jax.tree.leaves(same))
    # The setting does change a bare init: the check above is not vacuous.
    differ = jax.tree.map(lambda a, b: bool((a != b).any()), bare[0], bare[1])
    assert any(jax.tree.leaves(differ))


@pytest.mark.parametrize("reduction", ["fast", "exact"])
def test_pixels_become_float32_one_micro_batch_at_a_time(reduction):
    """The step normalises each micro-step's (or BN group's) uint8 pixels when it uses
    them, never the device's whole batch at once: with accumulation that copy would hold
    every micro-step's images as float32 (kn=8192 on 8 GPUs: 588 MiB of temporaries)."""
    from configs import smoke
    from largebatch_jax import builder

    config = smoke.get_config()
    config.batch_size, config.accum_steps, config.reduction = 8 * 32, 4, reduction
    engine = parallel.DataParallel(parallel.create_mesh())
    training = builder.build_training(
        config, resolve(config, Facts(8, "cpu")), engine, abstract=True
    )
    shape = (config.batch_size, *training.input_shape)
    sharded = jax.sharding.NamedSharding(engine.mesh, jax.sharding.PartitionSpec(parallel.AXIS))
    batch = {
        "image": jax.ShapeDtypeStruct(shape, jnp.uint8, sharding=sharded),
        "label": jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=sharded),
    }
    text = training.train_step.lower(training.state, batch).as_text()
    converted = re.findall(r"stablehlo\.convert %\S+ : \(tensor<(\d+)x28x28x1xui8>\)", text)
    per_step = 8 if reduction == "fast" else config.bn_group_size  # a micro-step / a group
    assert converted and {int(n) for n in converted} == {per_step}, converted


def test_an_overflowing_update_keeps_the_state_and_raises_the_flag():
    """A finite loss and gradient times an overflowing learning rate
    (the diverging run's first bad step): the update is flagged non-finite and the state
    keeps its parameters, BN statistics and momentum (the step and the schedule's count
    advance), so no checkpoint can hold the overflow."""
    huge = optim.create_optimizer(lambda step: jnp.float32(1e30), weight_decay=1e-4)
    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[:2]))
    step = engine.map(step_lib.make_train_step(model(), huge, lambda step: 1e30))
    before = jax.device_get(
        step_lib.create_train_state(jax.random.key(0), model(), huge, (SIZE, SIZE, 1))
    )
    state, metrics = step(engine.replicate(before), engine.shard_batch(BATCHES[0]))
    metrics, state = jax.device_get((metrics, state))
    assert np.isfinite(metrics["train_loss"]) and np.isfinite(metrics["grad_norm"])
    assert metrics["nonfinite"] == 1.0 and int(state.step) == 1
    assert digest(float_leaves(state)) == digest(float_leaves(before))  # counters advance


def float_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
