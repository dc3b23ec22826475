"""Learning-rate schedule of the paper: rules 1-3 (README, "Where each rule of the paper lives").

The schedule is a function of the *iteration* (one SGD update of kn images), so every
boundary given in epochs is converted to iterations once, by `plan.learning_rate`, with
the run's `steps_per_epoch`. Fractional epochs are allowed (small-scale runs scale 5/90,
30/90, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import optax

LR_SCALING_RULES = ("linear", "sqrt", "none")
WARMUP_KINDS = ("gradual", "constant", "none")
DECAY_KINDS = ("step", "cosine")


def _check_choice(field: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, choices))}.")


def scaled_learning_rate(
    base_lr: float, base_batch_size: int, batch_size: int, rule: str = "linear"
) -> float:
    """Paper rule 1, the linear scaling rule: eta = base_lr * kn / base_batch_size.

    `rule='sqrt'` (eta * sqrt(kn / 256)) and `rule='none'` (eta unchanged) are the
    alternatives of the paper's Table 2a.
    """
    _check_choice("lr_scaling", rule, LR_SCALING_RULES)
    if base_lr <= 0:
        raise ValueError(f"base_lr={base_lr} must be > 0.")
    if base_batch_size <= 0 or batch_size <= 0:
        raise ValueError(
            f"base_batch_size={base_batch_size} and batch_size={batch_size} must be > 0."
        )
    ratio = batch_size / base_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def peak_learning_rate(
    base_lr: float,
    base_batch_size: int,
    batch_size: int,
    rule: str = "linear",
    multiplier: float = 1.0,
) -> float:
    """The rate the schedule reaches after warmup: rule 1's (`scaled_learning_rate`) times
    `multiplier`. 1 is the paper; m > 1 is the small-scale test of what warmup is for
    (experiments/RESULTS.md, "Warmup as the range of usable rates"): with warmup, training
    should tolerate a larger peak rate than without. Warmup still starts from `base_lr`."""
    if multiplier <= 0:
        raise ValueError(f"lr_multiplier={multiplier} must be > 0.")
    return scaled_learning_rate(base_lr, base_batch_size, batch_size, rule) * multiplier


def epochs_to_steps(epochs: float, steps_per_epoch: int) -> int:
    """An epoch boundary as an iteration count (rounded: fractional epochs are allowed)."""
    return round(float(epochs) * steps_per_epoch)


def warmup_schedule(
    start_lr: float, peak_lr: float, warmup_steps: int, kind: str
) -> optax.Schedule:
    """Paper rule 2, gradual warmup (and its constant / none variants of Table 1).

    gradual:  lr(t) = start + (peak - start) * t / T_w for t < T_w, per *iteration*;
    constant: lr(t) = start for t < T_w, then the peak;
    none:     the peak from step 0.
    Returns the rate for t < T_w; from T_w on the caller's decay schedule takes over.
    Written out rather than `optax.linear_schedule`, whose interpolation is 3.8e-6
    relative off this formula at kn=65536 (more than `test_paper_formulas` allows).
    """
    _check_choice("warmup", kind, WARMUP_KINDS)

    def schedule(step):
        t = jnp.asarray(step, jnp.float32)
        if kind == "gradual" and warmup_steps > 0:
            return start_lr + (peak_lr - start_lr) * t / warmup_steps
        if kind == "constant":
            return jnp.full_like(t, start_lr)
        return jnp.full_like(t, peak_lr)

    return schedule


def decay_schedule(
    peak_lr: float,
    kind: str,
    boundaries: Sequence[int],
    factor: float,
    start_step: int,
    total_steps: int,
) -> optax.Schedule:
    """Paper rule 3, step decay: multiply by `factor` (0.1) at each boundary iteration.

    `kind='cosine'` (not in the paper; for comparison with modern recipes) decays from
    the peak at `start_step` (end of warmup) to 0 at `total_steps`. Built from optax's
    schedules; the returned function takes the iteration counted from `start_step`, as
    `optax.join_schedules` passes it.
    """
    _check_choice("lr_decay", kind, DECAY_KINDS)
    if kind == "cosine":
        return optax.cosine_decay_schedule(peak_lr, max(total_steps - start_step, 1))
    scales: dict[int, float] = {}
    for b in boundaries:  # two decays at one iteration multiply
        scales[b - start_step] = scales.get(b - start_step, 1.0) * factor
    return optax.piecewise_constant_schedule(peak_lr, scales)


def warmup_applies(batch_size: int, base_batch_size: int) -> bool:
    """Paper rule 2, where gradual warmup applies: only to minibatches larger than the
    baseline's (kn > base kn); the baseline and smaller ones start at their own rate."""
    return batch_size > base_batch_size


def learning_rate_schedule(
    base_lr: float,
    peak_lr: float,
    warmup: str,
    warmup_steps: int,
    lr_decay: str,
    decay_steps: Sequence[int],
    decay_factor: float,
    total_steps: int,
) -> optax.Schedule:
    """The paper's schedule, per iteration: warmup from `base_lr` to rule 1's `peak_lr`
    over `warmup_steps` (rule 2; 0 where it does not apply), then the decays at
    `decay_steps` (rule 3). Every step count is resolved once, by `plan.learning_rate`."""
    warm = warmup_schedule(base_lr, peak_lr, warmup_steps, warmup)
    decay = decay_schedule(peak_lr, lr_decay, decay_steps, decay_factor, warmup_steps, total_steps)
    return optax.join_schedules([warm, decay], [warmup_steps])
