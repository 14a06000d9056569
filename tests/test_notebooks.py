"""The notebooks run, in their small mode (SMALL=1: the built-in digits), through a real Jupyter kernel
(nbclient), as a reader would run them; and the saved ones are executed, with outputs a reader can trust."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_connection", "02_pbe_progress", "03_defences", "pbe_walkthrough"]
# an absolute path of the machine that ran a notebook (a venv, a home folder, a scratch folder)
LOCAL_PATH = re.compile(r"(/work/|/home/|/root/|/tmp/|/Users/|/private/|[A-Za-z]:\\)")


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
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


@pytest.mark.parametrize("name", NAMES)
def test_saved_notebook_is_executed_with_clean_outputs(name):
    """What a reader sees on opening it: every code cell run in order, with its outputs; no error, no warning
    and no absolute path of the machine that ran it."""
    book = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    code = [c for c in book["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    assert all(c["outputs"] for c in code)  # every code cell prints or shows something
    outputs = [o for c in code for o in c["outputs"]]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    for o in outputs:
        assert o["output_type"] != "error"
        text = "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
        assert not LOCAL_PATH.search(text), f"{name}: a local path in an output: {text[:200]!r}"
        assert not (o["output_type"] == "stream" and o["name"] == "stderr"), f"{name}: stderr output: {text[:200]!r}"
