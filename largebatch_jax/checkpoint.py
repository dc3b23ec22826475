"""Checkpoints with orbax: the train state (params, optimizer, BN statistics, step) and a
JSON of the host-side state (data loader position, partial epoch sums).

Saves are atomic (orbax writes a temporary directory and renames it), so a run killed at
any moment leaves only complete checkpoints behind. Each checkpoint is stamped with the
identity of its run and the sha256 of its arrays. Restoring tries the newest first and
falls back to older ones when a checkpoint cannot be read, belongs to another run or no
longer matches its checksum; such a checkpoint is moved aside (`REJECTED`), never
deleted. A checkpoint counts as saved only once it is durable: every file and folder of
it, and its name in the checkpoints folder, fsynced (orbax's own metadata files and its
rename are not), so that a machine that crashes or loses power leaves it readable; the
oldest beyond `keep` is deleted only after the newer ones are durable, and nothing else
here deletes a checkpoint. A save is not started when the disk lacks the room for it (an
OSError ENOSPC, before anything is written).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging as pylogging
import os
import shutil
import traceback
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from largebatch_jax import private

# Where restore moves the checkpoints it cannot use, beside the checkpoints folder.
REJECTED = "rejected_checkpoints"
# The key of the stamp in a checkpoint's host JSON: {"run": identity, "state_sha256": ...}.
STAMP = "checkpoint"


def tree_digest(tree: Any) -> str:
    """sha256 of the bytes of every array in `tree` (fetched to this host), in tree
    order: equal digests mean bit-identical arrays."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()


def host_digest(host: dict) -> str:
    """sha256 of a checkpoint's host state as JSON (keys sorted), its stamp left out."""
    plain = {k: v for k, v in host.items() if k != STAMP}
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class Restored:
    """What `restore_latest` found: the newest usable checkpoint (None: no usable one) and
    the newer ones it passed over, with why (step -> reason)."""

    state: Any = None
    host: dict | None = None
    step: int | None = None
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)


