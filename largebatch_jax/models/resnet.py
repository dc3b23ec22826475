"""ResNets of the paper: rules 10-12 (README, "Where each rule of the paper lives").

ImageNet family: ResNet v1.5 18/34/50/101/152 (fb.resnet.torch variant: the stride of a
bottleneck sits on its 3x3 conv; projection shortcuts only where the shape changes).
CIFAR family (He et al. 2016, section 4.2): ResNet-8/20/32/56, three stages of 16/32/64
channels (times `width / 16`), for the small-scale reproductions.
Every BatchNorm is the per-worker one (models/batchnorm.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from largebatch_jax.models import conv as conv_lib
from largebatch_jax.models import pool as pool_lib
from largebatch_jax.models.batchnorm import BatchNorm


def conv_init() -> nn.initializers.Initializer:
    """Paper rule 11: conv kernels He-normal with fan-out, std = sqrt(2 / (k*k*c_out)).

    Untruncated, as fb.resnet.torch / Caffe2's MSRAFill (Flax's default is lecun fan-in).
    """
    return nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def classifier_init() -> nn.initializers.Initializer:
    """Paper rule 11: the final fully-connected layer is drawn from N(0, 0.01^2)."""
    return nn.initializers.normal(stddev=0.01)


def residual_gamma_init(zero_init_residual: bool) -> nn.initializers.Initializer:
    """Paper rule 10, zero-gamma: the last BN of each residual block starts with gamma 0,
    so every block starts as the identity (Table 2b ablates it with gamma = 1)."""
    return nn.initializers.zeros if zero_init_residual else nn.initializers.ones


class _Layers(nn.Module):
    """Shared pieces: convs with the paper's init and per-worker BN."""

    bn_group_size: int
    bn_momentum: float
    bn_epsilon: float
    bn_axis_name: str | None
    dtype: Any
    conv_impl: str = "xla"

    def conv(self, features, kernel, strides=1, name=None):
        pad = (kernel - 1) // 2
        return nn.Conv(
            features,
            (kernel, kernel),
            strides=(strides, strides),
            padding=((pad, pad), (pad, pad)),  # explicit, as Torch/Caffe2 pad
            use_bias=False,
            kernel_init=conv_init(),
            dtype=self.dtype,
            param_dtype=jnp.float32,
            conv_general_dilated=CONV_IMPLS[self.conv_impl],
            name=name,
        )

    def norm(self, scale_init=nn.initializers.ones, name=None):
        return BatchNorm(
            group_size=self.bn_group_size,
            momentum=self.bn_momentum,
            epsilon=self.bn_epsilon,
            axis_name=self.bn_axis_name,
            scale_init=scale_init,
            dtype=self.dtype,
            name=name,
        )


class BasicBlock(_Layers):
    """Two 3x3 convs (ResNet-18/34 and the CIFAR family)."""

    features: int = 64
    strides: int = 1
    zero_init_residual: bool = True
    expansion = 1

    @nn.compact
    def __call__(self, x, train: bool):
        y = self.conv(self.features, 3, self.strides, name="conv1")(x)
        y = nn.relu(self.norm(name="bn1")(y, not train))
        y = self.conv(self.features, 3, name="conv2")(y)
        y = self.norm(residual_gamma_init(self.zero_init_residual), name="bn2")(y, not train)
        return nn.relu(y + _shortcut(self, x, self.features, train))


class Bottleneck(_Layers):
    """1x1 -> 3x3 (with the stride, v1.5) -> 1x1 with 4x expansion (ResNet-50/101/152)."""

    features: int = 64
    strides: int = 1
    zero_init_residual: bool = True
    expansion = 4

    @nn.compact
    def __call__(self, x, train: bool):
        y = self.conv(self.features, 1, name="conv1")(x)
        y = nn.relu(self.norm(name="bn1")(y, not train))
        y = self.conv(self.features, 3, self.strides, name="conv2")(y)
        y = nn.relu(self.norm(name="bn2")(y, not train))
        y = self.conv(self.features * 4, 1, name="conv3")(y)
        y = self.norm(residual_gamma_init(self.zero_init_residual), name="bn3")(y, not train)
        return nn.relu(y + _shortcut(self, x, self.features * 4, train))


def _shortcut(block: Any, x: jax.Array, out_features: int, train: bool) -> jax.Array:
    """Paper rule 12: identity, or a 1x1 projection + BN only where the shape changes."""
    if block.strides == 1 and x.shape[-1] == out_features:
        return x
    proj = block.conv(out_features, 1, block.strides, name="proj_conv")(x)
    return block.norm(name="proj_bn")(proj, not train)


