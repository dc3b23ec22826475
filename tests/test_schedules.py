"""Paper rules 1-3: the schedule equals the paper's formulas at chosen iterations."""

import math

import ml_collections
import numpy as np
import pytest

from largebatch_jax import fields, schedules
from largebatch_jax.plan import check_fields, learning_rate

IMAGENET_TRAIN = 1_281_167


def config(batch_size, **overrides):
    c = ml_collections.ConfigDict(
        dict(
            base_lr=0.1,
            base_batch_size=256,
            batch_size=batch_size,
            lr_scaling="linear",
            lr_multiplier=1.0,
            warmup="gradual",
            warmup_epochs=5.0,
            lr_decay="step",
            decay_epochs=(30.0, 60.0, 80.0),
            decay_factor=0.1,
            num_epochs=90.0,
        )
    )
    c.update(overrides)
    return c


def values(cfg, steps_per_epoch, steps):
    fn = learning_rate(cfg, steps_per_epoch).schedule()
    return np.asarray(fn(np.asarray(steps)), np.float64)


def paper_lr(t, kn, spe, warmup="gradual"):
    """Paper rules 2 and 3 (README, "Where each rule of the paper lives"), written out
    independently of the implementation."""
    peak = 0.1 * kn / 256
    tw = 5 * spe if kn > 256 else 0
    if t < tw:
        if warmup == "gradual":
            return 0.1 + (peak - 0.1) * t / tw
        if warmup == "constant":
            return 0.1
    return peak * 0.1 ** sum(t >= e * spe for e in (30, 60, 80))


@pytest.mark.parametrize("kn", [256, 8192, 65536])
@pytest.mark.parametrize("warmup", ["gradual", "constant", "none"])
def test_paper_formulas(kn, warmup):
    spe = IMAGENET_TRAIN // kn
    tw = 5 * spe
    steps = [
        0,
        1,
        tw // 3,
        tw // 2,
        tw - 1,
        tw,
        tw + 1,
        30 * spe - 1,
        30 * spe,
        45 * spe,
        60 * spe - 1,
        60 * spe,
        80 * spe - 1,
        80 * spe,
        90 * spe - 1,
    ]
    got = values(config(kn, warmup=warmup), spe, steps)
    expected = [paper_lr(t, kn, spe, warmup) for t in steps]
    np.testing.assert_allclose(got, expected, rtol=2e-6)


def test_8k_landmarks():
    spe = IMAGENET_TRAIN // 8192  # 156 iterations per epoch
    got = values(config(8192), spe, [0, 390, 780, 30 * 156, 60 * 156, 80 * 156])
    np.testing.assert_allclose(got, [0.1, 1.65, 3.2, 0.32, 0.032, 0.0032], rtol=2e-6)


@pytest.mark.parametrize("kn", [64, 128, 256])
def test_small_batches_get_no_warmup(kn):
    got = values(config(kn, warmup="gradual"), 100, [0, 1, 250, 499])
    np.testing.assert_allclose(got, [0.1 * kn / 256] * 4, rtol=1e-7)


def test_warmup_is_per_iteration_not_per_epoch():
    got = values(config(1024), 10, np.arange(50))
    assert len(np.unique(got)) == 50  # rises every iteration
    np.testing.assert_allclose(np.diff(got), (0.4 - 0.1) / 50, rtol=1e-5)


def test_cosine_decay_after_warmup():
    spe = 100
    got = values(config(8192, lr_decay="cosine"), spe, [500, 500 + 4250, 9000, 9500])
    expected = [
        3.2,
        3.2 * 0.5 * (1 + math.cos(math.pi * 0.5)),
        3.2 * 0.5 * (1 + math.cos(math.pi * 8500 / 8500)),
        0.0,
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "rule,peak",
    [("linear", 3.2), ("sqrt", 0.1 * math.sqrt(32)), ("none", 0.1)],
)
def test_lr_scaling_rules(rule, peak):
    assert schedules.scaled_learning_rate(0.1, 256, 8192, rule) == pytest.approx(peak)
    got = values(config(8192, lr_scaling=rule), 100, [0, 250, 500, 2999])
    np.testing.assert_allclose(got, [0.1, 0.1 + (peak - 0.1) / 2, peak, peak], rtol=2e-6)


@pytest.mark.parametrize("warmup", ["gradual", "none"])
def test_the_rate_multiplier_scales_the_peak_and_keeps_the_warmup_start(warmup):
    """lr_multiplier m: peak m x rule 1's rate; gradual warmup still starts at base_lr and
    reaches the peak at the same iteration; the decays divide the new peak."""
    assert schedules.peak_learning_rate(0.1, 256, 8192, "linear", 4.0) == pytest.approx(12.8)
    got = values(config(8192, lr_multiplier=4.0, warmup=warmup), 100, [0, 250, 500, 3000])
    start = 0.1 if warmup == "gradual" else 12.8
    mid = 0.1 + (12.8 - 0.1) / 2 if warmup == "gradual" else 12.8
    np.testing.assert_allclose(got, [start, mid, 12.8, 1.28], rtol=2e-6)
    with pytest.raises(ValueError, match="lr_multiplier=0"):
        schedules.peak_learning_rate(0.1, 256, 8192, "linear", 0)


def test_fractional_epochs_are_iterations():
    # The small-scale runs scale the paper's 90-epoch recipe to 18 epochs: warmup 1 epoch,
    # decays at 6, 12 and 16 epochs; with 7 iterations per epoch boundaries round.
    cfg = config(2048, warmup_epochs=1.0, num_epochs=18.0, decay_epochs=(6.0, 12.0, 16.0))
    spe = 7
    got = values(cfg, spe, [0, 6, 7, 41, 42, 83, 84, 111, 112, 125])
    peak = 0.8
    expected = [
        0.1,
        0.1 + (peak - 0.1) * 6 / 7,
        peak,
        peak,
        peak / 10,
        peak / 10,
        peak / 100,
        peak / 100,
        peak / 1000,
        peak / 1000,
    ]
    np.testing.assert_allclose(got, expected, rtol=2e-6)
    half = config(2048, warmup_epochs=0.5)  # 3.5 iterations round to 4
    np.testing.assert_allclose(values(half, spe, [3, 4]), [0.1 + 0.7 * 3 / 4, 0.8], rtol=2e-6)


@pytest.mark.parametrize(
    "field,value",
    [
        ("warmup", "linear"),
        ("lr_scaling", "square"),
        ("lr_decay", "poly"),
        ("warmup_epochs", -1.0),
        ("decay_epochs", (30.0, 100.0)),
    ],
)
def test_bad_values_name_the_field(field, value):
    full = fields.default_config()
    full.update(config(8192, **{field: value}))
    with pytest.raises(ValueError, match=field):
        check_fields(full)
