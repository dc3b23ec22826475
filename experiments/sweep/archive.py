"""A sweep's finished runs, kept as one archive: OUT/<config name>.tar.xz.

A run trains in its workdir (RUNS/<config>/<run name>/: checkpoints, for resume); once it
has a result.json (or failed.json) its record, the files of `KEPT`, is packed into the
archive, and the tables and figures read the runs from there. The archive is a plain
tar.xz of `<run name>/<file>` with every member's metadata fixed (mtime 0, mode 0644,
owner 0, in name order), so the same runs give the same bytes; `tar -xJf` restores the
workdirs' files as they were written (`python -m experiments.compare_runs` and
`python -m largebatch_jax.plot` read such a folder).
"""

from __future__ import annotations

import contextlib
import io
import lzma
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

# A run's record: what the tables, figures and compare_runs read, and its console.
KEPT = ("result.json", "failed.json", "metrics.jsonl", "run_config.json", "devices.json", "log.txt")


def finished(workdir: Path) -> bool:
    """A run the sweep will not train again: a result, or a recorded failure."""
    return (workdir / "result.json").exists() or (workdir / "failed.json").exists()


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Path]:
    """The archive's runs in a temporary folder, one subfolder per run (empty without an
    archive); removed on exit."""
    with tempfile.TemporaryDirectory(prefix="sweep_archive_") as folder:
        if path.exists():
            with tarfile.open(path, "r:xz") as tar:
                tar.extractall(folder, filter="data")
        yield Path(folder)


def add(folder: Path, workdir: Path) -> None:
    """Put a finished workdir's record into an opened archive, in place of the run's."""
    target = folder / workdir.name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for name in KEPT:
        if (workdir / name).exists():
            shutil.copyfile(workdir / name, target / name)


def tar_bytes(folder: Path) -> bytes:
    """The uncompressed tar of every file under `folder`, deterministically."""
    files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for file in files:
            data = file.read_bytes()
            info = tarfile.TarInfo(file.relative_to(folder).as_posix())
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def save(path: Path, folder: Path) -> bool:
    """Write the opened archive back if its content changed; True if written."""
    data = tar_bytes(folder)
    if path.exists():
        if lzma.decompress(path.read_bytes()) == data:
            return False
    elif not any(folder.iterdir()):
        return False  # no runs, no archive
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(lzma.compress(data, preset=6 | lzma.PRESET_EXTREME))
    os.replace(partial, path)
    return True
