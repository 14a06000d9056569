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


MAX_FIGURE_IN = 16  # the widest figure, in inches: a wider one is unreadable once a page scales it down
BAR_IN = 0.13  # the width a bar gets, in inches (below MAX_FIGURE_IN)
MODEL_IN = 0.7  # the least width a model's group of bars gets, in inches (room for its name)
MEANS_IN = 5  # the width of the means panel, in inches
LEGEND_COLUMNS = 7  # a longer legend wraps onto more rows
HIGHLIGHT_HATCH = "///"  # the bars of the highlighted defence (the one a figure is about)
MARKER_PT = 7  # the means panel's markers: their width in points (the highlighted one 1.4 times as wide)
LABEL_PT = 8  # the means panel's labels (points)


def defence_bars(rows: list[dict], series, model=_default_model, means: list[dict] | None = None,
                 means_title: str = "means", highlight=None) -> object | None:
    """Per infected model (x, `model(row)`) and defence (`series(row)`, one bar colour each): ASR after the
    defence (the model's ASR before it as a black tick) and the ACC drop in points. With `means` (dicts of
    ``name`` (a defence as `series` names it), ``group`` (its setting), ``asr`` and ``acc_drop``, shares in
    [0, 1]) a panel beside them places each defence's means: ASR after against ACC drop, one marker per
    group, labels kept apart. `highlight(name)` picks the series drawn hatched and outlined, with a larger
    marker. At most MAX_FIGURE_IN wide. Returns the figure."""
    rows = [r for r in rows if r.get("asr_before") is not None and r.get("acc_before") is not None]
    if not rows:
        return None
    plt = _plt()
    models = list(dict.fromkeys(model(r) for r in rows))
    names = list(dict.fromkeys(series(r) for r in rows))
    colour = dict(zip(names, _colours(len(names))))
    marked = {n for n in names if highlight is not None and highlight(n)}
    marked = marked if marked != set(names) else set()  # highlighting every series would highlight none
    width = 0.85 / len(names)  # a model's group of bars, with a gap to the next
    bars_width = min(MAX_FIGURE_IN - (MEANS_IN if means else 0),
                     max(6, BAR_IN * len(models) * len(names), MODEL_IN * len(models)))
    legend_rows = -(-len(names) // LEGEND_COLUMNS)
    height = 5.5
    fig = plt.figure(figsize=(bars_width + (MEANS_IN if means else 0), height))
    grid = fig.add_gridspec(2, 2 if means else 1, width_ratios=[bars_width, MEANS_IN] if means else None)
    top = fig.add_subplot(grid[0, 0])
    axes = [top, fig.add_subplot(grid[1, 0], sharex=top)]
    for j, name in enumerate(names):
        style = ({"hatch": HIGHLIGHT_HATCH, "edgecolor": "k", "linewidth": 0.6} if name in marked else {})
        for i, m in enumerate(models):
            r = next((r for r in rows if series(r) == name and model(r) == m), None)
            if r is None:
                continue
            x = i - 0.425 + width * (j + 0.5)
            axes[0].bar(x, 100 * r["asr"], width, color=colour[name], label=name, **style)
            axes[0].plot([x - width / 2, x + width / 2], [100 * r["asr_before"]] * 2, "k-", lw=1)
            axes[1].bar(x, 100 * (r["acc_before"] - r["acc"]), width, color=colour[name], **style)
    handles = {h.get_label(): h for h in axes[0].containers}  # one bar per (model, defence): one handle each
    # above the panels: inside the axes the legend would hide bars
    fig.legend(list(handles.values()), list(handles), fontsize=9, ncol=min(len(names), LEGEND_COLUMNS),
               loc="upper center")
    axes[0].set(ylabel="ASR after (%)", ylim=(0, 105), title="black ticks: ASR before")
    axes[0].tick_params(labelbottom=False)  # the models are named once, under the lower panel
    axes[1].set(ylabel="ACC drop (points)")
    axes[1].axhline(0, color="grey", lw=0.5)
    crowded = max(map(len, models)) > 72 * bars_width / len(models) / 6  # longer than its room (9 pt text)
    axes[1].set_xticks(range(len(models)), models, rotation=35 if crowded else 15, ha="right", fontsize=9,
                       rotation_mode="anchor")
    axes[1].set_xlim(-0.5, len(models) - 0.5)
    ax = None
    if means:
        ax = fig.add_subplot(grid[:, 1])
        markers = dict(zip(dict.fromkeys(m["group"] for m in means), "osD^v"))
        for m in means:
            big = m["name"] in marked
            ax.scatter(100 * m["asr"], 100 * m["acc_drop"], s=(2 if big else 1) * MARKER_PT ** 2,
                       marker=markers[m["group"]], color=colour.get(m["name"], "grey"), edgecolor="k",
                       linewidth=1.5 if big else 0.8, hatch=HIGHLIGHT_HATCH if big else None, zorder=3)
        for group, marker in markers.items():
            ax.scatter([], [], marker=marker, color="white", edgecolor="k", label=group)
        ax.legend(fontsize=8, loc="upper right")
        drops = [100 * m["acc_drop"] for m in means]
        ax.set(xlabel="mean ASR after (%)", ylabel="mean ACC drop (points)", xlim=(-3, 108),
               ylim=(min(0, *drops) - 2, max(drops) * 1.1 + 3), title=f"{means_title}: lower left is better")
        ax.axhline(0, color="grey", lw=0.5)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.22 * legend_rows + 0.05) / height))
    if ax is not None:  # once the layout is final: the labels' places are measured in points on the page
        label_apart(ax, [(100 * m["asr"], 100 * m["acc_drop"]) for m in means], [m["name"] for m in means])
    return fig


