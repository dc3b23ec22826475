"""Install the project into the Python that runs this script, for the hardware it finds:
the notebooks' install cell (Colab, a Jupyter host), from a checkout of the repository.

    python scripts/install_for_runtime.py              # from the checkout's root
    python scripts/install_for_runtime.py --dry_run    # print the pip command only

The extra for the accelerator the host exposes (`cuda12` for an NVIDIA GPU, `tpu` for
Cloud TPU chips: `largebatch_jax.host.visible_accelerators`), one line where there is
none; the package editable (`configs` with it), so that a restarted runtime imports both.
Where the runtime already has TensorFlow (Colab's, built for its GPU), the dependency
`tensorflow-cpu` is left out instead of installed over it (tfds needs one of the two).
Standard library only: it runs before anything of the project is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXTRA = {"cuda": "cuda12", "tpu": "tpu"}


def requirement_name(requirement: str) -> str:
    """The distribution a requirement names, normalized (PEP 503)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", name[1]).lower() if name else ""


def pip_commands(
    pyproject: dict, accelerators: tuple[str, ...], has_tensorflow: bool, repo: Path
) -> tuple[list[list[str]], str]:
    """The pip commands (arguments after `python -m pip`) and a line saying what they
    install: the package without its dependencies, then its dependencies and the
    extra's, less `tensorflow-cpu` where TensorFlow is already there."""
    project = pyproject["project"]
    extra = EXTRA.get(accelerators[0]) if accelerators else None
    needed = list(project["dependencies"])
    if extra:
        needed += project["optional-dependencies"][extra]
    if has_tensorflow:
        needed = [r for r in needed if requirement_name(r) != "tensorflow-cpu"]
    what = (
        f"installing largebatch_jax with the '{extra}' extra (this host has "
        f"{'an NVIDIA GPU' if extra == 'cuda12' else 'TPU chips'})"
        if extra
        else "installing largebatch_jax for CPU only: this host has no GPU or TPU (on Colab: "
        "Runtime > Change runtime type)"
    )
    if has_tensorflow:
        what += "; keeping the runtime's TensorFlow"
    return [
        ["install", "--quiet", "--no-deps", "-e", str(repo)],
        ["install", "--quiet", *needed],
    ], what


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/install_for_runtime.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dry_run", action="store_true", help="print the pip commands only")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from largebatch_jax.host import visible_accelerators  # standard library only

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    has_tensorflow = importlib.util.find_spec("tensorflow") is not None
    commands, what = pip_commands(pyproject, visible_accelerators(), has_tensorflow, REPO)
    print(what, flush=True)
    for command in commands:
        if args.dry_run:
            print(" ".join([sys.executable, "-m", "pip", *command]))
        else:
            subprocess.run([sys.executable, "-m", "pip", *command], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
