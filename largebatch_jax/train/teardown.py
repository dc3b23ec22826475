"""Closing a run's parts in order, once each, whether it ended or failed."""

from __future__ import annotations

from typing import Any

from absl import logging

from largebatch_jax.train.faults import first_line


class Closer:
    """Closes the run's parts once each, in order: the checkpoint manager first (waiting
    for the save in flight, so every good checkpoint stays), then the loader and the
    writers. `close(quiet=True)`, after a failure, logs what fails on the way instead of
    raising it over the error that stopped the run."""

    def __init__(self, *parts: tuple[str, Any]):
        self.parts = list(parts)

    def close(self, quiet: bool = False) -> None:
        while self.parts:
            what, close = self.parts.pop(0)
            try:
                close()
            except Exception as e:
                if not quiet:
                    raise
                logging.warning("while stopping, closing %s failed: %s", what, first_line(e))
