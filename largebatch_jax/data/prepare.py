"""Prepare a dataset once, as array_record:

python -m largebatch_jax.data.prepare imagenet2012 --manual_dir=DIR [--data_dir=DIR]
python -m largebatch_jax.data.prepare fashion_mnist [--idx_dir=/usr/share/datasets/fashion-mnist]
python -m largebatch_jax.data.prepare cifar10
python -m largebatch_jax.data.prepare image_folder --root=ROOT --name=NAME

A dataset prepared before is reused; an image folder that changed since is refused, and
`--overwrite` prepares any dataset again from scratch (also the fix for corrupt files).
An image folder's files that do not decode as images are left out and named in one line.
"""

import contextlib
import io
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from absl import app, flags

from largebatch_jax import errors, host
from largebatch_jax.data import sources
from largebatch_jax.errors import DatasetNotPreparedError, WorkdirError
from largebatch_jax.lock import WorkdirLock
from largebatch_jax.metrics import filter_library_logs

flags.DEFINE_string(
    "data_dir", None, "tfds data_dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)."
)
flags.DEFINE_string("manual_dir", None, "imagenet2012: folder with the ILSVRC2012 tars.")
flags.DEFINE_string("idx_dir", None, "fashion_mnist: folder with the IDX files.")
flags.DEFINE_string("root", None, "image_folder: folder with train/<class>/ and val/<class>/.")
flags.DEFINE_string("name", None, "image_folder: the dataset's name (default: root's name).")
flags.DEFINE_bool("overwrite", False, "Delete the prepared copy and prepare it again.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("name one dataset: imagenet2012, fashion_mnist, cifar10, image_folder")
    name = argv[1]
    if name == "image_folder" and FLAGS.name:
        name = sources.FOLDER_PREFIX + FLAGS.name
    host.quiet_native_logs()  # before TensorFlow loads (tfds imports it): its INFO banners
    with host.plugin_noise_filtered():  # the banners TF_CPP_MIN_LOG_LEVEL does not stop
        import tensorflow  # noqa: F401  (tfds loads it later: loaded here, its lines filtered)
    filter_library_logs()
    data_dir = os.path.expanduser(FLAGS.data_dir or sources.default_data_dir())
    out = sys.stdout
    try:
        target = sources.dataset_folder(name, data_dir, FLAGS.root)
        lock = _lock(Path(data_dir), target)
    except (ValueError, WorkdirError) as e:
        _fail(e)
    try:
        _remove_incomplete(target, out)
        print(f"preparing {name} in {data_dir} ...", file=out, flush=True)
        # tfds prints two banners of its own to stdout; its progress bars (stderr) stay
        # where a person watches a terminal.
        with _quiet_tfds(sys.stderr.isatty()):
            where = sources.prepare(
                name,
                data_dir,
                manual_dir=FLAGS.manual_dir,
                idx_dir=FLAGS.idx_dir,
                root=FLAGS.root,
                overwrite=FLAGS.overwrite,
                report=lambda line: print(line, file=out, flush=True),
            )
    except (DatasetNotPreparedError, ValueError) as e:
        _fail(e)
    finally:
        lock.release()
    print(f"prepared {name} in {where}", file=out, flush=True)


def _fail(error: BaseException) -> NoReturn:
    errors.fail(error, 2)


class _PrepareLock(WorkdirLock):
    """One prepare of a dataset at a time: a lock file in data_dir (a second prepare of
    the same dataset would race tfds's rename of its finished folder)."""

    def __init__(self, data_dir: Path, target: Path):
        super().__init__(data_dir)
        self.path = data_dir / f".prepare.{'_'.join(target.relative_to(data_dir).parts)}.lock"
        self.target = target

    def _busy_message(self, holder: dict) -> str:
        return (
            f"{self.target} is being prepared by another process (pid "
            f"{holder.get('pid', '?')} on {holder.get('host', '?')}; {self.path}): wait for "
            "it to finish; it prepares the same data."
        )


def _lock(data_dir: Path, target: Path) -> _PrepareLock:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = _PrepareLock(data_dir, target)
        note = lock.acquire()
    except OSError as e:
        raise WorkdirError(
            f"--data_dir={data_dir} is not writable ({e.strerror}): choose a folder this "
            "user can write, e.g. --data_dir=~/tensorflow_datasets."
        ) from None
    if note:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    return lock


def _remove_incomplete(target: Path, out) -> None:
    """tfds writes a dataset into `incomplete.*` and renames it when done; one left
    behind is from a prepare that was killed (this one holds the lock)."""
    left = sorted(p for p in target.glob("incomplete.*") if p.is_dir())
    for path in left:
        shutil.rmtree(path)
    if left:
        print(
            f"removed {len(left)} unfinished folder(s) of an interrupted prepare in {target}",
            file=out,
            flush=True,
        )


@contextlib.contextmanager
def _quiet_tfds(progress_bars: bool):
    import tensorflow_datasets as tfds

    tfds.display_progress_bar(progress_bars)
    with contextlib.redirect_stdout(io.StringIO()):
        yield


if __name__ == "__main__":
    app.run(main)
