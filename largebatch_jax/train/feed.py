"""The loop's input, timed: each global batch on the devices with the loader's position
after it, and the seconds the loop waited for it (the loader's `next` and the
host-to-device copy; with `prefetch_batches`, the wait on the prefetch queue). Both parts
are annotated in a profile (`input_next`, `host_to_device`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from jax.profiler import TraceAnnotation


class InputFeed:
    """(global batch on the devices, the loader's position after it), in step order."""

    def __init__(self, loader: Any, engine: Any, prefetch: int):
        self.loader, self.engine = loader, engine
        self.wait_seconds = 0.0  # since the last `take_wait`
        self.batches = 0
        self._prefetched = engine.prefetch(self._local(), prefetch) if prefetch else None

    def _next_local(self) -> tuple[dict, dict]:
        with TraceAnnotation("input_next"):
            batch = next(self.loader)
        del batch["index"]  # record ids: for tests and debugging, not for the devices
        return batch, self.loader.get_state()

    def _local(self) -> Iterator[tuple[dict, dict]]:
        while True:
            try:
                yield self._next_local()
            except StopIteration:
                return

    def __iter__(self) -> InputFeed:
        return self

    def __next__(self) -> tuple[Any, dict]:
        began = time.perf_counter()
        try:
            if self._prefetched is not None:
                with TraceAnnotation("input_wait"):
                    return next(self._prefetched)
            batch, position = self._next_local()
            return self.engine.shard_batch(batch), position  # annotated host_to_device
        finally:
            self.wait_seconds += time.perf_counter() - began
            self.batches += 1

    def take_wait(self) -> tuple[float, int]:
        """(seconds waited, batches taken) since the last call."""
        taken = (self.wait_seconds, self.batches)
        self.wait_seconds, self.batches = 0.0, 0
        return taken
