"""experiments/reproduce.py: configs, the grid's skipping and cost estimate, and the Ray executor
surviving a worker killed mid-cell (a local Ray instance; the digits table, seconds per cell)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pbe import metrics

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


def _reproduce(tmp_path, config: str, *args, env_extra=None, popen=False):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config)
    env = {**os.environ, "PBE_RESULTS": str(tmp_path / "results"), "PBE_RUNS": str(tmp_path / "runs"),
           "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, str(EXPERIMENTS / "reproduce.py"), str(cfg), "--no-progress", *args]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_config_errors_name_the_problem_and_the_fix(tmp_path):
    """A bad config is refused by name, with the fix; checked in this process, and once through the command
    line (its exit code and message)."""
    sys.path.insert(0, str(EXPERIMENTS))
    import grid

    from pbe.utils import PBEError
    cfg = tmp_path / "config.yaml"
    for text, message in (("script: digits\nattack: [badnets]\n", r"unknown keys \['attack'\].*attacks"),
                          ("script: nope\n", "unknown table script 'nope'.*pbe_cifar10"),
                          ("script: digits\nresources: {num_gpus: -1}\n", "resources must map num_cpus / num_gpus"),
                          ("attacks: [badnets]\n", "'script' key")):
        cfg.write_text(text)
        with pytest.raises(PBEError, match=message):
            grid.load_config(cfg)
    bad = _reproduce(tmp_path, "script: digits\nattack: [badnets]\n", "--dry-run")
    assert bad.returncode == 2 and bad.stderr.startswith("reproduce.py: error: ")
    assert "unknown keys ['attack']" in bad.stderr and len(bad.stderr.splitlines()) == 1  # one line, no traceback
    with pytest.raises(PBEError, match="not found.*configs"):
        grid.load_config(tmp_path / "none.yaml")


def test_committed_configs_list_their_cells(tmp_path):
    """Every committed config loads and its dry run lists cells with a cost, writing nothing."""
    configs = sorted((EXPERIMENTS / "configs").glob("*.yaml"))
    env = {**os.environ, "PBE_RESULTS": str(tmp_path / "results"), "PBE_RUNS": str(tmp_path / "runs")}
    out = subprocess.run([sys.executable, str(EXPERIMENTS / "reproduce.py"), *map(str, configs), "--dry-run"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(" cells, ") == len(configs) >= 5 and "epoch-equivalents" in out.stdout
    assert not (tmp_path / "results").exists() and not (tmp_path / "runs").exists()


def _ray_workers_mid_cell() -> list[int]:
    """Ray worker processes running a cell whose command (`pbe ...`) is running."""
    procs = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            procs[int(p.name)] = (cmd, ppid)
    return [pid for pid, (cmd, _) in procs.items() if cmd.startswith("ray::run_one")
            and any(c[1] == pid and "pbe" in c[0] for c in procs.values())]


DIGITS_FT = "script: digits\nattacks: [badnets]\ndefenses: [ft]\nseeds: [0]\n"


@pytest.fixture(scope="module")
def digits_ft(tmp_path_factory):
    """The digits table's FT cell (BadNets, seed 0) made once by the local executor: its results and runs
    folders, which each test copies (`copy_of`) before it adds to them or alters them."""
    base = tmp_path_factory.mktemp("digits_ft")
    made = _reproduce(base, DIGITS_FT)
    assert made.returncode == 0, made.stderr[-3000:]
    return base


def copy_of(made: Path, tmp_path: Path) -> None:
    for folder in ("results", "runs"):
        shutil.copytree(made / folder, tmp_path / folder)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds and kills Ray workers through /proc")
def test_ray_executor_survives_a_worker_killed_mid_cell_and_local_skips_finished_cells(digits_ft, tmp_path):
    """Seed 0's cell has a row (the fixture's), seed 1's is run by a Ray worker that is killed mid-cell."""
    pytest.importorskip("ray")
    copy_of(digits_ft, tmp_path)
    config = DIGITS_FT.replace("[0]", "[0, 1]")
    proc = _reproduce(tmp_path, config, "--executor", "ray", popen=True)
    killed, deadline = None, time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if killed is None:
            workers = _ray_workers_mid_cell()
            if workers:
                killed = workers[0]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert killed is not None, "no Ray worker was seen mid-cell"
    rows = json.loads((tmp_path / "results" / "digits.json").read_text())
    assert sorted(r["seed"] for r in rows) == [0, 1]  # each cell once: none lost, none duplicated
    assert all(r["defense"] == "ft" and r["asr_before"] > 0.9 for r in rows)
    # the local executor: the finished cells are skipped, a new defence of the same models runs
    again = _reproduce(tmp_path, config.replace("[ft]", "[ft, ss]"), "--dry-run")
    assert "4 cells, 2 done, 2 to run" in again.stdout, again.stdout
    local = _reproduce(tmp_path, config.replace("[ft]", "[ft, ss]").replace("[0, 1]", "[0]"))
    assert local.returncode == 0, local.stderr[-3000:]
    rows = json.loads((tmp_path / "results" / "digits.json").read_text())
    assert sorted((r["defense"], r["seed"]) for r in rows) == [("ft", 0), ("ft", 1), ("ss", 0)]
    md = (tmp_path / "results" / "digits.md").read_text()
    assert md.count("| badnets |") == 3 and (tmp_path / "results" / "digits.csv").exists()


