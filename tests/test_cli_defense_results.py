import json
import os
import subprocess
import sys

import pytest

from pbe.results import REQUIRED, ResultsTable
from pbe.utils import PBEError


def run_cli(*args, threads: int | None = None):
    """`pbe ARGS` in a subprocess; `threads` pins torch's thread count (a model it trains is then the same
    on every machine with this kind of CPU: see conftest.one_thread)."""
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.run([sys.executable, "-m", "pbe.cli", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def attack_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("blend_run")
    r = run_cli("attack", "--attack", "blend", "--epochs", "12", "--out", str(out), "--no-progress", threads=1)
    assert r.returncode == 0, r.stderr
    return out


def test_a_run_names_its_threads_and_cpu(attack_run):
    """Seeded runs differ in their floats between CPUs (AVX2, AVX-512), so a row names the one it ran on."""
    import torch

    from pbe.utils import available_cpus, cpu_model
    hardware = json.loads((attack_run / "metrics.json").read_text())["hardware"]
    threads = "1 CPU core" if available_cpus() == 1 else f"1 thread on {available_cpus()} CPU cores"
    assert hardware.startswith(f"{threads} of {cpu_model()}, torch "), hardware
    assert cpu_model().endswith(f"({torch.backends.cpu.get_cpu_capability()})")


def test_cli_detect_and_erase_no_clean(attack_run, tmp_path, cli_here):
    r = run_cli("detect", "--model", str(attack_run), "--method", "kappa", "--eps", "0.1", "--probe-size", "300")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("backdoor suspected: adversarial examples point to label 0")
    # an 8x8 digit at L2 norm ~1 (0.12 per pixel): the target is reached from almost every image, other labels
    # from few (at 0.2 every label is reachable and nothing stands out). The training split's 1,437 digits, not
    # the test split's 360: with ~30 held-out images per label the score swung from z 3.2 to 6.2 between models
    # trained on 1 and 2 threads (float order); with 600 it is z 4.6-5.6 on both (p <= 5e-5 against 0.01)
    r = run_cli("detect", "--model", str(attack_run), "--l2-rms", "0.12", "--split", "train", "--images", "600",
                "--out", str(tmp_path / "det"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("backdoor suspected: target label 0"), r.stdout
    found = json.loads((tmp_path / "det" / "detect.json").read_text())
    assert found["label"] == 0 and found["p_value"] < found["alpha"] and len(found["rates"]) == 10
    r = run_cli("erase", "--model", str(attack_run), "--setting", "no-clean", "--poison-from", str(attack_run),
                "--out", str(tmp_path / "default"), "--no-progress")  # the default schedule never wrecks accuracy
    assert r.returncode == 0, r.stderr
    default = json.loads((tmp_path / "default" / "metrics.json").read_text())
    assert default["after"]["acc"] > default["before"]["acc"] - 0.05, default
    report = json.loads((tmp_path / "default" / "report.json").read_text())
    assert default["decisions"]["target"] == report["target"]  # what PBE decided, in the summary
    assert default["decisions"]["scan_z"] == report["scan"]["score"]
    assert len(default["decisions"]["trigger_reach"]) == len(report["rounds"])
    assert default["decisions"]["plan"] == report["plan"]
    assert report["plan"]["distrust"] in ("target", "cluster", "none")
    # the run is named by the schedule it resolved to: a folder made by another version of the default
    # (simulated: its recorded lr changed) is another run, not silently reused
    manifest_path = tmp_path / "default" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["run"]["params"]["schedule"]["fractions"]  # the fields, not only the name
    report = json.loads((tmp_path / "default" / "report.json").read_text())
    assert report["toolkit_version"] == manifest["run"]["toolkit_version"]  # results rows take the run's version
    def faster(run):
        run["params"]["schedule"]["lr"] *= 10
    for field, change in (("params", faster), ("version", lambda run: run.update(toolkit_version="0.0.0+gother"))):
        edited = json.loads(json.dumps(manifest))
        change(edited["run"])  # a folder made by another version of the default, or by other code
        manifest_path.write_text(json.dumps(edited))
        rc, err = cli_here("erase", "--model", attack_run, "--setting", "no-clean", "--poison-from", attack_run,
                           "--out", tmp_path / "default", "--no-progress")
        assert rc == 2 and "holds another run" in err, field
    r = run_cli("erase", "--model", str(attack_run), "--setting", "no-clean", "--poison-from", str(attack_run),
                "--schedule", "fast", "--eps", "0.1", "--out", str(tmp_path / "fast"), "--no-progress")
    assert r.returncode == 0, r.stderr
    tmp_path = tmp_path / "fast"
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "model.json", "report.json", "rounds.png", "adversarial_labels.png"} <= names
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["before"]["asr"] > 0.9 and summary["after"]["asr"] < summary["before"]["asr"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rounds"][0]["detection"]["auc"] is not None and "subset_indices" in report["rounds"][0]


def test_cli_erase_clean_extra_and_user_errors(attack_run, tmp_path, cli_here):
    r = run_cli("erase", "--model", str(attack_run), "--setting", "clean-extra", "--clean-fraction", "0.2",
                "--poison-from", str(attack_run), "--schedule", "paper", "--eps", "0.1", "--out", str(tmp_path),
                "--no-progress")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["defense"] == "aft" and len(report["clean_indices"]) == round(0.2 * 1437)
    assert report["params"]["schedule"] == "paper"
    rc, err = cli_here("erase", "--model", attack_run, "--setting", "clean-extra", "--eps", "0.1",
                       "--out", tmp_path / "z")
    assert rc == 2 and "--schedule paper" in err  # the targeted default has no PGD to set
    rc, err = cli_here("erase", "--model", attack_run, "--out", tmp_path / "x")
    assert rc == 2 and "--poison-from" in err and "Traceback" not in err
    rc, err = cli_here("erase", "--model", attack_run, "--setting", "clean-extra", "--clean-fraction", "2",
                       "--out", tmp_path / "y")
    assert rc == 2 and "--clean-fraction" in err


def test_cli_defend_runs_registered_defences_and_rejects_bad_input(attack_run, tmp_path, cli_here):
    from pbe import checkpoint
    run = str(attack_run)
    r = run_cli("defend", "--defense", "nad", "--model", run, "--poison-from", run, "--clean-fraction", "0.2",
                "--param", "epochs=3", "--param", "teacher_epochs=2", "--out", str(tmp_path / "nad"), "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "nad" / "metrics.json").read_text())
    assert summary["defense"] == "nad" and summary["params"]["epochs"] == 3 and summary["before"]["asr"] > 0.9
    report = json.loads((tmp_path / "nad" / "report.json").read_text())
    assert len(report["clean_indices"]) == round(0.2 * 1437) and report["hardware"] and report["command"]
    purified, meta = checkpoint.load(tmp_path / "nad" / "model")
    original, _ = checkpoint.load(attack_run / "model")
    assert meta["defense"] == "nad" and purified.state_dict().keys() == original.state_dict().keys()
    r = run_cli("defend", "--defense", "strip", "--model", run, "--poison-from", run, "--param", "n=4",
                "--param", "retrain=null", "--out", str(tmp_path / "strip"), "--no-progress")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "strip" / "report.json").read_text())
    assert report["detection"]["flagged"] == len(report["suspected_indices"]) > 0
    rc, err = cli_here("defend", "--defense", "ac", "--model", run, "--out", tmp_path / "x")
    assert rc == 2 and "--poison-from" in err and "Traceback" not in err
    rc, err = cli_here("defend", "--defense", "ft", "--model", run, "--param", "epochz=2", "--out", tmp_path / "y")
    assert rc == 2 and "unknown parameter" in err and "Traceback" not in err


def _row(**kw):
    row = {k: None for k in REQUIRED}
    row.update(dataset="digits", model="m", recipe="tiny", attack="badnets", rate=0.1, target=0, all_to_all=False,
               defense="none", setting=None, seed=0, acc=0.9, asr=1.0, ra=0.0, wall_s=1.0, command="pbe x",
               hardware="cpu", toolkit_version="0")
    row.update(kw)
    return row


def test_results_table_finds_cells_replaces_rows_and_renders(tmp_path):
    t = ResultsTable(tmp_path / "t", "T", "python make.py")
    t.add(_row())
    t.add(_row(seed=1))
    t.add(_row(acc=0.5))  # same cell as the first: replaced
    again = ResultsTable(tmp_path / "t", "T", "python make.py")
    assert len(again.rows) == 2 and again.find(**{k: _row()[k] for k in ("dataset", "seed", "attack")}) is None
    cell = {k: _row()[k] for k in ("dataset", "model", "recipe", "attack", "rate", "target", "all_to_all",
                                   "defense", "setting", "seed")}
    assert again.find(**cell)["acc"] == 0.5
    md = (tmp_path / "t.md").read_text()
    table, details = md.split("<details>")
    assert "python make.py" in table and table.count("| badnets |") == 2
    assert "pbe x" not in table and details.count("`pbe x`") == 2  # commands folded under the table
    assert "| 1 |" in table and "| 2 |" in table and "50.00" in table  # numbered rows, values in %
    import csv
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["#"] for r in rows] == ["1", "2"] and {r["command"] for r in rows} == {"pbe x"}
    assert sorted(r["ACC"] for r in rows) == ["50.00", "90.00"]
    assert not (tmp_path / "t.png").exists()  # the base table draws no figure
    with pytest.raises(PBEError, match="lacks keys"):
        t.add({"dataset": "x"})


def _add_rows(path, attack, n):
    table = ResultsTable(path, "T", "python make.py")  # each process reads the file once, at the start
    for seed in range(n):
        table.add(_row(attack=attack, seed=seed))


def test_results_table_keeps_rows_of_parallel_writers(tmp_path):
    import multiprocessing as mp
    procs = [mp.get_context("spawn").Process(target=_add_rows, args=(tmp_path / "t", f"attack{i}", 10))
             for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    rows = json.loads((tmp_path / "t.json").read_text())
    assert sorted((r["attack"], r["seed"]) for r in rows) == [(f"attack{i}", s) for i in range(3) for s in range(10)]


def test_results_table_subclass_draws_its_figure_and_links_it(tmp_path):
    """A table that draws a figure writes the PNG beside the JSON and embeds it; defence_bars draws one
    bar per (model, defence) and nothing for rows without a before / after."""
    from pbe.plots import defence_bars

    class Bars(ResultsTable):
        def figure(self):
            return defence_bars(self.rows, lambda r: r["defense"])
    t = Bars(tmp_path / "t", "T", "python make.py")
    t.add(_row(defense="pbe", acc_before=0.9, asr_before=1.0, asr=0.02, acc=0.88))
    t.add(_row(defense="ft", acc_before=0.9, asr_before=1.0, asr=0.5, acc=0.89))
    png = tmp_path / "t.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![T](t.png)" in (tmp_path / "t.md").read_text()
    fig = defence_bars(t.rows, lambda r: r["defense"])
    assert len(fig.axes[0].patches) == len(fig.axes[1].patches) == 2
    assert defence_bars([_row()], lambda r: r["defense"]) is None  # no before / after: nothing to draw


def test_defence_figure_stays_readable_and_highlights_one_defence():
    """Many models and defences stay within MAX_FIGURE_IN; the highlighted defence's bars (and only they)
    are hatched and its means marker is larger; crowded means labels neither overlap one another nor
    leave the panel; every model is named once, under the lower panel."""
    from pbe import plots
    names = [f"defence{j}" for j in range(12)]
    rows = [_row(model=f"model{i}", defense=d, acc_before=0.9, asr_before=1.0, asr=0.1 * j / 12, acc=0.85)
            for i in range(8) for j, d in enumerate(names)]
    means = [{"name": d, "group": "clean-extra" if j % 2 else "no-clean", "asr": 0.02 * j, "acc_drop": 0.01 * (j % 3)}
             for j, d in enumerate(names)]  # twelve labels within a few points of each other
    fig = plots.defence_bars(rows, lambda r: r["defense"], model=lambda r: r["model"], means=means,
                             highlight=lambda name: name == "defence3")
    assert fig.get_figwidth() <= plots.MAX_FIGURE_IN
    hatched = [b for b in fig.axes[0].patches if b.get_hatch()]
    assert len(hatched) == 8 == sum(1 for c in fig.axes[0].containers if c.get_label() == "defence3")
    assert all((c.get_label() == "defence3") == bool(c.patches[0].get_hatch()) for c in fig.axes[0].containers)
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == [f"model{i}" for i in range(8)]
    assert not any(t.get_visible() and t.get_text() for t in fig.axes[0].get_xticklabels())
    sizes = [c.get_sizes()[0] for c in fig.axes[2].collections if len(c.get_offsets())]
    assert sizes[3] > max(sizes[:3] + sizes[4:])
    fig.canvas.draw()
    from matplotlib.text import Text
    boxes = [Text.get_window_extent(t) for t in fig.axes[2].texts]  # the words, without the lines to markers
    assert sorted(t.get_text() for t in fig.axes[2].texts) == sorted(names)
    frame = fig.axes[2].get_window_extent()
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
