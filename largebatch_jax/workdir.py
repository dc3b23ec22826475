"""The workdir of one run: its path, writability, files written so that a crash can never
leave them unreadable, and disk-full detection. One run at a time holds it (lock.py); the
record of the config that defines its run is record.py.

Every failure here is one line (WorkdirError); main.py turns it into exit code 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from largebatch_jax.lock import WorkdirError


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