def test_verify_reruns_a_committed_row_and_names_the_fields_that_differ(digits_ft, tmp_path):
    """`--verify` reruns a cell that has a row in a temporary folder and compares: here the committed row's
    ASR was altered, so exactly that field is named (the rerun is otherwise identical) and it exits 1,
    leaving the committed table as it was."""
    copy_of(digits_ft, tmp_path)
    table = tmp_path / "results" / "digits.json"
    rows = json.loads(table.read_text())
    rows[0]["asr"] = round(rows[0]["asr"] + 0.25, 6)
    table.write_text(json.dumps(rows))
    check = _reproduce(tmp_path, DIGITS_FT, "--verify")
    assert check.returncode == 1, check.stderr[-3000:]
    assert "1 fields differ: asr:" in check.stdout and "0 of 1 rows reproduced identically" in check.stdout
    assert json.loads(table.read_text()) == rows and not list((tmp_path / "runs").glob("*verify*"))


def test_local_executor_skips_a_cell_another_process_made_meanwhile(tmp_path, monkeypatch):
    """Two processes on one table (e.g. two ``--only`` halves): the table is re-read before each cell, so a
    cell whose row appeared on disk after the run started is not made twice; the others still run."""
    sys.path.insert(0, str(EXPERIMENTS))
    import grid

    from pbe.results import REQUIRED, ResultsTable

    def row(seed):
        return {**{k: None for k in REQUIRED}, "dataset": "toy", "defense": "ft", "seed": seed, "acc": 1.0,
                "asr": 0.0, "ra": 1.0, "wall_s": 1.0, "epoch_equivalents": 1.0, "command": f"made {seed}"}

    path = tmp_path / "toy"
    mine, other = ResultsTable(path, "toy", "x"), ResultsTable(path, "toy", "x")
    cells = [grid.Cell("digits", f"cell {s}", {"dataset": "toy", "defense": "ft", "seed": s}, {"seed": s}, 1.0)
             for s in range(3)]
    ran = []

    def run_one(script, params):  # while cell 0 runs here, another process makes cell 1
        ran.append(params["seed"])
        if params["seed"] == 0:
            other.add({**row(1), "command": "made elsewhere"})
        return row(params["seed"])

    monkeypatch.setattr(grid, "run_one", run_one)
    made = grid._run_local(mine, grid.pending(mine, cells), progress=False)
    assert ran == [0, 2] and [r["seed"] for r in made] == [0, 2]
    rows = ResultsTable(path, "toy", "x").rows
    assert sorted(r["seed"] for r in rows) == [0, 1, 2]
    assert next(r for r in rows if r["seed"] == 1)["command"] == "made elsewhere"


