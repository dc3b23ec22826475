"""The matmul kernel gradient (models/conv.py) is the convolution's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from largebatch_jax.models import conv, create_model


@pytest.mark.parametrize(
    "kernel,stride,pad,channels",
    [
        (3, 1, 1, (8, 16)),  # the basic block's 3x3
        (3, 2, 1, (8, 16)),  # v1.5: the stride on the 3x3
        (1, 1, 0, (16, 8)),  # bottleneck 1x1
        (1, 2, 0, (8, 16)),  # projection shortcut
        (7, 2, 3, (3, 8)),  # ImageNet stem
    ],
)
def test_gradients_equal_xla(kernel, stride, pad, channels):
    c_in, c_out = channels
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4, 15, 15, c_in))
    w = jax.random.normal(kw, (kernel, kernel, c_in, c_out))
    args = ((stride, stride), ((pad, pad), (pad, pad)))
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(fn):
        def f(x, w):
            y = fn(x, w, *args, dimension_numbers=dn)
            return jnp.sum(y * jax.random.normal(kg, y.shape))

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    (v_ref, (dx_ref, dw_ref)) = loss(lax.conv_general_dilated)(x, w)
    (v, (dx, dw)) = loss(conv.conv_general_dilated)(x, w)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-3)


def test_other_convolutions_fall_through_to_xla():
    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 1, 4))
    y = conv.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=4
    )
    assert y.shape == (2, 8, 8, 4)


def test_resnet_gradients_match_across_conv_impls():
    x = jax.random.normal(jax.random.key(1), (8, 14, 14, 1))
    labels = jnp.arange(8) % 10
    grads = {}
    for impl in ("xla", "matmul"):
        model = create_model("resnet8", 10, 4, width=8, conv_impl=impl)
        variables = model.init(jax.random.key(0), x, train=False)

        def loss(params, model=model, variables=variables):
            logits, _ = model.apply(
                {**variables, "params": params}, x, train=True, mutable=["batch_stats"]
            )
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(8), labels])

        grads[impl] = jax.grad(loss)(variables["params"])
    for a, b in zip(jax.tree.leaves(grads["xla"]), jax.tree.leaves(grads["matmul"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
