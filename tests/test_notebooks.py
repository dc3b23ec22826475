"""The Colab notebooks run top to bottom in smoke mode (Fashion-MNIST, seconds)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted(
    (Path(__file__).resolve().parent.parent / "experiments/notebooks").glob("*.ipynb")
)


def test_the_notebooks_are_the_two_asked_for():
    assert [p.name for p in NOTEBOOKS] == ["linear_scaling_ablation.ipynb", "warmup_curves.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(path, tmp_path, monkeypatch, fashion_mnist_dir):
    monkeypatch.setenv("LARGEBATCH_SMOKE", "1")
    monkeypatch.setenv("TFDS_DATA_DIR", fashion_mnist_dir)
    notebook = nbformat.read(path, as_version=4)
    # One parameters cell, and the first cell installs the package.
    assert sum("parameters" in c.metadata.get("tags", []) for c in notebook.cells) == 1
    assert "pip" in notebook.cells[1].source and "install" in notebook.cells[1].source
    # Run where the notebook lives (its install cell finds the checkout at ../..), with
    # the run directories in a temporary folder.
    for cell in notebook.cells:
        if "parameters" in cell.metadata.get("tags", []):
            cell.source += f"\nROOT = {str(tmp_path / 'runs')!r}\n"
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()  # raises CellExecutionError on any error
    outputs = "".join(
        o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "top-1 error" in outputs
    images = [
        o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert images, "the notebook draws its figure"
