"""Batches for the step: paper Remark 4 (one global shuffle per epoch), exact evaluation.

Training: epoch e uses one permutation of the whole training set, seeded by (seed, e).
Global step s of that epoch is the slice [s*kn, (s+1)*kn) of it (the remainder of
N / kn is dropped, a different one each epoch). Process p of P reads the contiguous
share [p*kn/P, (p+1)*kn/P) of every global batch, and hands it to its devices in order
(each device then splits its rows into [accum][micro-batch]). Which image lands where is
thus a pure function of (seed, kn, step, p, P): the loader's state is the next step.

Evaluation: every example of the split exactly once across all processes; the last
global batch is padded, and a mask (0 for padding) lets the metrics count each image once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np
from absl import flags

from largebatch_jax import private
from largebatch_jax.data import transforms
from largebatch_jax.data.sources import DatasetSpec, steps_per_epoch
from largebatch_jax.errors import UnreadableImageError


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """Paper Remark 4: one random permutation of the whole training set per epoch."""
    # Four words, unlike example_rng's three: the two streams never coincide.
    return np.random.default_rng([seed, epoch, 0, 4]).permutation(num_examples)


def process_share(batch_size: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows of each global batch that one process loads."""
    if batch_size % process_count:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by the {process_count} processes."
        )
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def train_step_indices(
    step: int,
    num_examples: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[int, np.ndarray]:
    """(epoch, record indices) that this process loads for global step `step`."""
    epoch, s = divmod(step, steps_per_epoch(num_examples, batch_size))
    batch = _cached_permutation(num_examples, seed, epoch)[s * batch_size : (s + 1) * batch_size]
    return epoch, batch[process_share(batch_size, process_index, process_count)]


@functools.lru_cache(maxsize=2)
def _cached_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    return epoch_permutation(num_examples, seed, epoch)


# ----------------------------------------------------------------------------- transforms


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """Which of rule 13's transforms apply, for one dataset at one input size."""

    spec: DatasetSpec
    image_size: int
    color_augment: bool = False  # jitter + PCA lighting (fb.resnet.torch; not in the paper)
    pad_crop: int = 0  # small images: CIFAR's pad-4 random crop
    flip: bool = False  # small images: horizontal flip

    def train(self, image: Any, rng: np.random.Generator) -> np.ndarray:
        if self.spec.large_images:
            return transforms.train_transform_large(image, rng, self.image_size, self.color_augment)
        return transforms.small_image_transform(
            image, rng, self.image_size, self.pad_crop, self.flip
        )

    def eval(self, image: Any) -> np.ndarray:
        if self.spec.large_images:
            return transforms.eval_transform_large(image, self.image_size)
        return transforms.small_image_transform(image, None, self.image_size)


def default_augmentation(
    spec: DatasetSpec, image_size: int, color_augment: bool = False
) -> Augmentation:
    """The paper's crops for ImageNet-style data; CIFAR's pad-4 crop + flip for CIFAR-10;
    nothing for Fashion-MNIST (its objects are centred and never mirrored in the test set)."""
    if spec.name == "cifar10":
        return Augmentation(spec, image_size, pad_crop=4, flip=True)
    return Augmentation(spec, image_size, color_augment=color_augment)


def _transform(fn: Any, record: dict, index: int, split: str) -> np.ndarray:
    """fn(image); an encoded image that fails to decode stops with one line naming the
    record (and its file, where the dataset stores names), not a worker's traceback."""
    if not isinstance(record["image"], bytes | bytearray):  # decoded arrays: nothing to fail
        return fn(record["image"])
    try:
        return fn(record["image"])
    except transforms.DECODE_ERRORS as e:
        name = record.get("file_name")
        where = f" ({name})" if name else ""
        raise UnreadableImageError(
            f"{split} record {index}{where} cannot be decoded ({type(e).__name__}: {e}): "
            "re-encode or remove that image and prepare the dataset again"
        ) from None


# ----------------------------------------------------------------------------- training


class _TrainExample:
    """Local element i of this process's stream -> one transformed training example."""

    def __init__(self, source, augment, batch_size, seed, process_index, process_count):
        self.source, self.augment, self.seed = source, augment, seed
        self.batch_size, self.process_index, self.process_count = (
            batch_size,
            process_index,
            process_count,
        )
        self.local = batch_size // process_count

    def __call__(self, i: int) -> dict:
        step, j = divmod(int(i), self.local)
        epoch, records = train_step_indices(
            step,
            len(self.source),
            self.batch_size,
            self.seed,
            self.process_index,
            self.process_count,
        )
        index = int(records[j])
        record = self.source[index]
        rng = transforms.example_rng(self.seed, epoch, index)
        return {
            "image": _transform(lambda x: self.augment.train(x, rng), record, index, "training"),
            "label": np.int32(record["label"]),
            "index": np.int64(index),
        }


class TrainLoader:
    """This process's share of every global training batch, from `start_step` on.

    Batches are dicts of numpy arrays: image [kn/P, H, W, C] uint8 (rule 13's pixels
    before normalisation, which the step does on the device; float32 with colour
    augmentation; small datasets at their native size), label [kn/P] int32
    and index [kn/P] (the record ids, for tests and debugging). `threads` decoding
    threads, in each of `workers` grain processes (0: in this process), each thread
    building whole batches; `prefetch` batches are kept ready.
    """

    def __init__(
        self,
        source: Any,
        augment: Augmentation,
        batch_size: int,
        seed: int,
        num_steps: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
        workers: int = 0,
        threads: int = 2,
        prefetch: int = 2,
    ):
        process_share(batch_size, process_index, process_count)  # validates
        self.steps_per_epoch = steps_per_epoch(len(source), batch_size)
        self.num_steps = num_steps
        self.local_batch = batch_size // process_count
        self._example = _TrainExample(
            source, augment, batch_size, seed, process_index, process_count
        )
        # What the data order depends on (not the process layout: every process may
        # restore the state that process 0 saved, and the layout may change on resume).
        self._fingerprint = dict(num_examples=len(source), batch_size=batch_size, seed=seed)
        self.workers, self.threads, self.prefetch = workers, threads, prefetch
        self.step = 0
        self._iter: Iterator | None = None

    def _make_iter(self, start_step: int) -> Iterator:
        lb = self.local_batch
        # Batch before handing out work: a thread or worker process always builds one
        # whole batch, so the batch contents never depend on the worker count.
        ds = grain.MapDataset.range(start_step * lb, self.num_steps * lb).map(self._example)
        return _iterate(
            ds.batch(lb, drop_remainder=True), self.threads, self.workers, self.prefetch
        )

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict:
        if self.step >= self.num_steps:
            raise StopIteration
        if self._iter is None:
            self._iter = self._make_iter(self.step)
        batch = next(self._iter)
        self.step += 1
        return batch

    def close(self) -> None:
        """Stop the decoding workers now. Left to grain's exit-time finalizer after an
        error, their shutdown can race another close and print a traceback."""
        close_iterator(self._iter)
        self._iter = None

    def get_state(self) -> dict:
        """What a checkpoint stores: the next step, and what the order depends on."""
        return {"step": self.step, **self._fingerprint}

    def set_state(self, state: dict) -> None:
        """Resume so that the next batch is exactly the one an uninterrupted run reads."""
        for key, value in self._fingerprint.items():
            if state.get(key) != value:
                raise ValueError(
                    f"data loader state was saved with {key}={state.get(key)}, this run has "
                    f"{key}={value}: resume with the same data configuration."
                )
        self.step = int(state["step"])
        self._iter = None


# ----------------------------------------------------------------------------- evaluation


class _EvalExample:
    """Position p of the padded split -> a transformed example and its mask."""

    def __init__(self, source, augment):
        self.source, self.augment = source, augment

    def __call__(self, p: int) -> dict:
        real = p < len(self.source)
        record = self.source[int(p) if real else 0]
        return {
            "image": _transform(self.augment.eval, record, int(p) if real else 0, "validation"),
            "label": np.int32(record["label"] if real else 0),
            "mask": np.float32(real),
        }


def eval_steps(num_examples: int, batch_size: int) -> int:
    return -(-num_examples // batch_size)


def eval_batches(
    source: Any,
    augment: Augmentation,
    batch_size: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
    threads: int = 2,
    workers: int = 0,
) -> Iterator[dict]:
    """Every example once across processes: global batches of `batch_size` in split order,
    the last one padded (mask 0) to full size; this process's contiguous share of each."""
    share = process_share(batch_size, process_index, process_count)
    n = len(source)
    positions = np.arange(eval_steps(n, batch_size) * batch_size).reshape(-1, batch_size)
    local = positions[:, share].reshape(-1)

    ds = grain.MapDataset.source(local).map(_EvalExample(source, augment))
    return _iterate(ds.batch(share.stop - share.start), threads, workers, prefetch=2)


def _iterate(batches: grain.MapDataset, threads: int, workers: int, prefetch: int) -> Iterator:
    """`threads` build batches concurrently (libjpeg-turbo and OpenCV release the GIL);
    `workers` > 0: in each of that many grain processes. Order is always the dataset's."""
    if workers > 0 and not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags; outside an absl app
    it = batches.to_iter_dataset(
        grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(prefetch, threads))
    )
    if workers > 0:
        it = it.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=prefetch),
            worker_init_fn=die_with_parent,
        )
    return iter(it)


def die_with_parent(worker_index: int = 0, worker_count: int = 0) -> None:
    """In a decoding worker process: exit once the process that started it is gone,
    however it died (SIGKILL, the OOM killer), instead of living on with its memory and
    its batches' shared memory. A thread watches the parent's pid (Linux's
    PR_SET_PDEATHSIG would fire when the parent's *thread* that started the worker ends,
    which grain's threads do while the run goes on)."""
    del worker_index, worker_count
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="die_with_parent", daemon=True).start()


def close_iterator(batches: Iterator | None) -> None:
    """Stop an iterator of `_iterate` now: its worker processes, and the shared memory of
    the batches they had made ahead (at exit, the resource tracker reports those as
    leaked)."""
    if batches is not None and hasattr(batches, "close"):
        batches.close()
        _finish_unlinking()


def _finish_unlinking() -> None:
    """grain unlinks the shared memory of each batch its worker processes made once the
    program drops the batch, in a thread pool of its own; wait for that pool, or the
    resource tracker reports the unlinks still queued at exit as leaked objects (grain
    0.2; a private attribute: `private.finish_grain_unlinks`). The next prefetching
    iterator starts a new pool."""
    private.finish_grain_unlinks()
