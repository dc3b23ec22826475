"""Seconds-long run for tests: ResNet-8 (width 8) on 14x14 Fashion-MNIST, a 1024-image
subset, kn=64 with n=4 (k=16 workers) on 8 devices, 2 epochs with warmup and decays.

Reproduces no table; it exercises every part of the program (warmup, per-worker BN,
evaluation, checkpoints, resume, the paper's metric) in well under a minute on CPU.
"""

from configs import fashion_mnist


def get_config():
    c = fashion_mnist.get_config()  # its data and model; a smaller, shorter run
    c.batch_size = 64
    c.bn_group_size = 4
    c.base_batch_size = 32  # so that kn=64 > base and the warmup is exercised
    c.num_epochs = 2.0
    c.warmup_epochs = 0.25
    c.decay_epochs = (1.0, 1.5)
    c.train_subset = 1024
    c.eval_subset = 500
    c.eval_batch_size = 128
    c.workers = 0
    c.log_every_steps = 4
    c.eval_every_epochs = 0.5
    c.checkpoint_every_steps = 8
    c.keep_checkpoints = 3
    c.result_last_epochs = 2.0
    c.prefetch_batches = 2  # the tests' runs (resume included) go through the prefetcher
    return c
