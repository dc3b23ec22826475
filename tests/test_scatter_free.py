"""The forms the GPU step uses instead of scatters and sorts compute the paper's numbers:
the max-pool's gradient goes to the same element of every window, the cross-entropy is
the same to the bit, the training error the same 0s and 1s (README, "Compiled for
NVIDIA GPUs")."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from largebatch_jax import step
from largebatch_jax.models import create_model, pool


def _ties(rng, shape, dtype):
    """Post-ReLU activations on a coarse grid: many windows with equal maxima."""
    x = np.maximum(np.round(rng.normal(size=shape) * 2) / 2, 0).astype(np.float32)
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 112, 112, 3), (2, 7, 9, 2), (1, 2, 2, 1)])
def test_sliced_max_pool_picks_the_same_element_of_every_window(dtype, shape):
    rng = np.random.default_rng(0)
    x = _ties(rng, shape, dtype)
    y_xla, vjp_xla = jax.vjp(lambda x: pool.max_pool(x, "xla"), x)
    y_sliced, vjp_sliced = jax.vjp(lambda x: pool.max_pool(x, "slices"), x)
    assert y_sliced.dtype == y_xla.dtype and bool((y_sliced == y_xla).all())
    # Integer cotangents add exactly in any order: equal gradients = the same selection.
    g = jnp.asarray(rng.integers(-8, 8, y_xla.shape), dtype)
    assert bool((vjp_sliced(g)[0] == vjp_xla(g)[0]).all())
    # Real cotangents: an element picked by 3 or 4 overlapping windows sums them in
    # another order, so at most a rounding apart.
    g = jnp.asarray(rng.normal(size=y_xla.shape), dtype)
    a, b = (v(g)[0].astype(jnp.float32) for v in (vjp_sliced, vjp_xla))
    ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-23
    assert float(jnp.max(jnp.abs(a - b) / jnp.maximum(jnp.abs(b), 1.0))) <= 4 * ulp


def test_ties_go_to_the_first_element_in_row_major_order():
    x = jnp.zeros((1, 2, 2, 1)).at[0, 1, 1, 0].set(1.0).at[0, 0, 1, 0].set(1.0)  # one window
    grad = jax.grad(lambda x: pool.max_pool(x, "slices").sum())(x)
    reference = jax.grad(lambda x: pool.max_pool(x, "xla").sum())(x)
    assert bool((grad == reference).all())
    assert grad[0, :, :, 0].tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_a_gpu_model_computes_the_cpu_models_forward():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 32, 32, 3)), jnp.float32)
    models = [create_model("resnet18", 10, 2, pool_impl=impl) for impl in ("xla", "slices")]
    with step.one_random_stream():
        variables = models[0].init(jax.random.key(0), x, train=False)
    a, b = (m.apply(variables, x, train=False) for m in models)
    assert bool((a == b).all())


def test_scatter_free_cross_entropy_is_optaxs_loss_to_the_bit():
    rng = np.random.default_rng(2)
    for n, c in ((8, 10), (32, 1000), (64, 10)):
        logits = jnp.asarray(rng.normal(size=(n, c)) * 3, jnp.float32)
        labels = jnp.asarray(rng.integers(0, c, n), jnp.int32)
        ours = step.cross_entropy(logits, labels, scatter_free=True)
        theirs = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        assert bool((ours == theirs).all())
        grads = [
            jax.grad(lambda z, y=labels, sf=sf: step.mean_cross_entropy(z, y, sf))(logits)
            for sf in (False, True)
        ]
        np.testing.assert_allclose(grads[1], grads[0], rtol=0, atol=1e-8)


def test_sort_free_top1_error_is_top_k_with_ties():
    logits = jnp.asarray([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [0.0, 0.0, 5.0]])
    for labels in ([1, 0, 2], [2, 1, 0]):
        labels = jnp.asarray(labels)
        assert bool(
            (step.topk_errors(logits, labels, 1, True) == step.topk_errors(logits, labels, 1)).all()
        )
