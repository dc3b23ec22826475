"""The paper's baseline: ResNet-50, kn=256 (k=8 workers x n=32), lr 0.1, no warmup, 90 epochs.

Reproduces the kn=256 column of Figure 1 / Table 1's reference (23.60 +- 0.12 top-1 error).
"""

from configs import base


def get_config():
    return base.get_config()
