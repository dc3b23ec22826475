"""The config's fields, in one table: for each its default, type, check, role and, for a
field added after workdirs began recording their config, the value that gives the math of
the runs recorded before it existed.

Everything else derives from this table: `configs/base.py` (the defaults),
`validate.RULES` (types and checks), `record.MAY_CHANGE` and `record.BEFORE_FIELD`
(what a resume compares) and `HOST_LOCAL` (what the processes of one run need not share).
Adding a field is one entry here; `tests/test_configs.py` checks the derivations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ml_collections

# The choices of the fields that name code, listed here so that the table (and a config
# file) loads without JAX; tests/test_configs.py checks each against the code's own list.
MODEL_NAMES = tuple(
    f"resnet{d}" for d in (18, 34, 50, 101, 152, 8, 20, 32, 56)
)  # models.resnet.MODEL_NAMES
DTYPES = ("float32", "bfloat16", "float16")  # models.resnet.DTYPES
CONV_IMPLS = ("xla", "matmul")  # models.resnet.CONV_IMPLS
OPTIMIZERS = ("sgd", "lars")  # optim.OPTIMIZERS
UPDATE_FORMS = ("optax", "caffe2")  # optim.UPDATE_FORMS
REDUCTIONS = ("fast", "exact")  # step.REDUCTIONS
ACCUM_LOOPS = ("scan", "unroll")  # parallel.ACCUM_LOOPS
PARALLELISMS = ("shard_map", "pmap")  # parallel.PARALLELISMS
LR_SCALING_RULES = ("linear", "sqrt", "none")  # schedules.LR_SCALING_RULES
WARMUP_KINDS = ("gradual", "constant", "none")  # schedules.WARMUP_KINDS
DECAY_KINDS = ("step", "cosine")  # schedules.DECAY_KINDS

# Roles. MATH: enters the updates, so a resume must keep it (num_epochs may grow while the
# learning rate of every step trained stays the same: record.check_resume). LAYOUT: how
# the same math is laid out on devices and steps (the invariance promise makes it free).
# REPORTING: what is reported and saved, and when; whether a non-finite update stops the
# run (it changes no update made). HOST: paths and host resources, which may also differ
# between the processes of one run.
MATH, LAYOUT, REPORTING, HOST = "math", "layout", "reporting", "host"

# `before` of a field recorded since workdirs began recording their config.
RECORDED = object()

# Decoding processes or threads per host: beyond any host's cores (a typo of 80000 would
# start that many processes).
MAX_DECODERS = 256

# Far beyond any run (the paper's is 90); keeps step counts within 32-bit integers.
MAX_EPOCHS = 10_000


@dataclasses.dataclass(frozen=True)
class Field:
    default: Any
    types: tuple[type, ...] | None  # None: validate.validate_fields checks it itself
    check: Callable[[Any], bool] | None
    meaning: str  # what `check` requires, for the error line
    role: str
    before: Any = RECORDED


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _one_of(choices: tuple | dict) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in choices), f"one of {tuple(choices)}"


def _choice(default: str, choices: tuple | dict, role: str = MATH, **kw: Any) -> Field:
    check, meaning = _one_of(choices)
    return Field(default, (str,), check, meaning, role, **kw)


def _flag(default: bool, role: str = MATH) -> Field:
    return Field(default, (bool,), None, "", role)


def _count(default: int, role: str = MATH, minimum: int = 1) -> Field:
    check, meaning = (_positive, "> 0") if minimum else (_non_negative, ">= 0")
    return Field(default, (int,), check, meaning, role)


NUMBER = (float, int)

FIELDS: dict[str, Field] = {
    "seed": Field(0, (int,), lambda v: 0 <= v < 2**31, "in [0, 2**31) (JAX's 32-bit seeds)", MATH),
    # Model (rules 10-12).
    "model": _choice("resnet50", MODEL_NAMES),
    "num_classes": _count(1000),
    "image_size": _count(224),
    "channels": Field(3, (int,), lambda v: v in (1, 3), "1 or 3", MATH),
    "width": _count(16),  # first-stage channels of the CIFAR-style family only
    "zero_init_residual": _flag(True),  # rule 10
    "dtype": _choice("float32", DTYPES),
    # How convs compute their kernel gradient: 'xla' (XLA's own) or 'matmul' (per-tap
    # matrix products, models/conv.py). Same math, other rounding.
    "conv_impl": _choice("xla", CONV_IMPLS),
    # Minibatch geometry (rules 7, 9, 15): batch_size is kn, bn_group_size is n.
    "batch_size": _count(256),
    "bn_group_size": _count(32),
    "accum_steps": _count(1, LAYOUT),
    # How the accum_steps micro-steps are looped: 'auto' = a Python loop on CPU (XLA:CPU
    # runs a model several times slower inside lax.scan), lax.scan on GPU/TPU. Same math.
    "accum_loop": Field(
        "auto",
        (str,),
        lambda v: v == "auto" or v in ACCUM_LOOPS,
        f"'auto' or one of {ACCUM_LOOPS}",
        LAYOUT,
    ),
    "bn_momentum": Field(0.9, (float,), lambda v: 0 <= v < 1, "in [0, 1)", MATH),
    "bn_epsilon": Field(1e-5, (float,), _positive, "> 0", MATH),
    "bn_sync": _flag(False),  # True: Flax-example global-batch BN (ablation only)
    # How the k groups' gradients, BN statistics and metrics are summed: 'exact' =
    # bit-identical for every layout of the same kn and n (grouped.py, exact.py; a
    # power-of-two number of groups per device), 'fast' = XLA's all-reduce, equal to float
    # rounding. Records made before the field existed were fast.
    "reduction": _choice("exact", REDUCTIONS, before="fast"),
    # Learning-rate schedule (rules 1-3).
    "base_lr": Field(0.1, NUMBER, _positive, "> 0", MATH),
    "base_batch_size": _count(256),
    "lr_scaling": _choice("linear", LR_SCALING_RULES),
    # The peak rate is rule 1's times this (1 = the paper); > 1 only to test how large a
    # rate warmup makes usable (experiments/RESULTS.md).
    "lr_multiplier": Field(1.0, NUMBER, _positive, "> 0", MATH, before=1.0),
    # Only when batch_size > base_batch_size.
    "warmup": _choice("gradual", WARMUP_KINDS),
    "warmup_epochs": Field(5.0, NUMBER, _non_negative, ">= 0", MATH),
    "lr_decay": _choice("step", DECAY_KINDS),
    "decay_epochs": Field((30.0, 60.0, 80.0), None, None, "", MATH),
    "decay_factor": Field(0.1, (float,), lambda v: 0 < v <= 1, "in (0, 1]", MATH),
    "num_epochs": Field(90.0, NUMBER, lambda v: 0 < v <= MAX_EPOCHS, f"in (0, {MAX_EPOCHS}]", MATH),
    # Optimizer (rules 4-6).
    "optimizer": _choice("sgd", OPTIMIZERS),
    "momentum": Field(0.9, NUMBER, lambda v: 0 <= v < 1, "in [0, 1)", MATH),
    "nesterov": _flag(True),
    "weight_decay": Field(1e-4, NUMBER, _non_negative, ">= 0", MATH),
    "decay_batchnorm": _flag(False),
    "decay_bias": _flag(False),
    "update_form": _choice("optax", UPDATE_FORMS),
    "momentum_correction": _flag(True),  # used by update_form='caffe2'
    "lars_trust_coefficient": Field(0.001, (float,), _positive, "> 0", MATH),
    # Data (rules 8, 13).
    "dataset": Field("imagenet2012", (str,), bool, "a dataset name", MATH),
    "data_dir": Field("", (str,), None, "", HOST),  # "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    # Decoding processes per host (0 = threads), and decoding threads in each of those
    # processes (in the main process when workers=0); at most MAX_DECODERS each.
    "workers": Field(
        8, (int,), lambda v: 0 <= v <= MAX_DECODERS, f"from 0 to {MAX_DECODERS}", HOST
    ),
    "threads": Field(
        2, (int,), lambda v: 1 <= v <= MAX_DECODERS, f"from 1 to {MAX_DECODERS}", HOST
    ),
    # Global; the last batch is padded. Exact evaluation needs a multiple of n images per
    # device: 8192 is 32 per chip on 256 chips.
    "eval_batch_size": _count(8192, REPORTING),
    "color_augment": _flag(False),  # fb.resnet.torch jitter + PCA lighting; not in the paper
    "train_subset": _count(0, minimum=0),  # > 0: the first that many examples (small runs)
    "eval_subset": _count(0, minimum=0),
    # Loop, reporting (rule 14), checkpoints.
    "log_every_steps": _count(100, REPORTING),
    "eval_every_epochs": Field(1.0, NUMBER, _positive, "> 0", REPORTING),
    "checkpoint_every_steps": _count(1000, REPORTING),
    "keep_checkpoints": _count(3, REPORTING),
    # The paper's metric: median top-1 error of the evaluations in the last 5 epochs.
    "result_last_epochs": Field(5.0, (float,), _positive, "> 0", REPORTING),
    # True: skip (and count) an update whose loss, gradient or result is not finite.
    "skip_nonfinite": _flag(False, REPORTING),
    # A jax.profiler trace of `profile_steps` steps (0: none) into WORKDIR/profile, from the
    # step after the first `profile_after_steps` of this session (compile and warm-up), on
    # process 0 ('first') or on every process ('all').
    "profile_steps": _count(0, REPORTING, minimum=0),
    "profile_after_steps": _count(10, REPORTING, minimum=0),
    "profile_processes": _choice("first", ("first", "all"), REPORTING),
    # JAX's persistent compilation cache in WORKDIR/compilation_cache (or where
    # JAX_COMPILATION_CACHE_DIR says): a resumed or requeued run loads its programs.
    "compilation_cache": _flag(True, HOST),
    # Engine.
    "parallelism": _choice("shard_map", PARALLELISMS, LAYOUT),
    # Batches put on the devices ahead of the step, from a background thread (0: none).
    # Measured on CPU (python -m experiments.benchmark --input=real): no gain, so off by default.
    "prefetch_batches": _count(0, LAYOUT, minimum=0),
}

# What a resumed run may change: every field but those of its math.
MAY_CHANGE = tuple(name for name, f in FIELDS.items() if f.role != MATH)
# Fields added since workdirs record their config, each with its value before it existed.
BEFORE_FIELD = {name: f.before for name, f in FIELDS.items() if f.before is not RECORDED}
# Fields that may differ between the processes of one run.
HOST_LOCAL = tuple(name for name, f in FIELDS.items() if f.role == HOST)


def default_config() -> ml_collections.ConfigDict:
    """Every field at its default: the paper's ResNet-50 recipe at kn=256."""
    return ml_collections.ConfigDict({name: f.default for name, f in FIELDS.items()})
