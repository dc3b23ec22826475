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
the paper's default (configs/base.py). Any field can also be overridden as a flag.
"""

from configs import base

_CAST = {
    bool: lambda v: v.lower() in ("1", "true", "yes"),
    int: int,
    float: float,
    str: str,
    tuple: lambda v: tuple(float(x) for x in v.split(";")),  # decay_epochs=30;60;80
}


def get_config(arg: str | None = None):
    c = base.get_config()
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        if key not in c:
            raise ValueError(f"configs/imagenet.py: unknown field {key!r} in {arg!r}.")
        c[key] = _CAST[type(c[key])](value)
    return c
