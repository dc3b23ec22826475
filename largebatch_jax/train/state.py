"""What a run is made of (`Run`, fixed once built) and what the host carries from step to
step (`Progress`, saved with every checkpoint beside the TrainState)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from largebatch_jax import parallel
from largebatch_jax.builder import Training
from largebatch_jax.checkpoint import Checkpointer
from largebatch_jax.data import loader, sources
from largebatch_jax.lock import WorkdirLock
from largebatch_jax.plan import Plan


@dataclasses.dataclass
class Progress:
    """The host side of a run, saved with every checkpoint as one JSON: the step, the
    partial sums of the epoch's training metrics, the loader's position after the last
    trained batch, the skipped (non-finite) updates and the training seconds so far."""

    step: int = 0
    epoch_sums: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    data: dict | None = None
    skipped: int = 0
    train_seconds: float = 0.0

    def to_json(self) -> dict:
        # A copy: orbax may serialise it after save() returns, while the loop goes on.
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, blob: dict) -> Progress:
        """Tolerates checkpoints that lack a field (it keeps its default)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in blob.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Data:
    spec: sources.DatasetSpec
    train: Any
    eval: Any
    augment: loader.Augmentation


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything `setup.build` wires for the loop: the config as written, its `plan`
    (every derived quantity). The TrainState and the `Progress` advance step by step and
    are passed beside it."""

    config: Any
    plan: Plan
    workdir: Path
    engine: parallel.DataParallel
    data: Data
    training: Training
    checkpointer: Checkpointer
    lock: WorkdirLock | None
    train_loader: loader.TrainLoader
    is_main: bool