class _OrbaxErrorsInOneLine(pylogging.Filter):
    """Orbax logs a failure of its background save threads with the whole traceback,
    often dozens of them for one full disk, and asyncio logs the failed tasks of a cut
    save that nobody awaited ("Task exception was never retrieved") with theirs; the
    same error reaches the main thread (at the next save or the final wait), which
    reports or raises it. Their log keeps one line per failure: the message and the
    exception's first line."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        if record.exc_info and _from_orbax(record):
            error = record.exc_info[1]
            first = (str(error).splitlines() or [""])[0]
            record.msg = f"{record.getMessage()} ({type(error).__name__}: {first})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _from_orbax(record: pylogging.LogRecord) -> bool:
    """Logged by orbax, or about an exception raised inside it."""
    if "/orbax/" in record.pathname:
        return True
    trace = record.exc_info[2] if record.exc_info else None
    return any("/orbax/" in frame.filename for frame in traceback.extract_tb(trace))


def _log_orbax_errors_in_one_line() -> None:
    for name in ("absl", "asyncio"):
        logger = pylogging.getLogger(name)
        if not any(isinstance(f, _OrbaxErrorsInOneLine) for f in logger.filters):
            logger.addFilter(_OrbaxErrorsInOneLine())


class Checkpointer:
    """The run's checkpoints in `directory`; `identity` names the run (every checkpoint
    saved carries it, and restore uses only the checkpoints that carry it)."""

    def __init__(self, directory: str | Path, keep: int, identity: str = ""):
        self.directory = Path(directory).absolute()
        self.identity = identity
        self.keep = keep
        self._durable: set[int] = set()  # steps fsynced by this process
        self._saved = False  # rotation follows a save of this run's, never a mere start
        _log_orbax_errors_in_one_line()
        self.manager = ocp.CheckpointManager(
            self.directory,
            # A save cut short (SIGKILL, a full disk) leaves a temporary directory that
            # restore never reads; it is removed when the next run opens the manager.
            # No rotation by orbax: `_settle` deletes the oldest once the newer are durable.
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None, create=True, cleanup_tmp_directories=True
            ),
            item_names=("state", "host"),
        )
        # That clean-up runs in a thread of orbax's; a run that stops at start-up (a config
        # refused) would exit under it, and the thread logs an error. Wait for it here
        # (a private method of orbax 0.12: `private.await_orbax_tmp_cleanup`).
        private.await_orbax_tmp_cleanup(self.manager)

    def steps(self) -> list[int]:
        """The finished checkpoints on disk (a save in progress is a temporary directory)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def save(self, step: int, state: Any, host_state: dict) -> bool:
        """Save at `step` unless a checkpoint of that step exists (never overwritten);
        the host JSON gets the stamp: this run's identity and the arrays' sha256."""
        if step in self.manager.all_steps():
            return False
        self.wait()  # the previous save finished, durable, and the oldest rotated out
        _check_room(self.directory, state)
        self._saved = True
        stamp = {
            "run": self.identity,
            "state_sha256": tree_digest(state),
            "host_sha256": host_digest(host_state),
        }
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                host=ocp.args.JsonSave({**host_state, STAMP: stamp}),
            ),
            force=True,
        )

    def restore_latest(self, template: Any) -> Restored:
        """The newest usable checkpoint, shaped and placed like `template`: readable, of
        this run, its arrays matching their checksum. Each newer one is listed in
        `rejected` with why (the caller reports them; set_aside moves them)."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        found = Restored()
        for step in reversed(self.steps()):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()
                    ),
                )
                host = restored["host"]
                why = self._why_not_ours(restored["state"], host)
            except Exception as e:  # a corrupt or partial checkpoint
                lines = str(e).splitlines()
                why = f"cannot be read ({type(e).__name__}: {lines[0] if lines else ''})"
            if not why:
                found.state, found.host, found.step = restored["state"], host, step
                return found
            found.rejected[step] = why
        return found

    def stamped_identity(self, step: int) -> str | None:
        """The run identity stamped on the checkpoint of `step` (its host JSON only is
        read), or None where it has none or cannot be read."""
        try:
            host = self.manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
            stamp = host["host"].get(STAMP)
            return stamp.get("run") if isinstance(stamp, dict) else None
        except Exception:  # unreadable: restore says why, later
            return None

    def _why_not_ours(self, state: Any, host: Any) -> str:
        """Why a checkpoint that was read cannot be used ("" when it can); takes the stamp
        out of `host`. Its host state must be an object at the step of its arrays (the
        TrainState's own step), and match the sha256 its stamp saved with it; a
        checkpoint saved before stamps existed (or before they covered the host state)
        is used where its host state is at its arrays' step."""
        if not isinstance(host, dict) or not isinstance(host.get("step"), int):
            return "is damaged (its host state has no step: it is not the one saved)"
        stamp = host.pop(STAMP, None)
        arrays_step = int(jax.device_get(state.step)) if hasattr(state, "step") else None
        if arrays_step is not None and host["step"] != arrays_step:
            return (
                f"is damaged (its host state is at step {host['step']}, its arrays at step "
                f"{arrays_step})"
            )
        if stamp is None:
            return ""
        if not isinstance(stamp, dict) or stamp.get("run") != self.identity:
            run = stamp.get("run") if isinstance(stamp, dict) else stamp
            return (
                f"was saved by another run (run identity {str(run)[:12]}, this run's "
                f"{self.identity[:12]}: its config differs in a field that changes the math)"
            )
        if stamp.get("state_sha256") != tree_digest(state):
            return "is damaged (its arrays do not match the sha256 saved with them)"
        if "host_sha256" in stamp and stamp["host_sha256"] != host_digest(host):
            return "is damaged (its host state does not match the sha256 saved with it)"
        return ""

    def set_aside(self, step: int) -> Path:
        """Move the checkpoint of `step` out of the run, into REJECTED beside the
        checkpoints folder (kept for inspection; the run saves that step anew)."""
        aside = self.directory.parent / REJECTED
        aside.mkdir(exist_ok=True)
        target, n = aside / str(step), 1
        while target.exists():
            target, n = aside / f"{step}.{n}", n + 1
        try:
            (self.directory / str(step)).rename(target)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            # checkpoints/ is a link to another file system: copied over, then removed.
            shutil.move(self.directory / str(step), target)
        self._durable.discard(step)
        return target

    def reload(self) -> None:
        """Read the steps on disk again (after set_aside, on every process)."""
        self.manager.reload()

    def wait(self) -> None:
        """Until the saves started are finished and durable (`_settle`)."""
        self.manager.wait_until_finished()
        self._settle()

    def close(self) -> None:
        self.wait()
        self.manager.close()

    def _settle(self) -> None:
        """Make every finished checkpoint durable (its files, its folders, its name), then,
        once this run has saved one, delete the oldest beyond `keep` (process 0; each
        deletion made durable too), as orbax's rotation did after each save."""
        steps = self.steps()
        fresh = [s for s in steps if s not in self._durable]
        for step in fresh:
            _fsync_tree(self.directory / str(step))
        if fresh:
            _fsync_path(self.directory)
            self._durable.update(fresh)
        if not self._saved or jax.process_index() != 0 or len(steps) <= self.keep:
            return
        for step in steps[: len(steps) - self.keep]:
            shutil.rmtree(self.directory / str(step))
            self._durable.discard(step)
        _fsync_path(self.directory)
        self.manager.reload()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, and `root`."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder))


def _check_room(directory: Path, state: Any) -> None:
    """A full disk found before a save, not in orbax's threads half-way through it: the
    checkpoint holds each array once (its global size), plus a little metadata."""
    need = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)) * 1.05 + (1 << 20)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device for a checkpoint of {need / 2**20:.1f} MiB "
            f"({free / 2**20:.1f} MiB free)",
            str(directory),
        )
