"""Run under the launcher by test_multihost.py: one epoch of the training loader on each
process, each process's batches turned into global arrays the way the train loop does,
and what every process read written to OUT/p{K}.json."""

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from largebatch_jax import cluster, parallel
from largebatch_jax.data import loader, sources


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--subset", type=int, default=512)
    parser.add_argument("--coordinator_address")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    args = parser.parse_args()
    cluster.initialize_distributed(
        "auto", args.coordinator_address, args.num_processes, args.process_id
    )
    engine = parallel.DataParallel(parallel.create_mesh())
    spec = sources.dataset_spec("fashion_mnist", args.data_dir)
    src = sources.Subset(
        sources.load_source("fashion_mnist", spec.train_split, args.data_dir), args.subset
    )
    spe = loader.steps_per_epoch(len(src), args.batch_size)
    train_loader = loader.TrainLoader(
        src,
        loader.default_augmentation(spec, 14, False),
        args.batch_size,
        seed=0,
        num_steps=spe,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        workers=0,
    )
    local, global_ = [], []
    for _ in range(spe):
        index = np.asarray(next(train_loader)["index"])
        local.append(index.tolist())
        gathered = multihost_utils.process_allgather(engine.shard_batch(index), tiled=True)
        global_.append(np.asarray(gathered).tolist())
    Path(args.out, f"p{jax.process_index()}.json").write_text(
        json.dumps(
            {
                "process_count": jax.process_count(),
                "devices": jax.device_count(),
                "local": local,
                "global": global_,
            }
        )
    )


if __name__ == "__main__":
    main()
