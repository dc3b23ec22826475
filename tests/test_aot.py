"""The train step compiled for Cloud TPU slices on this CPU host (largebatch_jax.aot): it
compiles as main.py would build it there, its only communication is one all-reduce of
exactly the gradients and BN statistics, and its per-chip memory does not grow with the
slice (pure data parallelism)."""

import os

import jax
import numpy as np
import pytest

from configs import smoke

if os.environ.get("REQUIRE_TPU_COMPILER") != "1":  # CI sets it: there the test must run
    pytest.importorskip("libtpu", reason="the TPU compiler: pip install -e '.[tpu]'")

from largebatch_jax import aot, parallel

pytestmark = pytest.mark.slow


def _engine(topology: str) -> parallel.DataParallel:
    return parallel.DataParallel(
        parallel.create_mesh(aot.topology_devices(aot.parse_topology(topology)))
    )


def _config(chips: int, per_chip: int, accum_steps: int = 1):
    config = smoke.get_config()
    config.batch_size = chips * per_chip
    config.accum_steps = accum_steps
    return config


def _bias_bytes_of_projection_bns(params) -> int:
    """A projection shortcut's BN bias and its block's last BN bias are added at the same
    point, so their gradients are the same array, which XLA sends once."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return sum(
        leaf.size * 4
        for path, leaf in flat
        if "proj_bn" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path)
    )


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    # The session's compilation cache cannot hold executables for a described TPU (each
    # lookup fails with a warning); the other test modules keep it.
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


@pytest.fixture(scope="module")
def v5e_2x2():
    return _engine("v5e:2x2")


def test_topology_names():
    assert aot.parse_topology("v5e-256").topology_name == "v5e:16x16"
    assert aot.parse_topology("v5e-32").shape == (4, 8)
    assert aot.parse_topology("v4-512").topology_name == "v4:4x8x8"  # 2 cores per chip
    assert aot.parse_topology("v5p-128").topology_name == "v5:4x4x4"
    assert aot.parse_topology("v4:2x2x1").chips == 4
    with pytest.raises(ValueError, match="--topology='a100-8'"):
        aot.parse_topology("a100-8")


def test_collective_bytes_are_read_from_hlo_shapes():
    hlo = (
        "  %all-reduce = (f32[]{:T(128)}, f32[3,3,8,8]{3,2,1,0}, bf16[10]{0}) all-reduce(%a)\n"
        "  %ag = ((f32[4]{0}), f32[16]{0}) all-gather-start(%b), dimensions={0}\n"
        "  %done = f32[16]{0} all-gather-done(%ag)\n"
    )
    assert aot.collectives(hlo) == [
        aot.Collective("all-reduce", 4 + 4 * 576 + 2 * 10),
        aot.Collective("all-gather", 64),
    ]


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_the_one_all_reduce_carries_exactly_the_gradients_and_statistics(v5e_2x2, accum_steps):
    config = _config(4, 16, accum_steps)
    assert parallel.resolve_accum_loop(config.accum_loop, "tpu") == "scan"  # not the host's
    ours = aot.compile_ours(config, v5e_2x2, steps_per_epoch=16)
    train = ours["train"]
    assert (
        train.flops > 0 and train.temp_bytes > 0 and train.memory_bytes < aot.CHIPS["v5e"].hbm_bytes
    )
    assert [c.kind for c in train.collectives] == ["all-reduce"], train.collectives
    expected = aot.gradient_and_statistics_bytes(ours["state"])
    state = ours["state"]
    params = jax.tree.leaves(state.params)
    stats = jax.tree.leaves(state.batch_stats)
    assert expected == 4 * (sum(x.size for x in params) + sum(x.size for x in stats) + 2)
    if accum_steps == 1:  # straight-line code: XLA finds the identical bias gradients
        expected -= _bias_bytes_of_projection_bns(state.params)
    assert train.collectives[0].bytes == expected
    # Evaluation: one all-reduce of the four float32 sums.
    assert ours["eval"].collectives == [aot.Collective("all-reduce", 16)]


def test_accumulation_costs_are_counted_for_every_micro_step(v5e_2x2):
    one = aot.compile_ours(_config(4, 8), v5e_2x2, steps_per_epoch=16)["train"]
    two = aot.compile_ours(_config(4, 16, accum_steps=2), v5e_2x2, steps_per_epoch=16)["train"]
    # Twice the images in two micro-steps of the same size: twice the model's FLOPs.
    assert 1.9 < two.flops / one.flops < 2.1


def test_per_chip_memory_does_not_grow_with_the_slice(v5e_2x2):
    small = aot.compile_ours(_config(4, 16), v5e_2x2, steps_per_epoch=16)["train"]
    large = aot.compile_ours(_config(16, 16), _engine("v5e:4x4"), steps_per_epoch=16)["train"]
    for field in ("argument_bytes", "output_bytes", "temp_bytes"):
        assert getattr(large, field) == getattr(small, field), field
    assert large.flops == pytest.approx(small.flops, rel=1e-3)
    assert [c.bytes for c in large.collectives] == [c.bytes for c in small.collectives]


def test_largest_micro_batch_doubles_until_it_does_not_fit(v5e_2x2, monkeypatch):
    chip = aot.CHIPS["v5e"]
    config = _config(4, 64)
    sizes = []
    real_fits = aot.fits

    def fits(config, engine, chip, micro):
        sizes.append(micro)
        return object() if micro <= 16 else None

    monkeypatch.setattr(aot, "fits", fits)
    assert aot.largest_micro_batch(config, v5e_2x2, chip) == 16
    assert sizes == [4, 8, 16, 32]
    assert aot.with_micro_batch(config, 4, 16).accum_steps == 4
    with pytest.raises(ValueError, match="--per_chip_batch=3"):
        aot.with_micro_batch(config, 4, 3)
    # The real check compiles: 16 images per chip of the smoke model fit a v5e easily.
    compiled = real_fits(config, v5e_2x2, chip, 16)
    assert compiled is not None and np.isfinite(compiled.roofline_s(chip))
