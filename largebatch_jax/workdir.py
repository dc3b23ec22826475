"""The workdir of one run: its path, one run at a time in it (a lock), the record of the
config that defines the run's math (compared on every resume), and files written so that
a crash can never leave them unreadable.

Every failure here is one line (WorkdirError, or ConfigError for a config that does not
match the workdir's run); main.py turns both into exit code 2.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_collections

from largebatch_jax import schedules
from largebatch_jax.validate import ConfigError


class WorkdirError(Exception):
    """The workdir cannot hold the run (in use, not writable, full); one line."""


def resolve(workdir: str | Path) -> Path:
    """`--workdir` as an absolute path, `~` expanded (a shell leaves `--workdir=~/x` alone)."""
    if not str(workdir).strip():  # Path("") is the current directory
        raise WorkdirError(
            "--workdir is empty: name the run's folder, e.g. --workdir=workdirs/run1."
        )
    return Path(os.path.expanduser(str(workdir))).absolute()


def check_writable(workdir: Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        for name in ("checkpoints",):
            if (workdir / name).exists() and not (workdir / name).is_dir():
                raise WorkdirError(
                    f"{workdir / name} is a file, where the run keeps its {name}: move it "
                    "away or choose another workdir."
                )
    except OSError as e:
        raise WorkdirError(
            f"--workdir={workdir} is not writable ({e.strerror}): choose another directory."
        ) from None


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once: readers see the old file or the new one,
    never a part (a crash or a full disk leaves the old one and no temporary behind)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a full disk or quota."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False


# ----------------------------------------------------------------------------- the lock


class WorkdirLock:
    """One run per workdir: `run.lock` names the process holding it (pid, its start time,
    host, since) and a random token.

    The file is created with O_CREAT | O_EXCL, atomic on local filesystems and on NFS
    (v3 and later), and its mtime is touched every `heartbeat_seconds` while the run
    lives. A lock is stale when its process is gone (same host: no process with that pid
    and start time; pids are reused, in containers after every restart) or, held from
    another host where the pid cannot be checked, when its heartbeat is older than
    `stale_seconds`; an unreadable lock (empty, torn) older than `TORN_SECONDS` is stale
    too. A stale lock is replaced with a warning. In a multi-process run process 0 holds
    it for all, and every process checks that it sees the token (trainer.build).
    """

    NAME = "run.lock"
    TORN_SECONDS = 5.0  # a lock is written right after it is created

    def __init__(self, workdir: Path, heartbeat_seconds: float = 10.0, stale_seconds: float = 60.0):
        self.path = Path(workdir) / self.NAME
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self.me = {
            "pid": os.getpid(),
            "started": process_start_time(os.getpid()),
            "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "token": secrets.token_hex(8),
        }
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale one was replaced. WorkdirError
        (one line naming the holder) when a live run holds it."""
        note = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, age = self._holder()
                if not self._is_stale(holder, age):
                    raise WorkdirError(self._busy_message(holder)) from None
                note = (
                    f"replaced the stale lock {self.path} of pid {holder.get('pid')} on "
                    f"{holder.get('host')} (since {holder.get('since')}; no heartbeat for "
                    f"{age:.0f} s or the process is gone)"
                )
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me) + "\n")
            self._beat = threading.Thread(target=self._heartbeat, daemon=True)
            self._beat.start()
            return note
        holder, _ = self._holder()
        raise WorkdirError(self._busy_message(holder))

    def _holder(self) -> tuple[dict, float]:
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return {}, float("inf")
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:  # being written this instant, or torn
            holder = {}
        return holder if isinstance(holder, dict) else {}, time.time() - mtime

    def _is_stale(self, holder: dict, age: float) -> bool:
        # On this host the process is the truth (a stopped or busy run keeps its lock);
        # on another, only the heartbeat can tell.
        if not holder:
            return age > self.TORN_SECONDS
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            started = holder.get("started")
            alive = _process_alive(holder["pid"])
            return not alive or (
                started is not None and process_start_time(holder["pid"]) != started
            )
        return age > self.stale_seconds

    def token(self) -> str:
        return self.me["token"]

    def _busy_message(self, holder: dict) -> str:
        if not holder:
            return (
                f"--workdir={self.path.parent} is being locked by another run this instant "
                f"({self.path} is not written yet): try again in {self.TORN_SECONDS:.0f} s."
            )
        return (
            f"--workdir={self.path.parent} is in use by another run (pid "
            f"{holder.get('pid', '?')} on {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')}; {self.path}): wait for it to end, stop it, or "
            "choose another workdir."
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        holder, _ = self._holder()
        if holder.get("pid") == self.me["pid"] and holder.get("since") == self.me["since"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def read_lock_token(workdir: Path) -> str | None:
    """The token of the lock in `workdir` as this process sees it (None: no lock here)."""
    with contextlib.suppress(OSError, json.JSONDecodeError, AttributeError):
        return json.loads((Path(workdir) / WorkdirLock.NAME).read_text()).get("token")
    return None


def process_start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (Linux), or None: with the pid,
    it names one process, which a pid alone does not once pids are reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:  # a zombie (killed, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ----------------------------------------------------------------------------- the record

RECORD = "run_config.json"

# The only fields a resumed run may change: they do not enter its math. Paths and host
# resources; logging, evaluation and checkpoint intervals (what is reported, not what is
# trained); the layout, which the invariance promise makes free (DESIGN.md). num_epochs
# may change too, but only while the learning rate of every step already trained stays
# the same (step decay: extending a run; not cosine, which spans num_epochs).
MAY_CHANGE = (
    "data_dir",
    "workers",
    "prefetch_batches",
    "log_every_steps",
    "eval_every_epochs",
    "eval_batch_size",
    "checkpoint_every_steps",
    "keep_checkpoints",
    "result_last_epochs",
    "accum_steps",
    "accum_loop",
    "parallelism",
)


# Fields added to the config since workdirs record theirs, each with the value that gives
# the math of the runs recorded before it existed. A record without one of these fields
# may resume only at that value. A math field added later must be listed here (or in
# MAY_CHANGE); tests/test_faults.py fails until it is, and an unlisted field missing
# from a record stops the resume rather than being guessed.
BEFORE_FIELD: dict[str, Any] = {
    "reduction": "fast",
    "lr_multiplier": 1.0,
}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))  # tuples -> lists, as the record stores them


