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


def _colours(n: int) -> list:
    """`n` distinguishable colours: matplotlib's 10-colour cycle, its 20-colour map beyond ten."""
    plt = _plt()
    return [f"C{i}" for i in range(n)] if n <= 10 else [plt.get_cmap("tab20")(i % 20) for i in range(n)]


def _default_model(r: dict) -> str:
    return r.get("zoo") or f"{r['attack']} {r['rate']:.0%} ({r['recipe']})"


def defence_bars(rows: list[dict], series, model=_default_model, means: list[dict] | None = None,
                 means_title: str = "means") -> object | None:
    """Per infected model (x, `model(row)`) and defence (`series(row)`, one bar colour each): ASR after the
    defence (the model's ASR before it as a black tick) and the ACC drop in points. With `means` (dicts of
    ``name`` (a defence as `series` names it), ``group`` (its setting), ``asr`` and ``acc_drop``, shares in
    [0, 1]) a panel beside them places each defence's means: ASR after against ACC drop, one marker per group.
    Returns the figure."""
    rows = [r for r in rows if r.get("asr_before") is not None and r.get("acc_before") is not None]
    if not rows:
        return None
    plt = _plt()
    models = list(dict.fromkeys(model(r) for r in rows))
    names = list(dict.fromkeys(series(r) for r in rows))
    colour = dict(zip(names, _colours(len(names))))
    width = 0.8 / len(names)
    bars_width = max(7, 1.1 * len(models) * max(1, len(names) / 3))
    fig = plt.figure(figsize=(bars_width + (6 if means else 0), 6))
    grid = fig.add_gridspec(2, 2 if means else 1, width_ratios=[bars_width, 6] if means else None)
    top = fig.add_subplot(grid[0, 0])
    axes = [top, fig.add_subplot(grid[1, 0], sharex=top)]
    for j, name in enumerate(names):
        for i, m in enumerate(models):
            r = next((r for r in rows if series(r) == name and model(r) == m), None)
            if r is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            axes[0].bar(x, 100 * r["asr"], width, color=colour[name], label=name)
            axes[0].plot([x - width / 2, x + width / 2], [100 * r["asr_before"]] * 2, "k-", lw=1)
            axes[1].bar(x, 100 * (r["acc_before"] - r["acc"]), width, color=colour[name])
    handles = {h.get_label(): h for h in axes[0].containers}  # one bar per (model, defence): one handle each
    # above the panels, one row: inside the axes the legend would hide bars
    fig.legend(list(handles.values()), list(handles), fontsize=9, ncol=len(names), loc="upper center")
    axes[0].set(ylabel="ASR after (%)", ylim=(0, 105), title="black ticks: ASR before")
    axes[1].set(ylabel="ACC drop (points)")
    axes[1].axhline(0, color="grey", lw=0.5)
    axes[1].set_xticks(range(len(models)), models, rotation=30, ha="right", fontsize=8)
    if means:
        ax = fig.add_subplot(grid[:, 1])
        markers = dict(zip(dict.fromkeys(m["group"] for m in means), "osD^v"))
        for m in means:
            ax.scatter(100 * m["asr"], 100 * m["acc_drop"], s=60, marker=markers[m["group"]],
                       color=colour.get(m["name"], "grey"), edgecolor="k")
            ax.annotate(m["name"], (100 * m["asr"], 100 * m["acc_drop"]), xytext=(4, 3),
                        textcoords="offset points", fontsize=8)
        for group, marker in markers.items():
            ax.scatter([], [], marker=marker, color="white", edgecolor="k", label=group)
        ax.legend(fontsize=8, loc="upper right")
        ax.set(xlabel="mean ASR after (%)", ylabel="mean ACC drop (points)", xlim=(-3, 105),
               title=f"{means_title}: lower left is better")
        ax.axhline(0, color="grey", lw=0.5)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def show(fig) -> None:
    """Display a figure in a Jupyter notebook as a PNG and close it (the figures here draw headless)."""
    import io

    from IPython.display import Image, display
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    display(Image(buf.getvalue()))
