"""The workdir of one run: its path, writability, files written so that a crash can never
leave them unreadable, and disk-full detection. One run at a time holds it (lock.py); the
record of the config that defines its run is record.py.

Every failure here is one line (WorkdirError); main.py turns it into exit code 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from largebatch_jax.errors import WorkdirError

# FUSE mounts of object stores (Cloud Storage, S3, Azure Blob): no atomic rename of a
# folder, no hard link, appends that rewrite the object.
OBJECT_STORE_MOUNTS = (
    "fuse.gcsfuse",
    "fuse.s3fs",
    "fuse.goofys",
    "fuse.mountpoint-s3",
    "fuse.blobfuse",
    "fuse.blobfuse2",
    "fuse.rclone",
)
# Why a workdir cannot be in an object store, and what to use instead.
NEEDS = (
    "a run takes its lock with an atomic exclusive create, appends metrics.jsonl line by "
    "line and renames each checkpoint's folder into place when it is complete, which an "
    "object store does not do: use a folder on a file system every process mounts (NFS, "
    "Lustre, GPFS; on Cloud TPU a Filestore share), e.g. --workdir=/mnt/shared/rn50_8k."
)


def resolve(workdir: str | Path, mounts: str = "/proc/self/mounts") -> Path:
    """`--workdir` as an absolute path, `~` expanded (a shell leaves `--workdir=~/x` alone).
    A URL (gs://, s3://) or a folder on a FUSE mount of an object store is refused."""
    text = str(workdir)
    if not text.strip():  # Path("") is the current directory
        raise WorkdirError(
            "--workdir is empty: name the run's folder, e.g. --workdir=workdirs/run1."
        )
    if url := re.match(r"([a-zA-Z][\w+.-]*)://", text):
        raise WorkdirError(f"--workdir={text}: a {url[1]}:// URL cannot be a workdir: {NEEDS}")
    path = Path(os.path.expanduser(text)).absolute()
    fstype = mount_type(Path(os.path.realpath(path)), mounts)
    if fstype in OBJECT_STORE_MOUNTS:
        raise WorkdirError(f"--workdir={path} is on a {fstype} mount of an object store: {NEEDS}")
    return path


def mount_type(path: Path, mounts: str = "/proc/self/mounts") -> str | None:
    """The file system type of the mount that holds `path` (which need not exist yet)."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


# The files and folders a run writes in its workdir (checkpoints/ may be a link to
# another disk: the run writes inside it, not to it).
RUN_FILES = ("run_config.json", "metrics.jsonl", "result.json", "run.lock", "rejected_checkpoints")


def check_writable(workdir: Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        for name in RUN_FILES:
            if (workdir / name).is_symlink():
                raise WorkdirError(
                    f"{workdir / name} is a symlink (to {os.readlink(workdir / name)}): the run "
                    "writes its own files in its workdir, never through a link: replace it "
                    "by the file it points to, or remove it."
                )
        for name in RUN_FILES[:-1]:
            if (workdir / name).is_dir():
                raise WorkdirError(
                    f"{workdir / name} is a folder, where the run keeps its file {name}: move "
                    "it away or choose another workdir."
                )
        for name in ("checkpoints", RUN_FILES[-1]):
            if (workdir / name).exists() and not (workdir / name).is_dir():
                raise WorkdirError(
                    f"{workdir / name} is a file, where the run keeps its {name}: move it "
                    "away or choose another workdir."
                )
    except OSError as e:
        raise WorkdirError(
            f"--workdir={workdir} is not writable ({e.strerror}): choose another directory."
        ) from None


def output_file_problem(flag: str, path: str, suffixes: tuple[str, ...] = ()) -> str:
    """Why a command could not write its output `path` (given as `flag`), in one line,
    checked before the work that makes it; "" when it can."""
    target = Path(path)
    if suffixes and target.suffix.lower() not in suffixes:
        return (
            f"{flag}={path}: cannot write a {target.suffix or 'suffix-less'} file: name it "
            f"with one of {', '.join(suffixes)}."
        )
    folder = target.parent
    if not folder.is_dir():
        return f"{flag}={path}: the folder {folder} does not exist: create it first."
    if not os.access(folder, os.W_OK):
        return f"{flag}={path}: the folder {folder} is not writable: choose another."
    return ""


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once: readers see the old file or the new one,
    never a part (a crash or a full disk leaves the old one and no temporary behind).
    The temporary is a new file of this process (never a link someone put in its name's
    place: that is removed, not followed), and a link at `path` is replaced, not written
    through."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileExistsError:  # a stale temporary, or a planted link: not followed
            tmp.unlink()
            fd = os.open(tmp, flags, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a full disk or quota."""
    return _caused_by(
        error, (errno.ENOSPC, errno.EDQUOT), ("No space left on device", "Disk quota exceeded")
    )


def is_read_only(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a write to a file system that
    has become read-only (ext4 and others remount so after a disk error)."""
    return _caused_by(error, (errno.EROFS,), ("Read-only file system",))


def is_io_error(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is an I/O error (EIO): a disk
    error, which ext4 answers by remounting read-only (an fsync in flight then gets EIO,
    the writes after it EROFS)."""
    return _caused_by(error, (errno.EIO,), ("Input/output error",))


def _caused_by(error: BaseException, errnos: tuple[int, ...], texts: tuple[str, ...]) -> bool:
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in errnos:
            return True
        if any(t in str(e) for t in texts):
            return True
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False