def label_apart(ax, points: list[tuple[float, float]], labels: list[str], fontsize: float = LABEL_PT) -> None:
    """Write each label beside its point (data coordinates) at the first of a few places around it that
    overlaps no label written before, no marker, no legend of `ax` and stays inside it, or else overlaps
    them least; a label above or below its marker gets a thin line to it. Call it once the layout is final:
    places are measured on the page."""
    ax.figure.canvas.draw()
    to_pt = 72 / ax.figure.dpi

    def box_of(extent) -> tuple:
        return extent.x0 * to_pt, extent.y0 * to_pt, extent.x1 * to_pt, extent.y1 * to_pt
    xy = [tuple(v * to_pt for v in ax.transData.transform(p)) for p in points]
    frame = box_of(ax.get_window_extent())
    half = 0.75 * MARKER_PT  # half a highlighted marker's box
    taken = [(x - half, y - half, x + half, y + half) for x, y in xy]
    if ax.get_legend() is not None:
        taken.append(box_of(ax.get_legend().get_window_extent()))

    def overlap(a, b) -> float:
        return max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))

    def clash(box) -> float:
        """How much `box` overlaps what is taken (square points); a box outside the axes clashes most."""
        inside = overlap(box, frame) == (box[2] - box[0]) * (box[3] - box[1])
        return sum(overlap(box, t) for t in taken) + (0 if inside else 1e9)

    renderer = ax.figure.canvas.get_renderer()
    for i in sorted(range(len(xy)), key=lambda i: (xy[i][1], xy[i][0])):
        probe = ax.text(0, 0, labels[i], fontsize=fontsize)
        size = probe.get_window_extent(renderer)
        probe.remove()
        (x, y), w, h = xy[i], size.width * to_pt + 1, size.height * to_pt + 1  # 1 point apart
        places = [(dx, dy * h - h / 2) for dy in (0, 1, -1, 2, -2, 3, -3, 4, -4)
                  for dx in (half + 2, -half - 2 - w, -w / 2)]
        dx, dy = min(places, key=lambda p: clash((x + p[0], y + p[1], x + p[0] + w, y + p[1] + h)))  # first best
        taken.append((x + dx, y + dy, x + dx + w, y + dy + h))
        away = dy != places[0][1]  # not level with its marker: a thin line joins them
        ax.annotate(labels[i], points[i], xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                    ha="left", va="bottom", arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5,
                                                        "shrinkA": 0, "shrinkB": half} if away else None)


def show(fig) -> None:
    """Display a figure in a Jupyter notebook as a PNG and close it (the figures here draw headless)."""
    import io

    from IPython.display import Image, display
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    display(Image(buf.getvalue()))
