"""One run (or one prepare) at a time in a folder: a lock file naming its process,
replaced only when that process is gone. No JAX here: the data tools use it too.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from largebatch_jax.errors import WorkdirError

_HELD: list = []  # the locks this process holds (release_held, for an exit without unwinding)


def release_held() -> None:
    """Release every lock this process holds (before an `os._exit`)."""
    for lock in list(_HELD):
        lock.release()


class WorkdirLock:
    """One run per workdir: `run.lock` names the process holding it (pid, its start time,
    host, since) and a random token.

    The file is written whole under a name of its own, then hard-linked to `NAME`
    (atomic on local filesystems and on NFS), so nobody sees it half-written and a
    signal that ends the process at any instant (`release_held`) finds it either absent
    or ours by its token. On a filesystem without hard links it is created with
    O_CREAT | O_EXCL instead. Its mtime is touched every `heartbeat_seconds` while the
    run lives. A lock is stale when its process is gone (same host: no process with
    that pid and start time; pids are reused, in containers after every restart) or,
    held from another host where the pid cannot be checked, when its heartbeat is older
    than `stale_seconds`; an unreadable lock (empty, torn) older than `TORN_SECONDS` is
    stale too. A stale lock is replaced with a warning. In a multi-process run process
    0 holds it for all, and every process checks that it sees the token
    (train.setup.build).
    """

    NAME = "run.lock"
    TORN_SECONDS = 5.0  # an O_EXCL lock is written right after it is created

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

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale one was replaced. WorkdirError
        (one line naming the holder) when a live run holds it."""
        self._stop = threading.Event()  # a lock object may be acquired again
        _HELD.append(self)  # before the file can exist: release_held() then finds it
        try:
            note = None
            for _ in range(2):
                if self._create():
                    beat = threading.Thread(target=self._heartbeat, args=(self._stop,))
                    beat.daemon = True  # never keeps a finished process alive
                    beat.start()
                    return note
                holder, age = self._holder()
                if not self._is_stale(holder, age):
                    raise WorkdirError(self._busy_message(holder))
                note = (
                    f"replaced the stale lock {self.path} of pid {holder.get('pid')} on "
                    f"{holder.get('host')} (since {holder.get('since')}; no heartbeat for "
                    f"{age:.0f} s or the process is gone)"
                )
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            holder, _ = self._holder()
            raise WorkdirError(self._busy_message(holder))
        except BaseException:
            self.release()
            raise

    @property
    def _draft(self) -> Path:
        """The lock file as this process writes it, before it links it as `path`."""
        return self.path.with_name(f".{self.path.name}.{self.me['token']}")

    def _create(self) -> bool:
        """Create the lock file with our record in it; False when a lock file exists."""
        self._draft.write_text(json.dumps(self.me) + "\n")
        try:
            os.link(self._draft, self.path)
            return True
        except FileExistsError:
            # NFS can answer EEXIST to a retried link that did succeed: the count tells.
            return os.stat(self._draft).st_nlink == 2
        except OSError:  # no hard links here
            return self._create_exclusive()
        finally:
            with contextlib.suppress(FileNotFoundError):
                self._draft.unlink()

    def _create_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.me) + "\n")
        return True

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
        if not holder:  # only the instant of its writing leaves a lock unwritten; an
            # mtime in the future (a clock set back, a file copied in) is no such instant
            return abs(age) > self.TORN_SECONDS
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

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_seconds):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the lock file if it is ours (its token), and our draft of it. Safe to
        call again at any point, from a signal handler too: this lock leaves `_HELD`
        last."""
        self._stop.set()
        # OSError: a file system gone read-only keeps the lock; its process is gone when
        # the next run looks, so that run replaces it as stale.
        with contextlib.suppress(OSError):
            self._draft.unlink()
        holder, _ = self._holder()
        if holder.get("token") == self.me["token"]:
            with contextlib.suppress(OSError):
                self.path.unlink()
        if self in _HELD:
            _HELD.remove(self)


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
