"""``pbe demo`` tells a newcomer the truth in plain lines: what was planted, what PBE decided (and whether and why
it stopped early), every column named; ``--json`` prints the machine form alone. One real run (about 7 s at the
demo's default of 1 thread), the rest on copies of its result."""
import contextlib
import copy
import io
import json

import pytest

from pbe.demo import ACC_DROP_WARNING, DIGITS_SCHEDULE, format_text


@pytest.fixture(scope="module")
def demo_run():
    """`pbe demo --json --verbose --threads 1` in this process: its exit code, stdout and stderr."""
    from pbe.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["demo", "--json", "--verbose", "--threads", "1"])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def result(demo_run):
    return json.loads(demo_run[1])


def test_json_is_all_of_stdout(demo_run, result):
    rc, out, err = demo_run
    assert rc == 0
    assert json.loads(out) == result  # nothing but the JSON on stdout
    assert "epoch=" in err and "epoch=" not in out  # --verbose's training lines went to stderr
    assert result["threads"] == 1
    assert {"planted", "pbe", "infected", "after_pbe", "acc_drop", "warning", "wall_s"} <= set(result)


def test_threads_default_to_one_unless_told(monkeypatch):
    from pbe.demo import demo_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert demo_threads() == 1  # whatever the machine has: the numbers do not depend on its core count
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert demo_threads() == 2 and demo_threads(3) == 3


def test_result_says_what_was_planted_and_decided(result):
    p, pbe = result["planted"], result["pbe"]
    assert (p["attack"], p["target"], p["rate"]) == ("blend", 0, 0.1)
    assert p["poisoned"] == round(0.1 * p["train_size"])
    assert pbe["rounds_planned"] == len(DIGITS_SCHEDULE.fractions)
    assert 1 <= pbe["rounds_run"] <= pbe["rounds_planned"]
    assert pbe["stopped_early"] == (pbe["rounds_run"] < pbe["rounds_planned"])
    assert set(pbe["plan"]) >= {"target", "named_by", "distrust", "relabel"}
    assert result["infected"]["asr"] > 0.9 > result["after_pbe"]["asr"]  # the backdoor was planted, then erased
    assert result["acc_drop"] == pytest.approx(result["infected"]["acc"] - result["after_pbe"]["acc"])
    assert (result["warning"] is not None) == (result["acc_drop"] > ACC_DROP_WARNING)


def test_text_names_every_column_and_the_stop(result):
    text = format_text(result)
    for words in ("What was planted", "label 0", "10 %", "What PBE decided", "plan:", "clean accuracy",
                  "attack success rate", "robust accuracy", "kappa monitor", "infected", "after PBE"):
        assert words in text
    for column in ("clean accuracy:", "attack success rate:", "robust accuracy:", "kappa monitor:"):
        assert column in text  # each column explained in a line
    pbe = result["pbe"]
    if pbe["stopped_early"]:
        assert f"stopped early after round {pbe['rounds_run']} of {pbe['rounds_planned']} because" in text
    else:
        assert f"ran all {pbe['rounds_planned']} rounds (did not stop early" in text
    assert "epoch=" not in text and "elapsed_s" not in text and "{" not in text  # no logs, no JSON
    assert f"{100 * result['after_pbe']['acc']:.1f} %" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_text_warns_about_a_lost_accuracy_and_only_then(result):
    lost = copy.deepcopy(result)
    lost["infected"]["acc"], lost["after_pbe"]["acc"], lost["acc_drop"] = 0.99, 0.50, 0.49
    lost["warning"] = "PBE cost 49.0 points of clean accuracy on this model (99.0 % -> 50.0 %)"
    assert "warning: PBE cost 49.0 points" in format_text(lost)
    kept = copy.deepcopy(result)
    kept["warning"] = None
    assert "warning" not in format_text(kept)


def test_text_says_why_it_did_not_stop_early(result):
    r = copy.deepcopy(result)
    r["pbe"].update(stopped_early=False, rounds_run=r["pbe"]["rounds_planned"])
    r["after_pbe"]["monitor"]["suspected"] = True
    assert "did not stop early: the kappa monitor still flagged a backdoor after each round" in format_text(r)
    r["infected"]["monitor"]["suspected"] = False
    assert "the kappa monitor did not flag a backdoor before round 1" in format_text(r)
    r["pbe"]["early_stop"] = False
    assert "this schedule never stops early" in format_text(r)


def test_text_says_a_named_target(result):
    r = copy.deepcopy(result)
    r["pbe"]["schedule"] = "digits (targeted)"
    r["pbe"]["plan"].update(target=3, named_by="scan", distrust="target", relabel="moved")
    text = format_text(r)
    assert "target label 3 (named by the trigger-free scan)" in text and "the target label's samples" in text


def test_text_mode_prints_no_json_and_no_epoch_lines(result, monkeypatch, capsys):
    import pbe.demo
    from pbe.cli import main
    monkeypatch.setattr(pbe.demo, "run_demo", lambda *a, **k: result)
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "What PBE decided" in out and "clean accuracy" in out
    assert "epoch=" not in out and not any(line.startswith("{") for line in out.splitlines())
