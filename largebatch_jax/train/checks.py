"""What a run checks before it trains: that every process runs the same config, that
one run at a time holds the workdir and every process sees it, that the workdir's record
matches the config. Each failure is one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from largebatch_jax import cluster, fields
from largebatch_jax import record as run_record
from largebatch_jax.errors import ConfigError, WorkdirError
from largebatch_jax.lock import WorkdirLock, read_lock_token
from largebatch_jax.plan import Plan


def processes_agree(config: Any) -> None:
    values = {f"config.{k}": v for k, v in config.to_dict().items() if k not in fields.HOST_LOCAL}
    values["local devices"] = jax.local_device_count()
    # This process's own devices (jax.devices()[0] is process 0's in every process).
    values["platform"] = jax.local_devices()[0].platform
    values["jax version"] = jax.__version__
    if config.reduction == "exact":  # the bits depend on the device model's kernels too
        values["device kind"] = jax.local_devices()[0].device_kind
    try:
        cluster.check_processes_agree(values)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def lock_workdir(work: Path) -> WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole run; every process learns whether
    it did, so that all stop together when another run holds it."""
    lock, error = None, ""
    if jax.process_index() == 0:
        try:
            lock = WorkdirLock(work)
            note = lock.acquire()
            if note:
                logging.warning("%s", note)
        except WorkdirError as e:
            lock, error = None, str(e)
    if jax.process_count() > 1:
        held = multihost_utils.broadcast_one_to_all(np.int32(lock is not None or not error))
        if not held and not error:
            error = f"--workdir={work} is in use by another run (process 0 found its lock)."
        if held:
            error = error or _check_workdir_shared(work, lock)
    if error:
        if lock is not None:
            lock.release()
        raise WorkdirError(error)
    return lock


def _token_word(token: str | None) -> np.ndarray:
    """A lock's token (16 hex digits) as two int32 for a collective (JAX's default
    integers are 32-bit); zeros for none."""
    try:
        return np.frombuffer(bytes.fromhex(str(token)[:16].rjust(16, "0")), np.int32).copy()
    except ValueError:
        return np.zeros(2, np.int32)


def _check_workdir_shared(work: Path, lock: WorkdirLock | None) -> str:
    """Every process must see the one workdir: each reads the token of the lock that
    process 0 has just written and all compare it with process 0's. A folder on each
    host's own disk would otherwise leave process 0 waiting for the others' part of the
    first checkpoint forever. Returns the error, or "" when the workdir is shared."""
    expected = multihost_utils.broadcast_one_to_all(_token_word(lock.token() if lock else None))
    seen = _token_word(read_lock_token(work))
    ok = multihost_utils.process_allgather(np.int32(np.array_equal(seen, expected)))
    blind = [i for i, good in enumerate(np.ravel(ok)) if not good]
    if not blind:
        return ""
    return (
        f"--workdir={work} is not one folder that every process sees: process"
        f"{'es' if len(blind) > 1 else ''} {', '.join(map(str, blind))} of "
        f"{jax.process_count()} cannot see the lock process 0 wrote there: give every "
        "process the same workdir on a file system they share (NFS, Lustre, GPFS), "
        "not a folder on each host's disk."
    )


def against_record(
    config: Any,
    plan: Plan,
    work: Path,
    checkpoints: list[int],
    stamped: Callable[[int], str | None] = lambda step: None,
) -> None:
    """The workdir's record of the config that defines its run, against this config
    (record.check_resume); a fresh workdir records this one. Where they differ but the
    newest checkpoint is stamped (`stamped(step)`: its run identity) with this config's
    identity, the record, not the config, is wrong: it was edited, and following its
    advice would make every checkpoint another run's."""
    recorded = run_record.read_record(work)
    if checkpoints and recorded is not None:
        try:
            run_record.check_resume(recorded, config, max(checkpoints), plan.steps_per_epoch)
        except ConfigError as e:
            identity = run_record.run_identity(config)
            differs = str(e).startswith("the run in this workdir was trained with")
            if not differs or stamped(max(checkpoints)) != identity:
                raise  # a record of the wrong kind, or this config changes the math
            raise ConfigError(
                f"this workdir's {run_record.RECORD} was edited: its checkpoints carry this "
                f"config's run identity ({identity[:12]}), not the record's: restore the "
                "record from result.json's 'config', or delete it (this config is then "
                "recorded), and rerun."
            ) from None
    elif checkpoints:
        logging.warning(
            "%s has checkpoints but no %s: recording this config",
            work,
            run_record.RECORD,
        )
    if jax.process_index() == 0:
        run_record.write_record(work, config)
