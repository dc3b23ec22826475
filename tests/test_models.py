"""Paper rules 10-12: ResNet v1.5 architecture, parameter counts and initialisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from largebatch_jax.models import create_model


def init(model, size, channels=3):
    return jax.jit(model.init, static_argnames="train")(
        jax.random.key(0), jnp.zeros((1, size, size, channels)), train=False
    )


def count(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def flat(tree):
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


# torchvision's counts for the same architectures (v1.5 has the same parameters as v1).
@pytest.mark.parametrize(
    "name,params",
    [
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("resnet101", 44_549_160),
        ("resnet152", 60_192_808),
    ],
)
def test_imagenet_parameter_counts(name, params):
    model = create_model(name, 1000, 32)
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)
    )
    assert count(shapes["params"]) == params


@pytest.fixture(scope="module")
def resnet50():
    return flat(init(create_model("resnet50", 1000, 32), 32)["params"])


def test_zero_gamma_on_last_bn_of_each_block_only(resnet50):
    last_bn = [k for k in resnet50 if k.endswith("bn3/scale")]
    assert len(last_bn) == 16  # 3 + 4 + 6 + 3 bottlenecks
    for name, value in resnet50.items():
        if name.endswith("bn3/scale"):
            np.testing.assert_array_equal(value, 0.0)
        elif name.endswith("/scale"):
            np.testing.assert_array_equal(value, 1.0)
        elif name.endswith("/bias"):
            np.testing.assert_array_equal(value, 0.0)


def test_gamma_one_when_not_asked():
    params = flat(init(create_model("resnet8", 10, 4, zero_init_residual=False), 8)["params"])
    scales = [v for k, v in params.items() if k.endswith("/scale")]
    assert len(scales) == 1 + 3 * 2 + 2  # stem, two per block, two projections
    for v in scales:
        np.testing.assert_array_equal(v, 1.0)
    zero = flat(init(create_model("resnet8", 10, 4), 8)["params"])
    np.testing.assert_array_equal(zero["stage1_block1/bn2/scale"], 0.0)
    np.testing.assert_array_equal(zero["stage1_block1/bn1/scale"], 1.0)


@pytest.mark.parametrize(
    "name,fan_in,fan_out",
    [
        ("stage4_block2/conv2/kernel", 9 * 512, 9 * 512),
        ("stage2_block1/conv3/kernel", 128, 512),  # 1x1 expansion: fan-out 4x fan-in
        ("stage3_block1/proj_conv/kernel", 512, 1024),
        ("stage4_block1/conv1/kernel", 1024, 512),  # 1x1 reduction: fan-out < fan-in
        ("stem_conv/kernel", 49 * 3, 49 * 64),
    ],
)
def test_conv_init_is_he_normal_fan_out(resnet50, name, fan_in, fan_out):
    w = np.asarray(resnet50[name], np.float64)
    expected = 2.0 / fan_out
    assert w.var() == pytest.approx(expected, rel=0.05 if w.size > 1e5 else 0.12)
    assert abs(w.mean()) < 3 * np.sqrt(expected / w.size)
    if fan_in != fan_out:  # fan-in He would give 2/fan_in, far outside the tolerance
        assert abs(w.var() - 2.0 / fan_in) > 0.3 * expected
    # Untruncated normal: about 0.27% of draws lie beyond 3 std.
    assert np.mean(np.abs(w) > 3 * np.sqrt(expected)) > 0.001


def test_classifier_init(resnet50):
    w = np.asarray(resnet50["classifier/kernel"], np.float64)
    assert w.shape == (2048, 1000)
    assert w.std() == pytest.approx(0.01, rel=0.01)
    np.testing.assert_array_equal(resnet50["classifier/bias"], 0.0)


def conv_shapes(name, size):
    """Input and output shapes of every conv, without computing anything."""
    model = create_model(name, 10, 1)
    x = jnp.zeros((1, size, size, 3))

    def run():
        variables = model.init(jax.random.key(0), x, train=False)
        _, state = model.apply(
            variables,
            x,
            train=False,
            capture_intermediates=lambda m, _: "conv" in (m.name or ""),
            mutable=["intermediates"],
        )
        return state["intermediates"]

    return {k: v[0].shape for k, v in flat(jax.eval_shape(run)).items()}


def test_v15_stride_on_the_3x3():
    shapes = conv_shapes("resnet50", 64)
    # Stage 2 halves the 16x16 maps of stage 1 on its first block's 3x3 conv.
    assert shapes["stage2_block1/conv1/__call__"] == (1, 16, 16, 128)
    assert shapes["stage2_block1/conv2/__call__"] == (1, 8, 8, 128)
    assert shapes["stage2_block1/proj_conv/__call__"] == (1, 8, 8, 512)
    assert shapes["stem_conv/__call__"] == (1, 32, 32, 64)
    assert "stage2_block2/proj_conv/__call__" not in shapes  # identity where shape is kept


@pytest.mark.parametrize("depth", [8, 20, 32, 56])
def test_cifar_family_depth_and_widths(depth):
    width = 16
    model = create_model(f"resnet{depth}", 10, 4, width=width)
    params = flat(
        jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)
        )["params"]
    )
    convs = [k for k in params if k.endswith("kernel") and "proj" not in k]
    # depth = weighted layers on the main path: 6n + 1 convs and the classifier.
    assert len(convs) == depth
    assert len([k for k in params if "proj_conv" in k]) == 2  # stages 2 and 3 only
    assert params["stem_conv/kernel"].shape == (3, 3, 3, width)
    n = (depth - 2) // 6
    assert params[f"stage3_block{n}/conv2/kernel"].shape == (3, 3, 4 * width, 4 * width)
    assert params["classifier/kernel"].shape == (4 * width, 10)


def test_forward_shapes_and_dtype():
    model = create_model("resnet20", 10, 4, width=8, dtype="bfloat16")
    variables = init(model, 16, 1)
    apply = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))
    logits, _ = apply(variables, jnp.ones((8, 16, 16, 1)))
    assert logits.shape == (8, 10) and logits.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"name": "resnet51"}, "model"),
        ({"dtype": "float8"}, "dtype"),
        ({"num_classes": 0}, "num_classes"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    args = {"name": "resnet20", "num_classes": 10, "bn_group_size": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        create_model(**args)