def test_a_dry_run_leaves_out_what_staged_states_have_done(tmp_path, monkeypatch, capsys):
    """A script's ``staged(**params)`` (the epoch-equivalents a cell's staged state has done, which its rerun
    takes up) is taken off that cell's estimate and the total, never below zero; the header counts the cells
    resuming; a script without the hook leaves the estimates whole."""
    sys.path.insert(0, str(EXPERIMENTS))
    import types

    import grid

    from pbe.results import ResultsTable
    cells = [grid.Cell("toy", f"cell {s}", {"seed": s}, {"seed": s}, 5.0) for s in range(3)]
    toy = types.SimpleNamespace(CONFIG={}, results_table=lambda cfg: ResultsTable(tmp_path / "toy", "toy", "x"),
                                cells=lambda cfg: cells, staged=lambda seed: {0: 2.0, 1: 0.0, 2: 9.0}[seed])
    monkeypatch.setattr(grid, "module", lambda script: toy)
    assert grid.execute({"script": "toy"}, dry_run=True) == []
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("toy: 3 cells, 0 done, 3 to run (2 resuming from a staged state), about 8.0 "
                             "epoch-equivalents left")
    assert out[1:] == ["  cell 0: ~3.0 epoch-eq. (2.0 done in its staged state)", "  cell 1: ~5.0 epoch-eq.",
                       "  cell 2: ~0.0 epoch-eq. (5.0 done in its staged state)"]
    del toy.staged
    grid.execute({"script": "toy"}, dry_run=True)
    assert "about 15.0 epoch-equivalents left" in capsys.readouterr().out


def test_published_budget_rows_are_cells_of_their_own():
    """A defence at its published budget is another cell than the same defence at the CPU budget (same zoo
    model, defence and seed): its rows go to a table of their own, so neither run skips the other."""
    sys.path.insert(0, str(EXPERIMENTS))
    import defenses_cifar10

    cpu, paper = (defenses_cifar10.results_table({"paper_budget": p}) for p in (False, True))
    assert cpu.json_path.name == "defenses_cifar10.json" and paper.json_path.name == "defenses_cifar10_paper.json"


