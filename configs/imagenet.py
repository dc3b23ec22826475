"""ResNet-50 on ImageNet, any minibatch and any ablation of the paper, by argument:

  --config=configs/imagenet.py                                  kn=256 baseline
  --config=configs/imagenet.py:batch_size=8192                  Table 1 gradual warmup, Fig. 1
  --config=configs/imagenet.py:batch_size=8192,warmup=constant  Table 1 constant warmup
  --config=configs/imagenet.py:batch_size=8192,warmup=none      Table 1 no warmup
  --config=configs/imagenet.py:batch_size=8192,lr_scaling=none  Table 2a (sqrt likewise)
  --config=configs/imagenet.py:batch_size=8192,zero_init_residual=False   Table 2b
  --config=configs/imagenet.py:batch_size=8192,model=resnet101  Table 2c
  --config=configs/imagenet.py:batch_size=8192,bn_group_size=16           BN n ablation
  --config=configs/imagenet.py:batch_size=8192,update_form=caffe2,momentum_correction=False

batch_size runs over the paper's sweep 64 ... 65536 (Figure 1); everything not named keeps
the paper's default (configs/base.py). Values follow configs/overrides.py (tuples as
a;b;c). Any field can also be overridden as a flag.
"""

from configs import base
from configs.overrides import apply_overrides


def get_config(arg: str | None = None):
    return apply_overrides(base.get_config(), arg, where="configs/imagenet.py")
