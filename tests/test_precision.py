"""Mixed precision: dtype='bfloat16' computes in bf16 with fp32 parameters, fp32 BN
statistics and an fp32 loss, and its training run tracks the fp32 one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import smoke
from largebatch_jax import parallel
from largebatch_jax.builder import build_training
from largebatch_jax.data import loader, sources
from largebatch_jax.plan import Facts, resolve

STEPS = 12


def run_steps(dtype, batches, config):
    """The program main.py runs for the smoke config (the shared builder), in `dtype`."""
    config.dtype = dtype
    engine = parallel.DataParallel(parallel.create_mesh())
    training = build_training(config, resolve(config, Facts(engine.num_devices, "cpu")), engine)
    state, losses = training.state, []
    for batch in batches:
        state, metrics = training.train_step(state, engine.shard_batch(batch))
        losses.append(float(metrics["train_loss"]))
    return state, np.array(losses), training.model


@pytest.mark.slow
def test_bfloat16_tracks_float32_on_the_smoke_config(fashion_mnist_dir):
    config = smoke.get_config()
    spec = sources.dataset_spec("fashion_mnist", fashion_mnist_dir)
    src = sources.Subset(
        sources.load_source("fashion_mnist", spec.train_split, fashion_mnist_dir), 1024
    )
    it = loader.TrainLoader(
        src, loader.default_augmentation(spec, 14, False), 64, seed=0, num_steps=STEPS
    )
    batches = [{k: v for k, v in next(it).items() if k != "index"} for _ in range(STEPS)]
    _, loss32, _ = run_steps("float32", batches, config)
    state16, loss16, model16 = run_steps("bfloat16", batches, config)
    # Parameters, BN statistics and optimizer state stay float32 in the bf16 run ...
    for leaf in jax.tree.leaves((state16.params, state16.batch_stats, state16.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    # ... the convolutions compute in bf16 and the logits (hence the loss) are float32.
    x = jnp.zeros((4, 14, 14, 1))
    variables = {"params": state16.params, "batch_stats": state16.batch_stats}
    assert model16.apply(variables, x, train=False).dtype == jnp.float32
    _, inner = model16.apply(
        variables, x, train=False, capture_intermediates=True, mutable=["intermediates"]
    )
    conv_out = inner["intermediates"]["stem_conv"]["__call__"][0]
    assert conv_out.dtype == jnp.bfloat16
    # The loss curves: 12 updates of kn=64 on real Fashion-MNIST (loss from 2.3 to ~1.9).
    print("fp32", np.round(loss32, 4), "\nbf16", np.round(loss16, 4))
    assert loss32[-1] < loss32[0] - 0.1  # it trains
    np.testing.assert_allclose(loss16, loss32, atol=0.01)  # measured: at most 9e-4
