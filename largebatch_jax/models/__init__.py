"""Models: per-worker BatchNorm and the ResNet families of the paper."""

from largebatch_jax.models.resnet import MODEL_NAMES, create_model

__all__ = ["MODEL_NAMES", "create_model"]
