"""Train and evaluate one run of the paper's recipe.

    python main.py --config=configs/imagenet_8k.py --workdir=/tmp/rn50_8k
    python main.py --config=configs/imagenet.py:batch_size=8192,warmup=constant --workdir=...
    python main.py --config=configs/fashion_mnist.py --workdir=/tmp/fmnist --config.batch_size=1024

Any field can be overridden with --config.FIELD=VALUE. Rerunning the same command resumes
from the newest checkpoint in the workdir. Exit codes: 0 done (or preempted by SIGTERM
with a checkpoint saved), 2 bad config / data / workdir, 1 a failed run (e.g. NaN loss).
"""

import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from largebatch_jax import parallel, trainer
from largebatch_jax.data.loader import UnreadableImageError
from largebatch_jax.data.sources import DatasetNotPreparedError
from largebatch_jax.validate import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    parallel.DISTRIBUTED_MODES,
    "Multi-process runs through jax.distributed: 'auto' joins one when a flag below is "
    "given or the environment is a multi-task SLURM step, an Open MPI job or a multi-host "
    "Cloud TPU slice; 'on' always calls jax.distributed.initialize() (JAX detects the "
    "rest); 'off' never.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, where JAX cannot detect the cluster."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds",
    60,
    "A process silent this long is declared dead and the others stop with an error.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    parallel.initialize_distributed(
        _DISTRIBUTED.value,
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        heartbeat_timeout_seconds=_HEARTBEAT.value,
    )
    config = _CONFIG.value
    try:
        result = trainer.train_and_evaluate(config, _WORKDIR.value)
    except (ConfigError, DatasetNotPreparedError, UnreadableImageError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except trainer.NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if jax.process_index() != 0:
        return
    if "preempted" in result:
        print(
            f"preempted: checkpoint saved at step {result['preempted']} in "
            f"{result['checkpoints']}; rerun the same command to resume",
            flush=True,
        )
    else:
        metric = result["val_error_top1_median_last_epochs"]
        print(
            f"done: top-1 error {result['final_val_error_top1']} (paper metric, median of the "
            f"last {result['last_epochs']} epochs: {metric}); results in "
            f"{_WORKDIR.value}/result.json",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
