"""Score PBE's erasure tracker (``pbe.tracker``) against the true ASR on every zoo model it ran on: how often its
"still there" / "gone" is right, before PBE and after each round; and PBE's estimate of its accuracy drop against
the measured drop -> experiments/results/tracker_score.{json,md}.

Nothing is trained: it reads the PBE rows of the results tables (``pbe_cifar10``, ``pbe_gtsrb``; a row of PBE's
default carries the tracker's readings and the true ASR at the same moments). The truth is the goal's: the
backdoor is gone when the ASR is at most ``GOAL_ASR``. A wrong "gone" is the costly error (an early stop on it
would leave the backdoor), so it is counted apart.

    python experiments/tracker_score.py
"""
from __future__ import annotations

import json

from common import RESULTS
from pbe_cifar10 import GOAL_ASR

from pbe.utils import write_json

TABLES = ("pbe_cifar10", "pbe_gtsrb")


def readings(rows: list[dict]) -> list[dict]:
    """One reading per (zoo model, moment): moment 0 is before PBE, moment r after round r; the latest row of each
    zoo model and schedule counts."""
    latest = {}
    for r in rows:
        if r.get("tracker") and r.get("zoo") and not r.get("given_target"):
            latest[(r["zoo"], r.get("schedule"))] = r
    out = []
    for (zoo, schedule), r in sorted(latest.items()):
        for moment, (t, asr) in enumerate(zip(r["tracker"], r["round_asr"])):
            if t is None or asr is None:
                continue
            out.append({"zoo": zoo, "zoo_set": r.get("zoo_set"), "schedule": schedule, "moment": moment,
                        "evidence": t["evidence"], "there": t["there"], "asr": asr, "truly_there": asr > GOAL_ASR})
    return out


def drop_estimates(rows: list[dict]) -> list[dict]:
    """Per zoo model (the latest row of each schedule): PBE's estimated ACC drop and the measured one."""
    latest = {}
    for r in rows:
        if r.get("acc_drop_estimate") is not None and r.get("zoo") and not r.get("given_target"):
            latest[(r["zoo"], r.get("schedule"))] = r
    return [{"zoo": zoo, "zoo_set": r.get("zoo_set"), "estimate": r["acc_drop_estimate"],
             "measured": round(r["acc_before"] - r["acc"], 4)} for (zoo, _), r in sorted(latest.items())]


def drop_markdown(found: list[dict]) -> str:
    if not found:
        return ""
    lines = ["", "## PBE's estimate of its accuracy drop against the measured drop", "",
             "PBE estimates the drop from training samples it never fine-tuned on (``acc_drop_estimate``); the "
             "measured drop is on the test set. In points; error = estimate - measured.", "",
             "| zoo | set | estimate | measured | error |", "|---|---|---|---|---|"]
    for f in found:
        lines.append(f"| {f['zoo']} | {f['zoo_set']} | {100 * f['estimate']:.2f} | {100 * f['measured']:.2f} | "
                     f"{100 * (f['estimate'] - f['measured']):+.2f} |")
    errors = [abs(f["estimate"] - f["measured"]) for f in found]
    lines += ["", f"Mean absolute error {100 * sum(errors) / len(errors):.2f} points over {len(found)} models, "
              f"largest {100 * max(errors):.2f}."]
    return "\n".join(lines)


def score_markdown(found: list[dict]) -> str:
    lines = ["# The erasure tracker against the true ASR", "",
             "Regenerate: `python experiments/tracker_score.py` (reads the PBE rows of "
             f"{', '.join(f'`{t}.json`' for t in TABLES)}; nothing is trained). A reading is right when it says "
             f"\"still there\" exactly when the ASR is above {100 * GOAL_ASR:g} %. Moment 0 is before PBE, moment r "
             "after round r. *Wrong \"gone\"*: the tracker said gone while the backdoor was there (an early stop on "
             "it would leave the backdoor).", ""]
    if not found:
        return "\n".join(lines + ["No PBE row with the tracker yet."])
    lines += ["| set | evidence | moment | readings | right | wrong \"gone\" | wrong \"there\" |",
              "|---|---|---|---|---|---|---|"]
    keys = sorted({(f["zoo_set"] or "–", f["evidence"], f["moment"]) for f in found})
    for zoo_set, evidence, moment in keys:
        fs = [f for f in found if (f["zoo_set"] or "–", f["evidence"], f["moment"]) == (zoo_set, evidence, moment)]
        right = sum(f["there"] == f["truly_there"] for f in fs)
        lines.append(f"| {zoo_set} | {evidence} | {moment} | {len(fs)} | {right} of {len(fs)} | "
                     f"{sum(not f['there'] and f['truly_there'] for f in fs)} | "
                     f"{sum(f['there'] and not f['truly_there'] for f in fs)} |")
    wrong = [f for f in found if f["there"] != f["truly_there"]]
    if wrong:
        lines += ["", "Wrong readings: " + ", ".join(
            f"`{f['zoo']}` moment {f['moment']} ({'there' if f['there'] else 'gone'}, ASR {100 * f['asr']:.2f} %)"
            for f in wrong)]
    return "\n".join(lines)


def main() -> None:
    rows = []
    for name in TABLES:
        path = RESULTS / f"{name}.json"
        if path.exists():
            rows += json.loads(path.read_text())
    found, drops = readings(rows), drop_estimates(rows)
    write_json(RESULTS / "tracker_score.json", {"readings": found, "acc_drop": drops})
    (RESULTS / "tracker_score.md").write_text(score_markdown(found) + "\n" + drop_markdown(drops) + "\n")
    print(f"{len(found)} readings -> {RESULTS / 'tracker_score.md'}")


if __name__ == "__main__":
    main()