def test_defences_summary_keeps_models_apart_and_splits_settings():
    """The defences summary: two zoo models of one attack (SIG clean-label and poison-label) are two columns,
    means are taken over the models every defence has run, split by setting, with BackdoorBench's own mean
    over the same attacks in a column of its own; the figure adds a panel of the means."""
    sys.path.insert(0, str(EXPERIMENTS))
    import defenses_cifar10 as dc

    def row(zoo, defense, acc, asr):
        return {"zoo": zoo, "attack": "sig" if "sig" in zoo else "badnets", "all_to_all": False, "defense": defense,
                "setting": dc.setting_of(defense), "acc_before": 0.85, "asr_before": 1.0, "acc": acc, "asr": asr,
                "ra": 0.5, "der": metrics.der(0.85, 1.0, acc, asr), "wall_s": 10.0, "epoch_equivalents": 1.0,
                "detection": None, "rate": 0.1, "recipe": "cpu"}
    rows = [row("cifar10/sig", "ft", 0.84, 0.2), row("cifar10/sig_poison_label", "ft", 0.83, 0.6),
            row("cifar10/sig", "pbe", 0.80, 0.1), row("cifar10/sig_poison_label", "pbe", 0.82, 0.3),
            row("cifar10/badnets", "ft", 0.84, 1.0)]  # badnets has no PBE row: not in the means
    common, present = dc.common_models(rows)
    assert common == ["sig", "sig_poison_label"] and present == ["ft", "pbe"]
    assert abs(dc.means(rows, "pbe", common)["asr"] - 0.2) < 1e-9
    md = dc.summary_markdown(rows)
    assert "| defense | setting | badnets | sig | sig_poison_label |" in md
    clean_extra, no_clean = md.split("### clean-extra")[1].split("### no-clean")
    bb = [r for r in dc.backdoorbench()["rows"] if r["attack"] == "sig" and r["defense"] == "ft"][0]
    assert "| ft | 83.50 | 40.00 |" in clean_extra and f"{bb['acc']:.1f} / {bb['asr']:.1f} (1) |" in clean_extra
    assert "| pbe | 81.00 | 20.00 |" in no_clean.split("## ")[0] and "pbe" not in clean_extra
    # ranked on mean DER across both settings: PBE (0.880) first, FT (0.792) second
    assert "| 0.880 | – | – | 10 | 1.00 | 1 | – |" in no_clean
    assert "| 0.792 | – | – | 10 | 1.00 | 2 |" in clean_extra
    head = dc.head_to_head_markdown(rows)  # FT against PBE on both SIG models; badnets has no PBE row
    assert "| ft | clean-extra | 2 | 83.50 / 81.00 | 40.00 / 20.00 | 1.00 / 1.00 | 2 of 2 | 0 of 2 |" in head
    assert "| pbe |" not in head and dc.head_to_head_markdown(rows[:2] + rows[4:]) == ""
    fig = dc.DefencesTable.figure(type("T", (), {"rows": rows})())
    assert len(fig.axes) == 3 and len(fig.axes[2].collections) == 2 + 2  # two means, two setting markers


def test_published_budget_estimate_scales_with_what_the_cpu_budget_cuts():
    """A published-budget cell's cost estimate: the CPU row's cost times the ratio of the class defaults'
    passes / iterations to the CPU budget's; STRIP adds one forward pass per overlay; uncut defences as is."""
    sys.path.insert(0, str(EXPERIMENTS))
    import defenses_cifar10 as dc
    from pbe import defenses

    for name in ("ft", "anp", "sau", "abl"):
        cut, published = dc.cpu_budget(name, "cpu"), defenses.create(name).params
        ratio = sum(published[k] for k in cut) / sum(cut.values())
        assert ratio > 1 and abs(dc.published_estimate(2.0, name, "cpu") - 2.0 * ratio) < 1e-9
    strip = defenses.create("strip").params["n"] - dc.cpu_budget("strip", "cpu")["n"]
    assert strip > 0 and abs(dc.published_estimate(17.0, "strip", "cpu") - (17.0 + strip / 3)) < 1e-9
    for name in ("ibau", "pbe", "ac"):
        assert dc.published_estimate(3.0, name, "cpu") == 3.0


def test_published_budget_rows_are_set_beside_their_cpu_rows():
    """The published-budget table shows the cut's effect: each of its rows beside the CPU row of the same zoo
    model and defence, with the parameters that differ and the change after; a row without a CPU
    counterpart (or a CPU row of another model) is left out, and nothing is printed without a pair."""
    sys.path.insert(0, str(EXPERIMENTS))
    import defenses_cifar10 as dc

    def row(zoo, budget, epochs, acc, asr, ee):
        return {"zoo": zoo, "defense": "ft", "budget": budget, "acc": acc, "asr": asr, "epoch_equivalents": ee,
                "params": {"epochs": epochs, "lr": 0.01}}
    cpu = [row("cifar10/badnets", "cpu", 20, 0.8341, 0.9998, 1.0), row("cifar10/wanet", "cpu", 20, 0.8, 0.5, 1.0)]
    paper = [row("cifar10/badnets", "paper", 100, 0.8202, 0.9432, 5.0), row("cifar10/blend", "paper", 100, 0.8, 1, 5)]
    md = dc.budget_effect_markdown(paper, cpu)
    assert ("| cifar10/badnets | ft | epochs 20 -> 100 | 83.41 / 99.98 (1.00) | 82.02 / 94.32 (5.00) | "
            "-1.39 / -5.66 |") in md
    assert "blend" not in md and "wanet" not in md and dc.budget_effect_markdown(paper[1:], cpu) == ""


