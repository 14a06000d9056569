"""PNG figures for defence reports (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

from pbe.utils import atomic_path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rounds(report: dict, path: str | Path) -> None:
    """ACC / ASR (when measured) and the monitor's attraction (kappa) per round."""
    plt = _plt()
    rounds = [0] + [r["round"] for r in report["rounds"]]
    mons = [report["monitor_before"]] + [r["monitor"] for r in report["rounds"]]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    metrics = [report.get("before") or {}] + [r.get("metrics") or {} for r in report["rounds"]]
    for key in ("acc", "asr", "ra"):
        vals = [m.get(key) for m in metrics]
        if all(v is not None for v in vals):
            ax[0].plot(rounds, [100 * v for v in vals], marker="o", label=key.upper())
    ax[0].set(xlabel="round", ylabel="%", title="metrics (evaluation only)")
    if ax[0].lines:
        ax[0].legend()
    ax[1].plot(rounds, [m["top_kappa"] for m in mons], marker="o", label="kappa of the top label")
    ax[1].axhline(mons[0]["threshold"], color="grey", ls="--", label="threshold")
    ax[1].set(xlabel="round", title="adversarial-label monitor")
    ax[1].legend()
    fig.tight_layout()
    _save(fig, path)


def plot_histograms(before: dict, after: dict, path: str | Path, classes: list[str] | None = None) -> None:
    """Adversarial-label shares before and after the defence."""
    plt = _plt()
    k = len(before["adversarial_share"])
    labels = classes or [str(i) for i in range(k)]
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * k), 3.2))
    xs = list(range(k))
    ax.bar([x - 0.2 for x in xs], before["adversarial_share"], width=0.4, label="before")
    ax.bar([x + 0.2 for x in xs], after["adversarial_share"], width=0.4, label="after")
    ax.plot(xs, before["expected_share"], "k_", markersize=14, label="natural confusion (before)")
    ax.set_xticks(xs, labels, rotation=45 if k > 10 else 0)
    ax.set(ylabel="share of adversarial labels", title="where untargeted adversarial examples land")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path) -> None:
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    _plt().close(fig)
