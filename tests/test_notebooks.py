"""The analysis notebooks run, in their small mode (SMALL=1: the built-in digits), through a real
Jupyter kernel (nbclient), as a reader would run them."""
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["01_connection", "02_pbe_progress", "03_defences"])
def test_notebook_runs_in_small_mode(name, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("SMALL", "1")
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    first = book.cells[0]
    assert first.cell_type == "markdown" and "Runtime" in first.source  # says what it shows and how long
    nbclient.NotebookClient(book, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # every notebook shows a figure
    assert not list(tmp_path.iterdir())  # and leaves nothing behind in the folder it ran in
