"""An output folder is one unit (pbe.rundir): a kill after any write of `pbe train | attack | defend |
erase` leaves the old unit or the new one, never a mix; two writers on one --out never interleave."""
import json
import shutil
import subprocess
import sys

import pytest
from pbe import rundir
from pbe.defenses import staged_progress
from pbe.utils import FAULT_EXIT, PBEError

COMMON = ["--dataset", "digits", "--no-progress"]


def pbe(*args, env=None):
    import os
    return subprocess.run([sys.executable, "-m", "pbe.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


DRIVER = """
import json, os, sys
import torch
from pbe import data, plots, utils
from pbe.cli import main
torch.set_num_threads(1)
# what the runs import on first use, imported once here instead of in every child: torch's compiler stack
# (its optimizers' first construction), scikit-learn (the digits) and matplotlib (the figures)
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
data.load("digits", split="test")
plots._plt()
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: torch is already imported, so each run costs its compute only
        os.environ[utils.FAULT_ENV] = str(job["fault"])
        utils._writes = 0
        fd = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.dup2(fd, 1)
        os._exit(main(job["argv"]))
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.fixture(scope="module")
def driver():
    """One single-threaded Python that forks a child per killed run (forking this multi-threaded
    pytest process could deadlock OpenMP); the children inherit its imports, so each costs its compute."""
    import os
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield proc
    proc.stdin.close()
    proc.wait(60)


def pbe_killed(driver, *args, fault: int, errors):
    """The command line in a fork of the driver, killed after its `fault`-th write: its exit code."""
    driver.stdin.write(json.dumps({"argv": list(args), "fault": fault, "stderr": str(errors)}) + "\n")
    driver.stdin.flush()
    return int(driver.stdout.readline())


def files(folder):
    return {p.relative_to(folder).as_posix(): rundir.sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    out = tmp_path_factory.mktemp("units") / "attack"
    r = pbe("attack", "--attack", "badnets", "--param", "size=2", "--recipe", "tiny", "--epochs", "2",
            "--out", str(out), *COMMON)
    assert r.returncode == 0, r.stderr
    return out


def commands(attacked):
    model = ["--model", str(attacked)]
    return {
        "train": lambda seed: ["train", "--recipe", "tiny", "--epochs", "1", "--seed", seed, *COMMON],
        "attack": lambda seed: ["attack", "--attack", "blend", "--recipe", "tiny", "--epochs", "1", "--seed", seed,
                                *COMMON],
        "defend": lambda seed: ["defend", "--defense", "ft", "--param", "epochs=1", *model,
                                "--poison-from", str(attacked), "--seed", seed, *COMMON],
        "erase": lambda seed: ["erase", "--schedule", "fast", *model, "--poison-from", str(attacked),
                               "--seed", seed, *COMMON],
    }


@pytest.mark.parametrize("command", ["train", "attack", "defend", "erase"])
def test_kill_after_every_write_leaves_the_old_or_the_new_unit(command, attacked, driver, tmp_path):
    make = commands(attacked)[command]
    out = tmp_path / "out"
    r = pbe(*make("0"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    old = files(out)
    outcomes = []
    for n in range(1, 40):
        rc = pbe_killed(driver, *make("1"), "--out", str(out), "--overwrite", fault=n, errors=tmp_path / "stderr")
        if rc == 0:
            break
        assert rc == FAULT_EXIT, (rc, (tmp_path / "stderr").read_text())
        rundir.recover(out)  # what the next command on this --out does first
        now = files(out)
        if now == old:
            outcomes.append("old")
        else:
            manifest = rundir.verify(out)
            assert manifest is not None and manifest["run"]["seed"] == 1, (n, sorted(now))
            outcomes.append("new")
        assert outcomes == sorted(outcomes, key=["old", "new"].index)  # never back from new to old
    else:
        pytest.fail("the command never finished")
    assert n >= 5 and "old" in outcomes  # it was killed at every write up to its end
    assert rundir.verify(out)["run"]["seed"] == 1
    assert not rundir.staging(out).exists()


def test_a_changed_file_is_refused_and_a_second_writer_waits(attacked, tmp_path):
    out = tmp_path / "copy"
    r = pbe("defend", "--defense", "ft", "--param", "epochs=1", "--model", str(attacked),
            "--poison-from", str(attacked), "--out", str(out), *COMMON)
    assert r.returncode == 0, r.stderr
    from pbe import checkpoint
    checkpoint.load(out)
    side = json.loads((out / "model.json").read_text())
    (out / "model.json").write_text(json.dumps({**side, "seed": 7}))
    with pytest.raises(PBEError, match="mixes two runs"):
        checkpoint.load(out)
    with rundir.locked(out):
        r = pbe("defend", "--defense", "ft", "--param", "epochs=1", "--model", str(attacked),
                "--poison-from", str(attacked), "--out", str(out), "--overwrite", *COMMON)
    assert r.returncode == 2 and "another pbe command is writing" in r.stderr and "Traceback" not in r.stderr


def strip_run(attacked, driver, tmp_path):
    """`run(*extra, out, fault=0)`: STRIP (4 overlays, a 2-epoch retrain) through `pbe defend`, killed after
    its `fault`-th write when given; its exit code."""
    args = ["defend", "--defense", "strip", "--param", "n=4", "--param", "retrain=tiny", "--param", "retrain_epochs=2",
            "--model", str(attacked), "--poison-from", str(attacked), *COMMON]

    def run(*extra, out, fault=0):
        return pbe_killed(driver, *args, *extra, "--out", str(out), fault=fault, errors=tmp_path / "stderr")
    return run


@pytest.fixture(scope="module")
def strip_whole(attacked, driver, tmp_path_factory):
    """A STRIP run never killed (the reference the resumed runs must match)."""
    tmp = tmp_path_factory.mktemp("whole")
    assert strip_run(attacked, driver, tmp)(out=tmp / "whole") == 0, (tmp / "stderr").read_text()
    return tmp / "whole"


def test_a_killed_defence_resumes_its_staged_state(attacked, driver, strip_whole, tmp_path):
    """`pbe defend` killed in the middle of a defence (STRIP's scoring batches, its retrain's epochs) takes
    up the state it staged when run again, with --overwrite as the reproduction scripts run it: the report
    says where, the model is the one of a run never killed, and the state is gone from the unit. A state
    staged by another run is refused without --overwrite and discarded with it."""
    run, whole = strip_run(attacked, driver, tmp_path), strip_whole
    full = json.loads((whole / "report.json").read_text())
    n, overlays, batch = full["train_size"], 4, 256
    # writes 1-2: the staged run's and the defence call's identities; 3-8: STRIP's 6 batches; 9-10: the retrain
    for fault, stage in ((6, 1), (9, "retrain")):
        cut = tmp_path / f"cut{fault}"
        assert run("--overwrite", out=cut, fault=fault) == FAULT_EXIT
        # what a rerun will take up, as the grid's estimates read it: 4 of 6 batches; all 6 and 1 of 2 epochs
        progress = staged_progress(rundir.staging(cut) / "state", defense="strip", seed=0)
        if stage == 1:
            assert progress.loops == [{"stage": 1, "epochs_done": 4, "epochs": 6}]
            assert progress.epoch_equivalents == pytest.approx(overlays * min(4 * batch, full["data_size"]) / 3 / n)
        else:
            assert progress.loops == [{"stage": 1, "epochs_done": 6, "epochs": 6},
                                      {"stage": "retrain", "epochs_done": 1, "epochs": 2}]
            assert progress.epoch_equivalents == pytest.approx(full["epoch_equivalents"] - full["kept"] / n)
        assert staged_progress(rundir.staging(cut) / "state", seed=1) is None  # another call's states
        assert run("--overwrite", out=cut) == 0, (tmp_path / "stderr").read_text()
        report = json.loads((cut / "report.json").read_text())
        assert stage in [r["stage"] for r in report["resumed"]], report["resumed"]
        assert "resumed" not in json.loads((whole / "report.json").read_text())
        assert rundir.sha256(cut / "model.safetensors") == rundir.sha256(whole / "model.safetensors")
        assert not (cut / "state").exists() and not (cut / rundir.STAGED).exists()
    other = tmp_path / "other"
    assert run(out=other, fault=6) == FAULT_EXIT
    assert run("--seed", "1", out=other) == 2 and "--overwrite" in (tmp_path / "stderr").read_text()
    assert run("--seed", "1", "--overwrite", out=other) == 0
    assert "resumed" not in json.loads((other / "report.json").read_text())


def test_a_staged_run_resumes_only_with_its_own_code(tmp_path, monkeypatch):
    """The staging folder is kept for the same run by the same code (a new commit that changes no code
    keeps it); after a code change it is refused, or discarded with --overwrite."""
    out = tmp_path / "out"
    stage = rundir.stage_for(out, {"seed": 0, "toolkit_version": "0.1.0+gaaaa"}, replace=False)
    (stage / "state").mkdir()
    assert rundir.stage_for(out, {"seed": 0, "toolkit_version": "0.1.0+gbbbb"}, replace=True) == stage
    assert (stage / "state").is_dir()
    monkeypatch.setattr(rundir, "code_fingerprint", lambda: "other code")
    with pytest.raises(PBEError, match="--overwrite"):
        rundir.stage_for(out, {"seed": 0}, replace=False)
    rundir.stage_for(out, {"seed": 0}, replace=True)
    assert not (stage / "state").exists()


def test_a_staged_state_carried_to_a_fresh_checkout_resumes(attacked, driver, strip_whole, tmp_path, monkeypatch):
    """experiments/carry.py: a killed cell's staging folder saved to the store, the run folders lost (a fresh
    checkout), restored: the rerun resumes it and ends as a run never killed; once finished, a save drops
    the copy. A restore never replaces a staging folder or a finished run that is there."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))
    import carry
    runs, store = tmp_path / "runs", tmp_path / "store"
    run, out = strip_run(attacked, driver, tmp_path), runs / "cell" / "strip_seed0"
    assert run("--overwrite", out=out, fault=6) == FAULT_EXIT
    assert carry.save(runs, store) == [store / "cell" / "strip_seed0"]
    staged = files(rundir.staging(out))
    shutil.rmtree(runs)
    assert carry.restore(runs, store) == [rundir.staging(out)] and files(rundir.staging(out)) == staged
    assert carry.restore(runs, store) == []  # there already
    assert staged_progress(rundir.staging(out) / "state").loops == [{"stage": 1, "epochs_done": 4, "epochs": 6}]
    with monkeypatch.context() as m:  # states of other code: a rerun starts over, so nothing counts as done
        m.setattr("pbe.defenses.base.code_fingerprint", lambda: "other code")
        assert staged_progress(rundir.staging(out) / "state") is None
    assert run("--overwrite", out=out) == 0, (tmp_path / "stderr").read_text()
    assert 1 in [r["stage"] for r in json.loads((out / "report.json").read_text())["resumed"]]
    assert rundir.sha256(out / "model.safetensors") == rundir.sha256(strip_whole / "model.safetensors")
    assert carry.restore(runs, store) == [] and not rundir.staging(out).exists()  # the cell finished here
    assert carry.save(runs, store) == [] and not (store / "cell" / "strip_seed0").exists()


def test_rows_made_in_another_checkout_join_the_table_without_reordering_it(tmp_path, monkeypatch):
    """carry.add_missing: only the rows whose cell the table lacks are added; the rows it has keep their
    place and content."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))
    import carry

    from pbe.results import REQUIRED, ResultsTable

    def row(seed, acc):
        return {**{k: None for k in REQUIRED}, "dataset": "toy", "defense": "ft", "seed": seed, "acc": acc,
                "asr": 0.0, "ra": 1.0, "wall_s": 1.0, "command": "x"}
    mine = ResultsTable(tmp_path / "t", "T", "x")
    mine.add(row(1, 0.5))
    mine.add(row(0, 0.5))
    other = [row(0, 0.9), row(1, 0.9), row(2, 0.9)]  # the same cells made elsewhere, and one more
    assert carry.add_missing(mine, other) == [other[2]]
    kept = ResultsTable(tmp_path / "t", "T", "x").rows
    assert [(r["seed"], r["acc"]) for r in kept] == [(1, 0.5), (0, 0.5), (2, 0.9)]


def test_the_version_names_the_commit_in_a_checkout_and_in_a_worktree_and_says_dirty(tmp_path):
    """A row records the commit of the code that made it: from a checkout's top and from a `git worktree`'s
    (whose .git is a file), with ".dirty" once pbe/ differs from it, and nothing outside a checkout."""
    from pbe.utils import checkout_suffix

    def git(*args, cwd=tmp_path / "repo"):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()

    (tmp_path / "repo" / "pbe").mkdir(parents=True)
    (tmp_path / "repo" / "pbe" / "a.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", "pbe")
    git("commit", "-qm", "c")
    head = git("rev-parse", "HEAD")
    git("worktree", "add", "-q", "--detach", str(tmp_path / "tree"), "HEAD")
    assert (tmp_path / "tree" / ".git").is_file()
    for top in (tmp_path / "repo", tmp_path / "tree"):
        assert checkout_suffix(top) == f"+g{head[:10]}"
        (top / "pbe" / "a.py").write_text("x = 2\n")
        assert checkout_suffix(top) == f"+g{head[:10]}.dirty"
    assert checkout_suffix(tmp_path / "repo" / "pbe") == ""  # a folder inside a checkout is not its top
    assert checkout_suffix(tmp_path) == ""