def test_defence_rows_made_with_another_budget_are_redone():
    """A CPU-budget row whose parameters differ from what its cell would run now (ABL's unlearning was cut
    to 3 epochs before it kept its default) is stale, so the driver reruns it; a row at the current
    budget, a variant's row with its fixed parameter, and a published-budget row are not."""
    sys.path.insert(0, str(EXPERIMENTS))
    import defenses_cifar10 as dc
    from pbe import defenses

    def row(defense, budget="cpu", **params):
        name, variant = dc.registered(defense)
        now = {**defenses.create(name).params, **dc.cpu_budget(name, "cpu"), **variant, **params}
        return {"defense": defense, "recipe": "cpu", "budget": budget, "params": json.loads(json.dumps(now))}

    assert dc.cpu_budget("abl", "cpu") == {"tuning_epochs": 3, "finetuning_epochs": 9}
    assert not dc.stale(row("abl")) and dc.stale(row("abl", unlearning_epochs=3))
    assert not dc.stale(row("nad")) and dc.stale(row("ft", epochs=5)) and not dc.stale(row("pbe_lr1e-3"))
    assert dc.stale(row("pbe_lr1e-3", lr=0.01)) and not dc.stale(row("abl", "paper", unlearning_epochs=3))
    # the summary names the stale rows it still counts
    full = {"zoo": "cifar10/badnets", "attack": "badnets", "all_to_all": False, "acc_before": 0.85, "asr_before": 1.0,
            "acc": 0.8, "asr": 0.5, "ra": 0.5, "der": 0.7, "wall_s": 1.0, "epoch_equivalents": 1.0, "detection": None,
            "rate": 0.1}
    rows = [{**full, **row(d, **extra), "setting": dc.setting_of(d)} for d, extra in
            (("abl", {"unlearning_epochs": 3}), ("pbe", {}))]
    redo = dc.summary_by_model(rows).split("**Being redone:** ")[1].split("\n")[0]
    assert redo.startswith("`cifar10/badnets` abl (") and "pbe" not in redo
    assert "Being redone" not in dc.summary_by_model(rows[1:])
    # and the rows a killed run resumed
    assert "Resumed after a kill" not in dc.summary_by_model(rows)
    rows[1]["resumed"] = [{"stage": 1, "epochs_done": 2, "epochs": 5}]
    assert dc.summary_by_model(rows).split("**Resumed after a kill:** ")[1].startswith("`cifar10/badnets` pbe (")


