"""ResNet-20 on CIFAR-10 (He et al. 2016's model) with the paper's recipe scaled to a
small problem, for a GPU/TPU or Colab: kn=128 baseline with lr 0.1 per 128 and per-worker
BN of n=32; raise batch_size to see Figure 1's shape (the warmup applies above 128).

Schedule: 90 epochs with the paper's decays at 30/60/80 and 5 warmup epochs.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.dataset = "cifar10"
    c.model = "resnet20"
    c.num_classes = 10
    c.image_size = 32
    c.channels = 3
    c.batch_size = 128
    c.base_batch_size = 128
    c.bn_group_size = 32
    c.workers = 0
    c.eval_batch_size = 1024
    c.log_every_steps = 50
    c.checkpoint_every_steps = 500
    return c
