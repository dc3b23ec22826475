"""Entry point: python main.py --config=configs/smoke.py [--config.batch_size=...].

Until the input pipeline and the training loop land (issues 3 and 4) this runs the
paper's data-parallel SGD step on a fixed synthetic batch for `demo_steps` updates and
prints the metrics, so that the recipe and the engine can be seen working end to end.
"""

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from largebatch_jax import optim, parallel, schedules, train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smoke.py", "Config file.")
flags.DEFINE_string("workdir", None, "Output directory (used by the training loop).")


def main(argv):
    del argv
    config = _CONFIG.value
    engine = parallel.DataParallel(parallel.create_mesh(), config.parallelism)
    try:
        micro = parallel.micro_batch_size(
            config.batch_size, engine.num_devices, config.accum_steps, config.bn_group_size
        )
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    steps_per_epoch = config.get("demo_steps_per_epoch", 10)
    lr_fn = schedules.create_learning_rate_schedule(config, steps_per_epoch)
    tx = optim.optimizer_from_config(config, lr_fn)
    model = train.model_from_config(config)
    image_shape = (config.image_size, config.image_size, config.channels)
    logging.info(
        "devices=%d processes=%d kn=%d n=%d k=%d accum=%d micro-batch/device=%d "
        "peak lr=%.4g steps/epoch=%d",
        engine.num_devices,
        jax.process_count(),
        config.batch_size,
        config.bn_group_size,
        config.batch_size // config.bn_group_size,
        config.accum_steps,
        micro,
        schedules.scaled_learning_rate(
            config.base_lr, config.base_batch_size, config.batch_size, config.lr_scaling
        ),
        steps_per_epoch,
    )
    state = engine.replicate(
        train.create_train_state(jax.random.key(config.seed), model, tx, image_shape)
    )
    step = engine.map(
        train.make_train_step(model, tx, lr_fn, config.accum_steps), donate_state=True
    )
    rng = np.random.default_rng(config.seed)
    local = config.batch_size // jax.process_count()
    batch = engine.shard_batch(
        {
            "image": rng.normal(size=(local, *image_shape)).astype(np.float32),
            "label": rng.integers(0, config.num_classes, size=(local,)).astype(np.int32),
        }
    )
    for _ in range(config.get("demo_steps", 10)):
        state, metrics = step(state, batch)
        m = jax.device_get(metrics)
        print(
            f"step {int(state.step):3d}  lr {m['learning_rate']:.4f}  "
            f"loss {m['train_loss']:.4f}  error {m['train_error']:.3f}  "
            f"grad_norm {m['grad_norm']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
