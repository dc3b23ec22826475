"""Paper defaults (README, "Running the paper"): ResNet-50, kn=256 with n=32, Goyal et al. 2017.

Every other config starts from this one and overrides a few fields; the names follow
the README's vocabulary (`batch_size` is kn, `bn_group_size` is n).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Model (rules 10-12).
    c.model = "resnet50"
    c.num_classes = 1000
    c.image_size = 224
    c.channels = 3
    c.width = 16  # first-stage channels of the CIFAR-style family only
    c.zero_init_residual = True  # rule 10
    c.dtype = "float32"
    # How convs compute their kernel gradient: 'xla' (XLA's own) or 'matmul' (per-tap
    # matrix products, models/conv.py). Same math. On XLA:CPU 'xla' gave the faster steps
    # for ResNet-8/20 and 'matmul' 1.15x for ResNet-50 at 64x64 (README, Performance).
    c.conv_impl = "xla"

    # Minibatch geometry (rules 7, 9, 15).
    c.batch_size = 256  # kn
    c.bn_group_size = 32  # n
    c.accum_steps = 1
    # How the accum_steps micro-steps are looped: 'auto' = a Python loop on CPU (XLA:CPU
    # runs a model several times slower inside lax.scan), lax.scan on GPU/TPU. Same math.
    c.accum_loop = "auto"
    c.bn_momentum = 0.9
    c.bn_epsilon = 1e-5
    c.bn_sync = False  # True: Flax-example global-batch BN (ablation only)
    # How the gradients, BN statistics and metrics of the k groups are summed: 'exact' =
    # bit-identical for every layout of the same kn and n (each group one call of one
    # compiled body, one fixed tree of adds; a power-of-two number of groups per device),
    # 'fast' = the micro-steps and XLA's all-reduce, equal to float rounding.
    c.reduction = "fast"

    # Learning-rate schedule (rules 1-3).
    c.base_lr = 0.1
    c.base_batch_size = 256
    c.lr_scaling = "linear"  # linear | sqrt | none
    # The peak rate is rule 1's times this (1 = the paper); > 1 only to test how large a
    # rate warmup makes usable (experiments/RESULTS.md).
    c.lr_multiplier = 1.0
    c.warmup = "gradual"  # gradual | constant | none; only when batch_size > base_batch_size
    c.warmup_epochs = 5.0
    c.lr_decay = "step"  # step | cosine
    c.decay_epochs = (30.0, 60.0, 80.0)
    c.decay_factor = 0.1
    c.num_epochs = 90.0

    # Optimizer (rules 4-6).
    c.optimizer = "sgd"  # sgd | lars
    c.momentum = 0.9
    c.nesterov = True
    c.weight_decay = 1e-4
    c.decay_batchnorm = False
    c.decay_bias = False
    c.update_form = "optax"  # optax | caffe2
    c.momentum_correction = True  # used by update_form='caffe2'
    c.lars_trust_coefficient = 0.001

    # Data (rules 8, 13).
    c.dataset = "imagenet2012"
    c.data_dir = ""  # "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    c.workers = 8  # decoding processes per host (0 = threads in the main process)
    c.eval_batch_size = 1024  # global, divisible by 256 devices; the last batch is padded
    c.color_augment = False  # fb.resnet.torch jitter + PCA lighting; not in the paper
    c.train_subset = 0  # > 0: train on the first that many examples (small runs, tests)
    c.eval_subset = 0

    # Loop, reporting (rule 14), checkpoints.
    c.log_every_steps = 100
    c.eval_every_epochs = 1.0
    c.checkpoint_every_steps = 1000
    c.keep_checkpoints = 3
    c.result_last_epochs = 5.0  # the paper's metric: median top-1 error of the last 5 epochs
    c.skip_nonfinite = False  # True: skip (and count) an update whose loss is not finite

    # Engine.
    c.parallelism = "shard_map"  # shard_map | pmap
    # Batches put on the devices ahead of the step, from a background thread (0: none).
    # Measured on CPU (experiments/benchmark.py --input=real): no gain, so off by default.
    c.prefetch_batches = 0
    return c
