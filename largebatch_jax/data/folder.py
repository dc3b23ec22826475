"""A user's image folder, `root/{train,val}/<class>/*`, as a tfds dataset: every file is
decoded once before it is stored, and the folder's fingerprint is kept beside the
prepared data so that a changed folder is never silently replaced by its old copy.

Files that do not decode as images (a truncated JPEG, README.txt, .DS_Store) are left
out, counted and named in one line; a file that decodes is kept whatever its suffix says
(a PNG named .jpg is an image, and training decodes it by its content).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from largebatch_jax.data import transforms

SPLIT_DIRS = {"train": "train", "validation": "val"}
SOURCE_RECORD = "source.json"  # in the prepared version's directory


@dataclasses.dataclass
class Scan:
    """What `scan` found: the classes, the decodable files of each split (relative to
    root), the files left out with why, and the fingerprint of every file seen."""

    root: Path
    classes: list[str]
    files: dict[str, list[str]]
    skipped: list[tuple[str, str]]
    fingerprint: str
    no_val: list[str] = dataclasses.field(default_factory=list)  # classes without val images

    def summary(self, limit: int = 10) -> str:
        kept = sum(len(v) for v in self.files.values())
        line = f"{kept} images in {len(self.classes)} classes from {self.root}"
        if self.no_val:
            named = ", ".join(self.no_val[:limit]) + (" ..." if len(self.no_val) > limit else "")
            line += f" ({len(self.no_val)} class(es) with no validation image: {named})"
        if not self.skipped:
            return line
        named = ", ".join(f"{p} ({why})" for p, why in self.skipped[:limit])
        more = f" and {len(self.skipped) - limit} more" if len(self.skipped) > limit else ""
        return (
            f"{line}; left out {len(self.skipped)} file(s), each with why: "
            f"{named}{more} (all listed in {SOURCE_RECORD})"
        )

    def record(self) -> dict:
        return {"root": str(self.root), "fingerprint": self.fingerprint, "skipped": self.skipped}


def _undecodable(path: Path) -> str | None:
    try:
        return transforms.decode_error(path.read_bytes())
    except OSError as e:
        return f"unreadable: {e.strerror}"


def scan(root: str | Path, workers: int | None = None) -> Scan:
    """Every file under root/train/<class>/ and root/val/<class>/, each decoded once."""
    root = Path(root).absolute()
    for sub in SPLIT_DIRS.values():
        if not (root / sub).is_dir():
            raise ValueError(f"image folder {root}: no {sub}/ sub-folder of classes")
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    extra = sorted(p.name for p in (root / "val").iterdir() if p.is_dir() and p.name not in classes)
    if extra:
        raise ValueError(
            f"image folder {root}: val/{extra[0]}/ is a class that train/ does not have "
            f"({len(extra)} such): the model would never be trained on it; add "
            f"train/{extra[0]}/ with its images or remove val/{extra[0]}/."
        )
    listed = {
        split: [
            f"{sub}/{cls}/{f.name}"
            for cls in classes
            if (root / sub / cls).is_dir()
            for f in sorted((root / sub / cls).iterdir())
            if f.is_file()
        ]
        for split, sub in SPLIT_DIRS.items()
    }
    everything = [p for paths in listed.values() for p in paths]
    digest = hashlib.sha256()
    for p in everything:
        st = (root / p).stat()
        digest.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    with ThreadPoolExecutor(workers or os.cpu_count()) as pool:  # PIL releases the GIL
        reasons = list(pool.map(lambda p: _undecodable(root / p), everything))
    errors = dict(zip(everything, reasons, strict=True))
    # Files beside the class folders belong to no class: left out, and named.
    loose = [
        (f"{sub}/{f.name}", "not in a class folder")
        for sub in SPLIT_DIRS.values()
        for f in sorted((root / sub).iterdir())
        if f.is_file()
    ]
    found = Scan(
        root=root,
        classes=classes,
        files={s: [p for p in paths if errors[p] is None] for s, paths in listed.items()},
        skipped=[(p, errors[p]) for p in everything if errors[p] is not None] + loose,
        fingerprint=digest.hexdigest(),
    )
    _check_classes(found)
    return found


def _check_classes(found: Scan) -> None:
    """Every class has training images (one without cannot be learned) and val/ has
    images; a class with none in val/ is named in the summary line."""
    for split, sub in SPLIT_DIRS.items():
        if not found.files[split]:
            raise ValueError(
                f"image folder {found.root}: {sub}/ holds no image in its class folders: "
                f"add images to {sub}/<class>/."
            )
    with_images = {split: {p.split("/")[1] for p in found.files[split]} for split in SPLIT_DIRS}
    empty = [c for c in found.classes if c not in with_images["train"]]
    if empty:
        raise ValueError(
            f"image folder {found.root}: train/{empty[0]}/ holds no image ({len(empty)} such "
            f"class folder(s)): a class without training images cannot be learned; add "
            f"images to it or remove it."
        )
    found.no_val = [c for c in found.classes if c not in with_images["validation"]]


def recorded_source(version_dir: Path) -> dict | None:
    try:
        return json.loads((version_dir / SOURCE_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_source(version_dir: Path, found: Scan) -> None:
    (version_dir / SOURCE_RECORD).write_text(json.dumps(found.record(), indent=1) + "\n")


def builder(found: Scan, name: str, data_dir: str) -> Any:
    """A tfds builder over the scanned files: class ids from the sorted class names."""
    import tensorflow_datasets as tfds

    class ImageFolder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS: Sequence[Any] = [tfds.core.BuilderConfig(name=name)]

        def _info(self):
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict(
                    {
                        "image": tfds.features.Image(encoding_format="jpeg"),
                        "label": tfds.features.ClassLabel(names=found.classes),
                        "file_name": tfds.features.Text(),
                    }
                ),
                supervised_keys=("image", "label"),
            )

        def _split_generators(self, dl_manager):
            del dl_manager
            return {
                split: self._generate_examples(paths)
                for split, paths in found.files.items()
                if (found.root / SPLIT_DIRS[split]).is_dir()
            }

        def _generate_examples(self, paths):
            labels = {c: i for i, c in enumerate(found.classes)}
            for path in paths:
                _, cls, file = path.split("/")
                key = f"{cls}/{file}"  # names the record's file in the loader's errors
                yield (
                    key,
                    {
                        "image": str(found.root / path),
                        "label": labels[cls],
                        "file_name": key,
                    },
                )

    ImageFolder.name = "image_folder"
    return ImageFolder(data_dir=data_dir, config=name, file_format="array_record")
