import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "pbe_walkthrough.ipynb"


def test_walkthrough_notebook_runs(tmp_path, monkeypatch):
    """Execute the walkthrough's code cells in this process (no kernel: seconds) and check its story: the
    backdoor is planted, PBE erases it, every figure is shown inline and nothing is written to disk."""
    import pbe.plots
    shown = []
    monkeypatch.setattr(pbe.plots, "show", lambda fig: (shown.append(fig), pbe.plots._plt().close(fig)))
    monkeypatch.chdir(tmp_path)
    cells = [''.join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    scope: dict = {}
    for src in cells:
        exec(compile(src, str(NOTEBOOK), "exec"), scope)  # noqa: S102
    report = scope["report"]
    assert report["before"]["asr"] > 0.9 and report["after"]["asr"] < report["before"]["asr"]
    assert report["stopped_early"] == (len(report["rounds"]) < len(scope["DIGITS_SCHEDULE"].fractions))
    assert scope["mon"].top_label == 0  # the kappa monitor points at the Blend target
    assert shown  # the figures are drawn inline ...
    assert not list(tmp_path.iterdir())  # ... not written to the folder it runs in
