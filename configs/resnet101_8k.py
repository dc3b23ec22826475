"""ResNet-101 at kn=8192 with the same recipe: Table 2c (22.36 +- 0.09; 22.08 at kn=256)."""

from configs import base


def get_config():
    c = base.get_config()
    c.model = "resnet101"
    c.batch_size = 8192
    return c
