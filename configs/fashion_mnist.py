"""The main job of the README: a CPU run of minutes on real data (Fashion-MNIST,
60,000 training and 10,000 test images) with every rule of the paper.

ResNet-8 (width 8) on 14x14 images (2x2-averaged), kn=256 with n=32 (k=8 workers, as
the paper's baseline), lr 0.1, Nesterov momentum, weight decay 1e-4 on kernels, zero-gamma,
per-worker BN. The 90-epoch schedule is scaled to 4 epochs: step decays at 4/3, 8/3 and 32/9
epochs (30/90, 60/90, 80/90). Width 8 and 14x14 so that the whole run takes about two
minutes on 2 CPU cores (113 s measured on 8 fake devices).
Reproduces no table by itself; it is the base of the small-scale analogues.
"""

from configs import base


def get_config():
    c = base.get_config()
    c.dataset = "fashion_mnist"
    c.model = "resnet8"
    c.width = 8
    c.num_classes = 10
    c.image_size = 14
    c.channels = 1
    c.batch_size = 256
    c.bn_group_size = 32
    c.num_epochs = 4.0
    c.warmup_epochs = 4.0 * 5 / 90  # applies only above kn=256
    c.decay_epochs = (4.0 * 30 / 90, 4.0 * 60 / 90, 4.0 * 80 / 90)
    c.workers = 0
    c.eval_batch_size = 1024
    c.log_every_steps = 50
    c.checkpoint_every_steps = 200
    c.result_last_epochs = 1.0  # one evaluation per epoch: the last epoch's
    return c
