"""Score PBE's erasure tracker (``pbe.tracker``) against the true ASR on every zoo model it ran on: how often its
"still there" / "gone" is right, before PBE and after each round -> experiments/results/tracker_score.{json,md}.

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
    found = readings(rows)
    write_json(RESULTS / "tracker_score.json", found)
    (RESULTS / "tracker_score.md").write_text(score_markdown(found) + "\n")
    print(f"{len(found)} readings -> {RESULTS / 'tracker_score.md'}")


if __name__ == "__main__":
    main()
