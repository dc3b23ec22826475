"""One wiring for every caller: the step module imports no data, decoding or logging
stack, and the benchmark compiles exactly the program the training loop (main.py) runs."""

import hashlib
import importlib.util
import sys

import jax
import numpy as np
import pytest

from configs import smoke
from largebatch_jax import parallel, train
from largebatch_jax.builder import build_training
from largebatch_jax.data import loader
from largebatch_jax.plan import Facts, resolve
from largebatch_jax.train.feed import InputFeed
from tests.runs import ROOT, call

BLOCKED = ("clu", "tensorflow", "tensorflow_datasets", "grain", "orbax", "cv2", "simplejpeg")

LEAN_PROGRAM = f"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"blocked: {{name}}")
        return None

sys.meta_path.insert(0, Block())
import numpy as np
import jax
from configs import smoke
from largebatch_jax import parallel, step
from largebatch_jax.builder import build_training
from largebatch_jax.plan import Facts, resolve

config = smoke.get_config()
engine = parallel.DataParallel(parallel.create_mesh())
training = build_training(config, resolve(config, Facts(8, "cpu")), engine)
rng = np.random.default_rng(0)
assert training.input_shape == (28, 28, 1)  # uint8 pixels at native size, downscaled there
batch = engine.shard_batch({{
    "image": rng.integers(0, 256, (64, 28, 28, 1)).astype(np.uint8),
    "label": rng.integers(0, 10, 64).astype(np.int32),
}})
state, metrics = training.train_step(training.state, batch)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({BLOCKED!r}))
print("devices", jax.device_count(), "step", int(state.step), "loss",
      float(metrics["train_loss"]), "blocked modules loaded:", loaded)
"""


def test_step_imports_and_runs_without_the_data_and_logging_stack():
    out = call([sys.executable, "-c", LEAN_PROGRAM], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("devices 8 step 1 loss ") and line.endswith("loaded: []"), line
    assert 2.0 < float(line.split()[5]) < 2.6  # ln(10) = 2.30 at initialisation


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "experiments/benchmark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark"] = module  # its flax modules are dataclasses of this module
    spec.loader.exec_module(module)
    return module


def _hlo_hash(fn, *args) -> str:
    return hashlib.sha256(fn.lower(*args).as_text().encode()).hexdigest()


@pytest.mark.slow
def test_benchmark_times_the_program_main_py_runs(tmp_path, fashion_mnist_dir):
    config = smoke.get_config()
    config.data_dir = fashion_mnist_dir
    run, state, _ = train.build(config, tmp_path / "wd")
    batch, _ = next(InputFeed(run.train_loader, run.engine, config.prefetch_batches))
    theirs = _hlo_hash(run.training.train_step, state, batch)
    eval_batch = run.engine.shard_batch(
        next(loader.eval_batches(run.data.eval, run.data.augment, config.eval_batch_size))
    )
    eval_theirs = _hlo_hash(run.training.eval_step, state, eval_batch)

    benchmark = _load_benchmark()
    engine = parallel.DataParallel(parallel.create_mesh())
    # --input=real: the config's data and the same builder.
    training = benchmark.ours(config, engine, len(train.load_data(config).train))
    assert _hlo_hash(training.train_step, training.state, batch) == theirs
    # --input=synthetic --config=configs/smoke.py with the config's own kn (8 x 8 images).
    args = benchmark.parse_args(["--config=configs/smoke.py", "--per_device_batch=8"])
    synthetic = benchmark.synthetic_config(args, engine.num_devices, conv_impl="xla")
    training = benchmark.ours(synthetic, engine)
    assert _hlo_hash(training.train_step, training.state, batch) == theirs
    # The synthetic batches have the loader's shape and dtype (uint8 pixels).
    fake = benchmark.synthetic_batch(64, training.input_shape, 10, pixels=True)
    assert fake["image"].shape[1:] == batch["image"].shape[1:]
    assert fake["image"].dtype == batch["image"].dtype == np.uint8
    # A different program hashes differently (the comparison can fail).
    synthetic.bn_group_size = 8
    training = benchmark.ours(synthetic, engine)
    assert _hlo_hash(training.train_step, training.state, batch) != theirs
    # The eval step too, and lowering from the shapes alone gives the same program.
    training = build_training(config, resolve(config, Facts(8, "cpu")), engine, abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(training.state))
    assert _hlo_hash(training.train_step, training.state, batch) == theirs
    assert _hlo_hash(training.eval_step, training.state, eval_batch) == eval_theirs
    run.checkpointer.close()
