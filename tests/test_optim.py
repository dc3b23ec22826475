"""Paper rules 4-6: Nesterov SGD, coupled masked weight decay, Remarks 1 and 2."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from largebatch_jax import optim
from largebatch_jax.models import create_model


@pytest.fixture(scope="module")
def params():
    model = create_model("resnet8", 10, 4, width=4)
    variables = jax.jit(model.init, static_argnames="train")(
        jax.random.key(0), jnp.zeros((1, 8, 8, 1)), train=False
    )
    # Give BN parameters non-trivial values so that decay on them would show.
    return jax.tree.map(lambda p: p + 0.5, variables["params"])


def flat(tree):
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def test_default_mask_decays_kernels_only(params):
    mask = flat(optim.weight_decay_mask(params))
    assert mask["classifier/kernel"] and mask["stem_conv/kernel"]
    assert not mask["classifier/bias"]
    assert not mask["stem_bn/scale"] and not mask["stem_bn/bias"]
    kinds = {k.rsplit("/", 1)[1] for k, v in mask.items() if v}
    assert kinds == {"kernel"}
    with_bn = flat(optim.weight_decay_mask(params, decay_batchnorm=True))
    assert with_bn["stem_bn/scale"] and with_bn["stem_bn/bias"] and not with_bn["classifier/bias"]
    with_bias = flat(optim.weight_decay_mask(params, decay_bias=True))
    assert with_bias["classifier/bias"] and not with_bias["stem_bn/bias"]


def test_bn_params_untouched_by_decay(params):
    """Zero gradient: only weight decay moves parameters, and only the kernels."""
    tx = optim.create_optimizer(optax.constant_schedule(0.1), weight_decay=1e-2)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = flat(optax.apply_updates(params, updates))
    old = flat(params)
    for name, value in new.items():
        if name.endswith("kernel"):
            # Nesterov's first step applies (1 + m) * lr * wd * w.
            np.testing.assert_allclose(value, old[name] * (1 - 1.9 * 0.1 * 1e-2), rtol=1e-6)
        else:
            np.testing.assert_array_equal(value, old[name])


def random_grads(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)


def test_remark1_loss_scaling_is_not_lr_scaling(params):
    """Scaling the loss by c scales g but not wd*w; scaling the rate by c scales both."""
    c, eta, wd, m = 4.0, 0.1, 1e-2, 0.9
    g = random_grads(params, 1)

    def first_update(lr, grads, weight_decay):
        tx = optim.create_optimizer(optax.constant_schedule(lr), weight_decay=weight_decay)
        return tx.update(grads, tx.init(params), params)[0]

    scaled_g = jax.tree.map(lambda x: c * x, g)
    # Without weight decay the two are the same update.
    a = first_update(c * eta, g, 0.0)
    b = first_update(eta, scaled_g, 0.0)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8), a, b)
    # With it, they differ by exactly (1 + m) * eta * (c - 1) * wd * w on decayed params.
    a = first_update(c * eta, g, wd)
    b = first_update(eta, scaled_g, wd)
    mask = flat(optim.weight_decay_mask(params))
    fa, fb, fp = flat(a), flat(b), flat(params)
    for name in fa:
        expected = -(1 + m) * eta * (c - 1) * wd * fp[name] if mask[name] else 0.0 * fp[name]
        np.testing.assert_allclose(fa[name] - fb[name], expected, rtol=1e-3, atol=1e-6)
    assert max(float(jnp.max(jnp.abs(fa[n] - fb[n]))) for n in fa) > 1e-6


def run(tx, params, steps):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    trajectory = []
    for t in range(steps):
        params, state = step(params, state, random_grads(params, 100 + t))
        trajectory.append(params)
    return trajectory


def max_rel_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("nesterov", [True, False])
def test_remark2_caffe2_form_with_correction_equals_optax_form(params, nesterov):
    """Through a gradual warmup (0.1 -> 3.2 over 10 steps) and a x0.1 decay at step 15."""

    def lr(t):
        return jnp.where(t < 10, 0.1 + (3.2 - 0.1) * t / 10, jnp.where(t < 15, 3.2, 0.32))

    kw = dict(weight_decay=1e-4, nesterov=nesterov)
    ref = run(optim.create_optimizer(lr, **kw), params, 20)
    corrected = run(optim.create_optimizer(lr, update_form="caffe2", **kw), params, 20)
    plain = run(
        optim.create_optimizer(lr, update_form="caffe2", momentum_correction=False, **kw),
        params,
        20,
    )
    for t in range(20):
        assert max_rel_diff(corrected[t], ref[t]) < 1e-5, t
    # Uncorrected: the same at step 1 (empty buffer), then off as soon as the rate moves.
    assert max_rel_diff(plain[0], ref[0]) < 1e-6
    assert max_rel_diff(plain[9], ref[9]) > 1e-3
    assert max_rel_diff(plain[19], ref[19]) > 1e-3


def test_caffe2_form_constant_rate_needs_no_correction(params):
    lr = optax.constant_schedule(0.4)
    a = run(optim.create_optimizer(lr, update_form="caffe2", momentum_correction=False), params, 5)
    b = run(optim.create_optimizer(lr), params, 5)
    assert max_rel_diff(a[-1], b[-1]) < 1e-5


def test_lars_option_steps_and_skips_bn(params):
    tx = optim.create_optimizer(optax.constant_schedule(1.0), optimizer="lars")
    zeros = jax.tree.map(jnp.zeros_like, params)
    new = flat(optax.apply_updates(params, tx.update(zeros, tx.init(params), params)[0]))
    old = flat(params)
    np.testing.assert_array_equal(new["stem_bn/scale"], old["stem_bn/scale"])
    assert not np.allclose(new["stem_conv/kernel"], old["stem_conv/kernel"])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"update_form": "torch"}, "update_form"),
        ({"optimizer": "adam"}, "optimizer"),
        ({"momentum": 1.0}, "momentum"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        optim.create_optimizer(optax.constant_schedule(0.1), **kwargs)
