"""Checkpoints with orbax: the train state (params, optimizer, BN statistics, step) and a
JSON of the host-side state (data loader position, partial epoch sums).

Saves are atomic (orbax writes a temporary directory and renames it), so a run killed at
any moment leaves only complete checkpoints behind. Restoring tries the newest first and
falls back to older ones if a checkpoint cannot be read. Nothing here deletes a
checkpoint except orbax's rotation of the oldest beyond `keep`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "host"),
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, host_state: dict) -> bool:
        """Save at `step` unless a checkpoint of that step exists (never overwritten)."""
        if step in self.manager.all_steps():
            return False
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host_state)
            ),
            force=True,
        )

    def restore_latest(self, template: Any) -> tuple[Any, dict] | None:
        """The newest readable checkpoint as (state, host_state), shaped and placed like
        `template`; None when there is none. Unreadable ones are reported and skipped."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        for step in reversed(self.steps()):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()
                    ),
                )
                return restored["state"], dict(restored["host"])
            except Exception as e:  # a corrupt or partial checkpoint: use the one before
                logging.warning(
                    "checkpoint at step %d cannot be read (%s: %s) in %s; trying the previous one",
                    step,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                    self.directory,
                )
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
