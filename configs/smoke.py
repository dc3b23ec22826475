"""Seconds-long run for tests and the demo: ResNet-8 (width 8) on 16x16 inputs, kn=64, n=4.

Reproduces no table; it exercises every rule of the recipe (warmup, per-worker BN,
Nesterov SGD with masked weight decay) at a size that runs on 8 fake CPU devices.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.model = "resnet8"
    c.width = 8
    c.num_classes = 10
    c.image_size = 16
    c.channels = 1
    c.batch_size = 64
    c.bn_group_size = 4
    c.base_batch_size = 32  # so that kn=64 > base and warmup is exercised
    c.num_epochs = 2.0
    c.warmup_epochs = 0.5
    c.decay_epochs = (1.0, 1.5)
    c.demo_steps = 10
    c.demo_steps_per_epoch = 4
    return c