class ResNet(_Layers):
    """A ResNet: stem, stages of residual blocks, global average pool, classifier.

    `cifar_stem=True` is the 3x3/16-channel stem of the CIFAR family (no max-pool);
    otherwise the ImageNet 7x7/2 conv + 3x3/2 max-pool stem (`pool_impl`: models/pool.py,
    the same numbers either way).
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    block_cls: Any = Bottleneck
    num_classes: int = 1000
    stem_features: int = 64
    stage_features: Sequence[int] = (64, 128, 256, 512)
    cifar_stem: bool = False
    zero_init_residual: bool = True
    pool_impl: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = x.astype(self.dtype)
        if self.cifar_stem:
            x = self.conv(self.stem_features, 3, name="stem_conv")(x)
            x = nn.relu(self.norm(name="stem_bn")(x, not train))
        else:
            x = self.conv(self.stem_features, 7, 2, name="stem_conv")(x)
            x = nn.relu(self.norm(name="stem_bn")(x, not train))
            x = pool_lib.max_pool(x, self.pool_impl)
        block = functools.partial(
            self.block_cls,
            bn_group_size=self.bn_group_size,
            bn_momentum=self.bn_momentum,
            bn_epsilon=self.bn_epsilon,
            bn_axis_name=self.bn_axis_name,
            dtype=self.dtype,
            conv_impl=self.conv_impl,
            zero_init_residual=self.zero_init_residual,
        )
        for i, (blocks, features) in enumerate(
            zip(self.stage_sizes, self.stage_features, strict=True)
        ):
            for j in range(blocks):
                strides = 2 if i > 0 and j == 0 else 1
                x = block(features=features, strides=strides, name=f"stage{i + 1}_block{j + 1}")(
                    x, train
                )
        x = jnp.mean(x, axis=(1, 2))
        logits = nn.Dense(
            self.num_classes,
            kernel_init=classifier_init(),
            bias_init=nn.initializers.zeros,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            name="classifier",
        )(x)
        return logits.astype(jnp.float32)  # the loss is always computed in float32


IMAGENET_DEPTHS = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}
CIFAR_DEPTHS = (8, 20, 32, 56)
MODEL_NAMES = tuple(f"resnet{d}" for d in (*IMAGENET_DEPTHS, *CIFAR_DEPTHS))

# 'xla': lax.conv_general_dilated throughout; 'matmul': the kernel gradient as per-tap
# matrix products (models/conv.py), faster on XLA:CPU for some shapes. Same math to float
# rounding.
CONV_IMPLS = {"xla": None, "matmul": conv_lib.conv_general_dilated}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def create_model(
    name: str,
    num_classes: int,
    bn_group_size: int,
    zero_init_residual: bool = True,
    dtype: Any = jnp.float32,
    *,
    width: int = 16,
    bn_momentum: float = 0.9,
    bn_epsilon: float = 1e-5,
    bn_axis_name: str | None = None,
    conv_impl: str = "xla",
    pool_impl: str = "xla",
) -> ResNet:
    """A ResNet by name: resnet18/34/50/101/152 (ImageNet, v1.5) or resnet8/20/32/56 (CIFAR).

    `width` is the first-stage channel count of the CIFAR family (16 in He et al.).
    `bn_axis_name` switches BN from per-worker groups to statistics synchronised over
    that axis (the Flax-example behaviour; only for the ablation). `pool_impl`: how the
    ImageNet stem's max-pool is differentiated (`pool.pool_impl_for` the platform).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {tuple(DTYPES)}.")
        dtype = DTYPES[dtype]
    if name not in MODEL_NAMES:
        raise ValueError(f"model={name!r} is not one of {MODEL_NAMES}.")
    if num_classes <= 0:
        raise ValueError(f"num_classes={num_classes} must be > 0.")
    if conv_impl not in CONV_IMPLS:
        raise ValueError(f"conv_impl={conv_impl!r} is not one of {tuple(CONV_IMPLS)}.")
    if pool_impl not in pool_lib.POOL_IMPLS:
        raise ValueError(f"pool_impl={pool_impl!r} is not one of {pool_lib.POOL_IMPLS}.")
    common = dict(
        num_classes=num_classes,
        bn_group_size=bn_group_size,
        bn_momentum=bn_momentum,
        bn_epsilon=bn_epsilon,
        bn_axis_name=bn_axis_name,
        dtype=dtype,
        zero_init_residual=zero_init_residual,
        conv_impl=conv_impl,
    )
    depth = int(name.removeprefix("resnet"))
    if depth in IMAGENET_DEPTHS:
        block_cls, stages = IMAGENET_DEPTHS[depth]
        return ResNet(stage_sizes=stages, block_cls=block_cls, pool_impl=pool_impl, **common)
    if width <= 0:
        raise ValueError(f"width={width} must be > 0.")
    n = (depth - 2) // 6
    return ResNet(
        stage_sizes=(n, n, n),
        block_cls=BasicBlock,
        stem_features=width,
        stage_features=(width, 2 * width, 4 * width),
        cifar_stem=True,
        **common,
    )