def test_pbe_table_means_per_set_keep_one_failure_apart():
    """The PBE table's summary: the default per zoo set with its means per attack, architecture and rate; per zoo
    set and schedule, the models meeting the goal and the means, also without the model of the highest ASR; a
    row told the target is left out, a rerun replaces its model's; the default's means leave out a row an earlier
    default made, and name its model."""
    sys.path.insert(0, str(EXPERIMENTS))
    import pbe_cifar10 as pc

    from pbe.defenses.pbe import PBE
    from pbe.utils import json_safe
    now = {"schedule": json_safe(PBE().resolved()["schedule"])}  # made by the current default

    def row(zoo, zoo_set, asr, acc=0.83, ee=2.8, model="preact_resnet18(width=16)", rate=0.1, **extra):
        return {"zoo": zoo, "zoo_set": zoo_set, "defense": "pbe", "schedule": "targeted", "acc_before": 0.85,
                "acc": acc, "asr": asr, "epoch_equivalents": ee, "model": model, "attack": "badnets", "rate": rate,
                "all_to_all": False, "tracker": [], "params": now, **extra}
    rows = [row("a", "generalisation", 0.5), row("b", "generalisation", 0.02, model="lenet(width=6)", rate=0.01),
            row("c", "generalisation", 0.04),
            row("c", "generalisation", 0.01, acc=0.80),  # c's rerun: 5 ACC points lost, so not the goal
            row("a", "generalisation", 0.0, given_target=True), row("d", "dev", 0.01, ee=3.5),
            row("e", "dev", 0.5, params={"schedule": {"families": "an earlier default's"}})]
    md = pc.summary_markdown(rows, dataset="none")
    assert "Rows of an earlier default, left out: `e`." in md.split("### dev set")[1]
    gen = next(line for line in md.splitlines() if line.startswith("| generalisation"))
    assert gen == "| generalisation | pbe (targeted) | 3 | 1 of 3 | 3.00 | 17.67 | 2.80 | 1.50 (without `a`) |"
    assert "| dev | pbe (targeted) | 2 | 0 of 2 |" in md and md.count("| dev |") == 1  # 3.5 epoch-eq.: not the goal
    general = md.split("### generalisation set")[1]
    assert "| architecture: lenet | 1 | 1 of 1 | 2.00 | 2.00 | 2.80 |" in general
    assert "| poison rate: 10 % | 2 | 0 of 2 |" in general and "| **all** | 3 | 1 of 3 |" in general
    assert pc.summary_markdown([row(None, None, 0.1)], dataset="none") == ""


def test_defence_figure_shows_current_schedules_dev_models_first(tmp_path):
    """The PBE tables' figure: an earlier default's rows (a schedule PBE no longer has) stay in the table and out
    of the figure; the zoo's dev models come before its generalisation set, whatever the rows' order."""
    sys.path.insert(0, str(EXPERIMENTS))
    from common import DefenceTable

    def row(zoo, zoo_set, defense, schedule, asr):
        return {"zoo": zoo, "zoo_set": zoo_set, "attack": "badnets", "all_to_all": False, "defense": defense,
                "schedule": schedule, "acc_before": 0.85, "asr_before": 1.0, "acc": 0.83, "asr": asr}
    table = DefenceTable(tmp_path / "t", "T", "python make.py")
    table.rows = [row("gen_model", "generalisation", "pbe", "targeted_v2", 0.5),
                  row("gen_model", "generalisation", "pbe", "targeted", 0.02),
                  row("dev_model", "dev", "pbe", "paper", 1.0), row("dev_model", "dev", "aft", "aft", 0.4)]
    fig = table.figure()
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["dev_model", "gen_model"]
    assert sorted(100 * b.get_height() for b in fig.axes[0].patches) == [200, 4000, 10000]  # no targeted_v2 bar
    assert {t.get_text() for t in fig.legends[0].get_texts()} - {"ASR before the defence"} == {
        "pbe (targeted)", "pbe (paper)", "aft"}


def test_committed_tables_are_their_json_rendered():
    """Every committed results table (.md, .csv) is what the committed renderer makes of its JSON: a renderer
    changed without `python experiments/render.py`, or a JSON edited by hand, shows here."""
    sys.path.insert(0, str(EXPERIMENTS))
    import render

    checked = []
    for name, table in sorted(render.tables().items()):
        if not table.rows:
            continue
        for suffix, text in ((".md", table.markdown()), (".csv", table.csv())):
            path = table.json_path.with_suffix(suffix)
            assert path.read_text() == text, f"{path.name} differs from its JSON rendered: run experiments/render.py"
        checked.append(name)
    assert {"defenses_cifar10", "pbe_cifar10", "digits"} <= set(checked)


