"""The Plan: the paper's derived quantities, resolved once, against the paper's numbers."""

import re
from pathlib import Path

import numpy as np
import pytest

from configs import imagenet, imagenet_8k, smoke
from largebatch_jax.data import sources
from largebatch_jax.errors import ConfigError
from largebatch_jax.plan import Facts, resolve

IMAGENET_TRAIN = 1_281_167


def paper_8k():
    """The paper's headline run: kn=8192 on 256 workers (Table 1, Figure 1)."""
    return resolve(imagenet_8k.get_config(), Facts(devices=256, platform="gpu"))


def test_the_paper_8k_run_resolves_to_the_papers_numbers():
    plan = paper_8k()
    assert (plan.kn, plan.n, plan.k) == (8192, 32, 256)
    assert (plan.devices, plan.accum_steps, plan.micro_batch, plan.groups_per_device) == (
        256,
        1,
        32,
        1,
    )
    assert plan.train_images == IMAGENET_TRAIN
    # The loader drops the partial batch (Remark 4's epoch): 156, not 157.
    assert plan.steps_per_epoch == 156 == IMAGENET_TRAIN // 8192
    assert plan.total_steps == 90 * 156
    assert plan.warmup_steps == 5 * 156  # rule 2: 5 epochs of gradual warmup
    assert plan.decay_steps == (30 * 156, 60 * 156, 80 * 156)  # rule 3
    assert plan.peak_lr == pytest.approx(0.1 * 8192 / 256, rel=1e-15)  # rule 1: 3.2
    assert plan.eval_batch_per_device == 32 and plan.accum_loop == "scan"
    lr = plan.learning_rate.schedule()
    rates = np.asarray(lr(np.array([0, 390, 780, 30 * 156 - 1, 30 * 156, 60 * 156, 80 * 156])))
    np.testing.assert_allclose(rates, [0.1, 1.65, 3.2, 3.2, 0.32, 0.032, 0.0032], rtol=1e-6)
    assert plan.describe() == (
        "devices=256 (local 256) processes=1 | kn=8192 n=32 k=256 accum_steps=1 | per "
        "device 32 images/micro-step | local batch 8192 | peak lr 3.2 | 156 steps/epoch, "
        "14040 steps | imagenet2012: 1281167 train images"
    )


def test_the_8k_run_accumulated_on_one_8_device_host_is_the_same_update():
    """Rule 15: kn=8192 on 8 devices as 32 micro-steps of 32 images each, one BN group
    of n=32 per micro-step: the k, the schedule and the micro-batch of the 256-worker
    run."""
    config = imagenet_8k.get_config()
    config.accum_steps = 32
    host = resolve(config, Facts(devices=8, platform="gpu", processes=1))
    paper = paper_8k()
    assert (host.kn, host.n, host.k) == (paper.kn, paper.n, paper.k)
    assert (host.micro_batch, host.groups_per_device) == (32, 1)
    assert host.learning_rate == paper.learning_rate
    assert host.eval_batch_per_device == 8192 // 8
    assert host.local_batch == 8192


def test_the_baseline_has_no_warmup_and_the_papers_rate():
    plan = resolve(imagenet.get_config(), Facts(devices=8, platform="tpu"))
    assert (plan.kn, plan.k, plan.peak_lr, plan.warmup_steps) == (256, 8, 0.1, 0)
    assert plan.steps_per_epoch == IMAGENET_TRAIN // 256 == 5004


def test_a_process_layout_and_the_data_loaded_are_facts_of_the_plan():
    config = smoke.get_config()
    spec = sources.SPECS["fashion_mnist"]
    plan = resolve(
        config,
        Facts(
            8,
            "cpu",
            processes=2,
            local_devices=4,
            train_images=1024,
            eval_images=500,
            dataset=spec,
            environ={"NPROC": "16"},
        ),
    )
    assert (plan.local_batch, plan.local_devices, plan.steps_per_epoch) == (32, 4, 16)
    assert (plan.eval_every_steps, plan.total_steps, plan.warmup_steps) == (8, 32, 4)
    assert plan.describe().endswith("fashion_mnist: 1024 train / 500 eval images")


@pytest.mark.parametrize(
    "change,facts,message",
    [
        ({"batch_size": 100}, {}, r"^config.batch_size=100 is not divisible by devices x "),
        ({"num_classes": 1000}, {}, r"^config.num_classes=1000 but fashion_mnist has 10 "),
        ({"image_size": 10}, {}, r"^config.image_size=10 must divide fashion_mnist's native"),
        ({}, {"train_images": 32}, r"^config.batch_size=64 is larger than the training set"),
        ({}, {"environ": {}}, r"^config.reduction='exact' on CPU needs a fixed XLA:CPU "),
        ({"decay_epochs": (3.0,)}, {}, r"^config.decay_epochs=\(3.0,\) go past num_epochs"),
        ({"eval_batch_size": 100}, {}, r"^config.eval_batch_size=100 is not divisible by the 8"),
    ],
)
def test_every_cross_field_check_is_made_in_the_resolution(change, facts, message):
    config = smoke.get_config()
    config.update(change)
    given = {"train_images": 1024, "dataset": sources.SPECS["fashion_mnist"]}
    with pytest.raises(ConfigError, match=message) as error:
        resolve(config, Facts(8, "cpu", **{**given, **facts}))
    assert "\n" not in str(error.value)


# A derived quantity computed from the ConfigDict (`config.` or `c.`) instead of read from
# the Plan.
FROM_CONFIG = (
    r"\b(?:config|c)\.(?:eval_)?batch_size\s*//",
    r"\b(?:peak_learning_rate|epochs_to_steps|resolve_accum_loop)\(\s*(?:config|c)\.",
    r"\bsteps_per_epoch\(\s*(?:len|config|c\.)",
    r"\bTRAIN_SIZES\[",
)
# The compile tool's micro-batch search rewrites a config's accum_steps for a given
# per-device batch (aot/programs.py `with_micro_batch`, `largest_micro_batch`); a Plan is
# resolved from the config it returns.
SEARCH = ["aot/programs.py: config.batch_size //"] * 3
# The loader defines an epoch of its source (Remark 4), with the one function.
LOADER = ["data/loader.py: steps_per_epoch(len"]


def test_nothing_below_the_plan_derives_its_quantities_from_the_config():
    """Outside plan.py no library module computes kn / devices, the peak rate, an epoch
    boundary, the accumulation loop or the steps per epoch from the config again: they
    read the Plan (docs/design.md, "The run's derived quantities")."""
    root = Path(__file__).resolve().parents[1] / "largebatch_jax"
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name == "plan.py":
            continue
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        for pattern in FROM_CONFIG:
            found += [f"{name}: {m[0]}" for m in re.finditer(pattern, code)]
    assert sorted(found) == sorted(SEARCH + LOADER)
