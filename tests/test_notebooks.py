"""The Colab notebooks run the way Colab runs them: copied into a fresh folder outside the
checkout, in a kernel of a fresh Python environment whose install cell installs the
package from the checkout's path (scripts/install_for_runtime.py), in smoke mode
(Fashion-MNIST, seconds); then again in a new kernel, as after a runtime restart. Each
time the runs' progress lines show and the notebook ends with its figure."""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.runs import ROOT

NOTEBOOKS = sorted((ROOT / "experiments/notebooks").glob("*.ipynb"))


def test_the_notebooks_are_the_two_asked_for():
    assert [p.name for p in NOTEBOOKS] == ["linear_scaling_ablation.ipynb", "warmup_curves.ipynb"]


@pytest.fixture(scope="module")
def fresh_kernel(tmp_path_factory):
    """A venv of its own (the package not installed in it) that sees the tests' installed
    dependencies, as a Colab runtime has its own stack; a Jupyter kernel spec for it."""
    base = tmp_path_factory.mktemp("colab")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A plain path: the dependencies, without the .pth hooks (the checkout's editable install).
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    kernels = base / "jupyter" / "kernels" / "colab"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "colab-like",
                "language": "python",
            }
        )
    )
    return {"jupyter": base / "jupyter", "installed": False}


def execute(path: Path, folder: Path, runs: Path) -> str:
    """Run a notebook in a new kernel, in `folder`; the text of its outputs."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if "parameters" in cell.metadata.get("tags", []):
            cell.source += f"\nROOT = {str(runs)!r}\n"
    NotebookClient(
        notebook, timeout=600, kernel_name="colab", resources={"metadata": {"path": str(folder)}}
    ).execute()  # raises CellExecutionError on any error
    images = [
        o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert images, "the notebook draws its figure"
    return "".join(
        o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_runs_as_colab_runs_it_and_again_after_a_restart(
    path, tmp_path, monkeypatch, fashion_mnist_dir, fresh_kernel
):
    notebook = nbformat.read(path, as_version=4)
    assert sum("parameters" in c.metadata.get("tags", []) for c in notebook.cells) == 1
    assert 'REPO_URL = ""' in notebook.cells[1].source  # one variable, no invented address
    folder = tmp_path / "content"  # Colab's working folder: no checkout around it
    folder.mkdir()
    (folder / path.name).write_bytes(path.read_bytes())
    monkeypatch.setenv("JUPYTER_PATH", str(fresh_kernel["jupyter"]))
    monkeypatch.setenv("LARGEBATCH_REPO_URL", str(ROOT))
    monkeypatch.setenv("LARGEBATCH_SMOKE", "1")
    monkeypatch.setenv("TFDS_DATA_DIR", fashion_mnist_dir)
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    runs = tmp_path / "runs"
    for session in ("first", "after a restart"):
        if session != "first":  # the runtime restarted mid-sweep: its last run unfinished
            shutil.rmtree(max(runs.iterdir(), key=lambda p: p.stat().st_mtime))
        text = execute(folder / path.name, folder, runs)
        installs = text.count("installing largebatch_jax for CPU only")
        assert installs == (not fresh_kernel["installed"]), text[-3000:]  # then it is there
        fresh_kernel["installed"] = True
        steps = [x for x in text.splitlines() if "reporting.py" in x and "] step " in x]
        assert steps, (session, text[-3000:])  # progress lines, as main.py prints them
        assert "top-1 error" in text, (session, text[-3000:])