def test_tracker_score_counts_right_and_wrong_readings_per_moment():
    """tracker_score: one reading per zoo model and moment (the latest row), right when "there" matches ASR above
    the goal; a wrong "gone" is counted apart and named."""
    sys.path.insert(0, str(EXPERIMENTS))
    import tracker_score as ts

    def t(there):
        return {"evidence": "scan", "label": 0, "reach": 0.5, "score": 3.0, "there": there}
    rows = [{"zoo": "a", "zoo_set": "dev", "schedule": "targeted", "tracker": [t(True), t(True)],
             "round_asr": [1.0, 0.9]},
            {"zoo": "a", "zoo_set": "dev", "schedule": "targeted", "tracker": [t(True), t(False)],
             "round_asr": [1.0, 0.5]},  # a's rerun replaces its first row: a wrong "gone"
            {"zoo": "b", "zoo_set": "dev", "schedule": "targeted", "tracker": [t(True), t(False)],
             "round_asr": [0.99, 0.01]},
            {"zoo": "c", "zoo_set": "dev", "schedule": "targeted", "tracker": None}]
    found = ts.readings(rows)
    assert len(found) == 4 and {f["zoo"] for f in found} == {"a", "b"}
    md = ts.score_markdown(found)
    assert "| dev | scan | 0 | 2 | 2 of 2 | 0 | 0 |" in md and "| dev | scan | 1 | 2 | 1 of 2 | 1 | 0 |" in md
    assert "`a` moment 1 (gone, ASR 50.00 %)" in md
    assert "No PBE row" in ts.score_markdown([])


def test_tracker_score_sets_the_drop_estimate_beside_the_measured_drop():
    sys.path.insert(0, str(EXPERIMENTS))
    import tracker_score as ts
    rows = [{"zoo": "a", "zoo_set": "dev", "schedule": "targeted", "acc_before": 0.85, "acc": 0.80,
             "acc_drop_estimate": 0.02}, {"zoo": "b", "zoo_set": "dev", "schedule": "targeted", "acc_before": 0.85,
                                          "acc": 0.84}]
    found = ts.drop_estimates(rows)
    assert found == [{"zoo": "a", "zoo_set": "dev", "estimate": 0.02, "measured": 0.05}]
    md = ts.drop_markdown(found)
    assert "| a | dev | 2.00 | 5.00 | -3.00 |" in md and "Mean absolute error 3.00 points over 1 models" in md


def test_detection_table_breaks_verdicts_down_per_attack_architecture_and_rate():
    sys.path.insert(0, str(EXPERIMENTS))
    import detect as dt

    def row(attack, target, label, model="preact_resnet18(width=16)", rate=0.1, method=dt.METHOD):
        return {"dataset": "cifar10", "zoo_set": "dev", "setting": "test+train", "method": method, "attack": attack,
                "all_to_all": False, "target": target, "label": label, "suspected": label is not None,
                "label_map": None, "model": model, "rate": rate}
    table = dt.results_table()
    table.rows = [row("badnets", 3, 3), row("badnets", 5, 2, model="lenet(width=6)", rate=0.05),
                  row("none", None, None, rate=0.0), row("blend", 1, 1, method="10: an older one")]
    md = table.breakdown()
    assert "| attack: badnets | 2 | 1 of 2 |" in md and "| architecture: lenet | 1 | 0 of 1 |" in md
    assert "| poison rate: clean | 1 | 1 of 1 |" in md and "blend" not in md  # an older method's row is left out


def test_clean_size_table_pivots_defences_by_clean_fraction():
    sys.path.insert(0, str(EXPERIMENTS))
    import clean_size as cs
    rows = [{"zoo": "cifar10/badnets", "defense": "aft", "clean_fraction": f, "acc": 0.8, "asr": a}
            for f, a in ((0.05, 0.01), (0.005, 0.5))]
    md = cs.summary_markdown(rows)
    assert "| zoo | defence | 0.5 % | 5 % |" in md and "| cifar10/badnets | aft | 80.00 / 50.00 | 80.00 / 1.00 |" in md
    assert {c.params["fraction"] for c in cs.cells({**cs.CONFIG, "only": ["nothing"]})} == set()
