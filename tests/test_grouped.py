"""The exact train step as a chain of programs (largebatch_jax/grouped.py): each BN group
is one run of a program compiled for n images, the same program whatever the layout, with
no loop in it; the chain is called, lowered and compiled like one jitted step, and the
compile tool counts each program as often as a step runs it."""

import re

import jax
import numpy as np
import pytest

from configs import smoke
from largebatch_jax import builder, parallel
from largebatch_jax.aot import programs
from largebatch_jax.plan import Facts, resolve


def _training(devices: int):
    config = smoke.get_config()
    config.reduction = "exact"
    engine = parallel.DataParallel(parallel.create_mesh(jax.devices()[:devices]))
    plan = resolve(config, Facts(engine.num_devices, "cpu"))
    training = builder.build_training(config, plan, engine, abstract=True)
    batch = programs.batch_spec(
        engine, config.batch_size // devices, training.input_shape, np.uint8
    )
    return config, engine, training, batch


def _body(text: str) -> str:
    """A compiled module's operations: without what names the module, counts its devices
    or records where in Python an operation was traced (a module from the persistent
    compilation cache, traced by another process, names other files)."""
    text = text.split("\nFileNames")[0]
    lines = [line for line in text.splitlines() if not line.startswith("HloModule")]
    text = re.sub(r"sharding=\{devices=\[[\d,]+\]<=\[\d+\]\}", "sharding=split", "\n".join(lines))
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"\.\d+\b", "", text)


@pytest.fixture(scope="module")
def chains():
    """kn=64, n=4: 16 groups, as 8 devices x 2 groups and 2 devices x 8 groups."""
    found = {}
    for devices in (8, 2):
        _, _, training, batch = _training(devices)
        lowered = training.train_step.lower(training.state, batch)
        found[devices] = lowered.compile()
    return found


def test_every_group_runs_one_program_for_n_images_the_same_in_every_layout(chains):
    runs = {d: {p.name: p.runs for p in c.programs} for d, c in chains.items()}
    assert runs == {
        8: {"split": 1, "group": 2, "mean": 1, "update": 1},
        2: {"split": 1, "group": 8, "mean": 1, "update": 1},
    }
    texts = {d: {p.name: p.program.as_text() for p in c.programs} for d, c in chains.items()}
    for d in chains:
        assert "while" not in "".join(texts[d].values())  # straight-line code everywhere
        assert re.search(r"u8\[4,28,28,1\]", texts[d]["group"])  # one group of n=4
    assert _body(texts[8]["group"]) == _body(texts[2]["group"])
    assert _body(texts[8]["update"]) == _body(texts[2]["update"])


def test_the_chain_is_counted_run_by_run_by_the_compile_tool():
    _, _, training, batch = _training(4)  # 4 groups per device
    lowered = training.train_step.lower(training.state, batch)
    assert [p.name for p in lowered.programs] == ["split", "group", "mean", "update"]
    chain = programs.analyse(lowered, "cpu")
    alone = {p.name: programs.analyse_program(p.program, "cpu") for p in lowered.programs}
    assert chain.chain == ("split x 1", "group x 4", "mean x 1", "update x 1")
    assert chain.flops == pytest.approx(
        4 * alone["group"].flops + sum(alone[n].flops for n in ("split", "mean", "update"))
    )
    assert chain.bytes_accessed == pytest.approx(
        4 * alone["group"].bytes_accessed
        + sum(alone[n].bytes_accessed for n in ("split", "mean", "update"))
    )
    assert sorted(c.kind for c in chain.collectives) == ["all-gather", "all-to-all"]
    # The memory at the peak counts the state and batch held by the caller throughout.
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(training.state))
    assert chain.argument_bytes >= state_bytes
    assert chain.memory_bytes >= max(a.output_bytes + a.temp_bytes for a in alone.values())


def test_the_chain_runs_compiled_or_called_with_the_same_bits():
    config, engine, _, _ = _training(4)
    real = builder.build_training(config, resolve(config, Facts(engine.num_devices, "cpu")), engine)
    rng = np.random.default_rng(0)
    batch = engine.shard_batch(
        {
            "image": rng.integers(0, 256, (64, *real.input_shape), dtype=np.uint8),
            "label": rng.integers(0, 10, 64).astype(np.int32),
        }
    )
    compiled = real.train_step.lower(real.state, batch).compile()
    state_a, metrics_a = compiled(jax.tree.map(lambda x: x.copy(), real.state), batch)
    state_b, metrics_b = real.train_step(real.state, batch)
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), state_a, state_b)
    assert all(jax.tree.leaves(same))
    assert jax.device_get(metrics_a) == jax.device_get(metrics_b)
    assert int(state_b.step) == 1 and np.isfinite(float(metrics_b["train_loss"]))