def read_record(workdir: Path) -> dict | None:
    path = workdir / RECORD
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkdirError(
            f"{path} is not readable ({e}): restore it from the run's result.json 'config', "
            "or use a new workdir."
        ) from None


def write_record(workdir: Path, config: Any) -> None:
    atomic_write_text(workdir / RECORD, json.dumps(_plain(config.to_dict()), indent=2) + "\n")


def check_resume(recorded: dict, config: Any, step: int, steps_per_epoch: int) -> None:
    """The config of a run resumed at `step` against the recorded one: every field that
    changes the math must be equal; ConfigError (one line: the fields, both values, the
    fix) otherwise. A field newer than the record counts as its BEFORE_FIELD value; a
    field the code no longer has is ignored (it cannot be set)."""
    current = _plain(config.to_dict())
    skip = set(MAY_CHANGE) | {"num_epochs"}
    unknown = sorted(set(current) - set(recorded) - skip - set(BEFORE_FIELD))
    if unknown:
        raise ConfigError(
            f"this workdir's {RECORD} has no field {', '.join(unknown)}, so what its run was "
            "trained with is unknown: add the field with its value to the record, or use "
            "a new workdir."
        )
    recorded = {**{f: _plain(v) for f, v in BEFORE_FIELD.items()}, **recorded}
    shared = sorted(set(recorded) & set(current) - skip)
    for f in shared:
        if _kind(recorded[f]) != _kind(current[f]):
            raise ConfigError(
                f"this workdir's {RECORD} has {f}={recorded[f]!r}, not a value of the field's "
                f"type ({type(current[f]).__name__}): the record was edited or damaged: "
                "restore it (result.json holds a copy of the config) or use a new workdir."
            )
    differ = [f for f in shared if recorded[f] != current[f]]
    if differ:
        what = ", ".join(f"{f}={recorded[f]!r} (this config: {current[f]!r})" for f in differ)
        fix = " ".join(f"--config.{f}={_flag(recorded[f])}" for f in differ)
        raise ConfigError(
            f"the run in this workdir was trained with {what}; resuming would change its "
            f"math: rerun with {fix}, or use a new workdir."
        )
    before, now = recorded.get("num_epochs"), current["num_epochs"]
    if before is None or before == now:
        return
    total = schedules.epochs_to_steps(now, steps_per_epoch)
    if step > total:
        raise ConfigError(
            f"config.num_epochs={now} ({total} steps) ends before this workdir's checkpoint at "
            f"step {step} (trained with num_epochs={before}): rerun with "
            f"--config.num_epochs={before}, or use a new workdir."
        )
    old = schedules.create_learning_rate_schedule(
        ml_collections.ConfigDict({**dict(current), **recorded}), steps_per_epoch
    )
    new = schedules.create_learning_rate_schedule(config, steps_per_epoch)
    steps = jnp.arange(step)
    if step and not bool(jnp.all(old(steps) == new(steps))):
        raise ConfigError(
            f"config.num_epochs={now} (trained with {before}) changes the learning rate of "
            f"the {step} steps already trained (lr_decay={config.lr_decay!r}): rerun with "
            f"--config.num_epochs={before}, or use a new workdir."
        )


def _kind(value: Any) -> str:
    """A value's JSON kind: numbers are one kind (a float field may hold 1 or 1.0)."""
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, int | float) else type(value).__name__


def _flag(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ",".join(map(str, value)) + ("," if len(value) == 1 else "") + ")"
    return str(value)
