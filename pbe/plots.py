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
    """ACC / ASR (when measured) per round, beside the erasure tracker's reach toward the target (filled: "still
    there", open: "gone") or, where the schedule ran it, the monitor's attraction (kappa)."""
    plt = _plt()
    rounds = [0] + [r["round"] for r in report["rounds"]]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    metrics = [report.get("before") or {}] + [r.get("metrics") or {} for r in report["rounds"]]
    for key in ("acc", "asr", "ra"):
        vals = [m.get(key) for m in metrics]
        if all(v is not None for v in vals):
            ax[0].plot(rounds, [100 * v for v in vals], marker="o", label=key.upper())
    ax[0].set(xlabel="round", ylabel="%", title="metrics (evaluation only)")
    if ax[0].lines:
        ax[0].legend()
    mons = [report.get("monitor_before")] + [r.get("monitor") for r in report["rounds"]]
    tracked = [report.get("tracker_before")] + [r.get("tracker") for r in report["rounds"]]
    if all(mons):
        ax[1].plot(rounds, [m["top_kappa"] for m in mons], marker="o", label="kappa of the top label")
        ax[1].axhline(mons[0]["threshold"], color="grey", ls="--", label="threshold")
        ax[1].set(xlabel="round", ylabel="kappa", title="adversarial-label monitor")
        ax[1].legend()
    elif all(tracked):
        reach = [100 * t["reach"] for t in tracked]
        ax[1].plot(rounds, reach, color="C0", zorder=1)
        for there, marker_face in ((True, "C0"), (False, "white")):
            pts = [(x, y) for x, y, t in zip(rounds, reach, tracked) if t["there"] is there]
            if pts:
                ax[1].scatter(*zip(*pts), color=marker_face, edgecolor="C0", zorder=2,
                              label="still there" if there else "gone")
        ax[1].set(xlabel="round", ylabel="% of held-out images", ylim=(0, 105),
                  title=f"erasure tracker: reach toward label {tracked[0]['label']}")
        ax[1].legend()
    else:
        ax[1].set_axis_off()
    for a in ax:
        a.set_xticks(rounds)  # whole rounds only
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
FONT_PT = 10  # axis labels, tick labels and legends of the figures a reader sees first (points)
ASR_TICKS = range(0, 101, 20)  # ASR axes: whole percentages, round steps


def integer_ticks(axis) -> None:
    """Whole-number ticks at round steps (1, 2, 5 or 10 times a power of ten) on a matplotlib axis."""
    from matplotlib.ticker import MaxNLocator
    axis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


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
    from matplotlib.lines import Line2D
    handles["ASR before the defence"] = Line2D([], [], color="k", lw=1)
    # above the panels: inside the axes the legend would hide bars
    fig.legend(list(handles.values()), list(handles), fontsize=FONT_PT - 1,
               ncol=min(len(handles), LEGEND_COLUMNS), loc="upper center")
    legend_rows = -(-len(handles) // LEGEND_COLUMNS)
    axes[0].set_ylabel("ASR after (%)", fontsize=FONT_PT)
    axes[0].set_xlabel("infected model (named under the lower panel)", fontsize=FONT_PT - 1)
    axes[0].set(ylim=(0, 105), yticks=list(ASR_TICKS))
    axes[0].tick_params(labelbottom=False)  # the models are named once, under the lower panel
    axes[1].set_ylabel("ACC drop (points)", fontsize=FONT_PT)
    axes[1].set_xlabel("infected model", fontsize=FONT_PT)
    integer_ticks(axes[1].yaxis)
    axes[1].axhline(0, color="grey", lw=0.5)
    for a in axes:
        a.tick_params(axis="y", labelsize=FONT_PT - 1)
    crowded = max(map(len, models)) > 72 * bars_width / len(models) / 6  # longer than its room (9 pt text)
    axes[1].set_xticks(range(len(models)), models, rotation=35 if crowded else 15, ha="right", fontsize=9,
                       rotation_mode="anchor")
    axes[1].set_xlim(-0.5, len(models) - 0.5)
    ax = None
    if means:
        ax = fig.add_subplot(grid[:, 1])
        _means_panel(ax, means, colour, marked, means_title)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.22 * legend_rows + 0.05) / height))
    if ax is not None:  # once the layout is final: the labels' places are measured in points on the page
        label_apart(ax, [(100 * m["asr"], 100 * m["acc_drop"]) for m in means], [m["name"] for m in means])
    return fig


def _means_panel(ax, means: list[dict], colour: dict, marked: set, title: str) -> None:
    """``defence_bars``' side panel: each defence's mean ASR after against its mean ACC drop, one marker per group
    (setting), the `marked` ones larger and hatched."""
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
    ax.set(xlim=(-3, 108), ylim=(min(0, *drops) - 2, max(drops) * 1.1 + 3), xticks=list(ASR_TICKS))
    ax.set_xlabel("mean ASR after (%)", fontsize=FONT_PT)
    ax.set_ylabel("mean ACC drop (points)", fontsize=FONT_PT)
    ax.set_title(f"{title}: lower left is better", fontsize=FONT_PT)
    integer_ticks(ax.yaxis)
    ax.tick_params(labelsize=FONT_PT - 1)
    ax.axhline(0, color="grey", lw=0.5)


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


def before_after(groups: list[tuple[str, list[dict]]], meets=None, name=None, title: str | None = None,
                 titles: dict | None = None):
    """One row of panels per group (``(name, rows)``, e.g. a zoo set; `titles` maps a group's name to a
    line over its panels), two panels per row: attack success
    (ASR) and clean accuracy (ACC) of every model before (open circle) and after (filled) a defence, joined
    by a line, the value after written beside it. `meets(row)` colours the models whose row meets a goal
    (green) apart from the others (red); `name(row)` names a model (default: its zoo key without the
    dataset). Rows need ``acc_before``, ``asr_before``, ``acc`` and ``asr`` (shares in [0, 1]). Returns the
    figure, or None without rows."""
    groups = [(t, [r for r in rows if r.get("asr_before") is not None and r.get("asr") is not None])
              for t, rows in groups]
    groups = [(t, rows) for t, rows in groups if rows]
    if not groups:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D
    name = name or (lambda r: (r.get("zoo") or r.get("model") or "?").split("/")[-1])
    titles = {g: (titles or {}).get(g, "") for g, _ in groups}
    counts = [len(rows) for _, rows in groups]
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 1.2 + 0.42 * sum(counts) + 0.9 * len(groups)),
                             gridspec_kw={"height_ratios": counts, "width_ratios": [1.25, 1]}, squeeze=False)
    acc_all = [100 * r[k] for _, rows in groups for r in rows for k in ("acc", "acc_before")]
    acc_lim = (5 * (min(acc_all) // 5) - 1, 5 * (max(acc_all) // 5) + 6)
    for (group, rows), (ax_asr, ax_acc) in zip(groups, axes):
        ys = list(range(len(rows)))[::-1]  # the first row on top
        for y, r in zip(ys, rows):
            colour = "tab:grey" if meets is None else ("tab:green" if meets(r) else "tab:red")
            for ax, key, text in ((ax_asr, "asr", f"{100 * r['asr']:.2f}"),
                                  (ax_acc, "acc", f"{100 * r['acc']:.2f} ({100 * (r['acc'] - r['acc_before']):+.2f})")):
                before, after = 100 * r[f"{key}_before"], 100 * r[key]
                ax.plot([before, after], [y, y], color="0.7", lw=1.5, zorder=1)
                ax.scatter([before], [y], s=45, facecolor="white", edgecolor="k", zorder=2)
                ax.scatter([after], [y], s=55, color=colour, edgecolor="k", zorder=3)
                right = after >= before if key == "acc" else after > 50
                ax.annotate(text, (after, y), xytext=(8 if not right else -8, 5), textcoords="offset points",
                            ha="right" if right else "left", va="bottom", fontsize=FONT_PT - 1)
        for ax in (ax_asr, ax_acc):
            ax.set_yticks(ys, [name(r) for r in rows], fontsize=FONT_PT)
            ax.set_ylim(-0.7, len(rows) - 0.3)
            ax.set_ylabel(f"{group} model", fontsize=FONT_PT)
            ax.tick_params(axis="x", labelsize=FONT_PT)
            ax.grid(axis="x", color="0.9", zorder=0)
        ax_asr.set_title(titles[group], fontsize=FONT_PT, loc="left")
        ax_asr.axvline(3, color="tab:green", ls="--", lw=1, zorder=0)
        ax_asr.set(xlim=(-4, 108), xticks=list(ASR_TICKS))
        ax_asr.set_xlabel("attack success rate, ASR (%): lower is better", fontsize=FONT_PT)
        ax_acc.set_xlim(*acc_lim)
        integer_ticks(ax_acc.xaxis)
        ax_acc.set_xlabel("clean accuracy, ACC (%): after (change in points)", fontsize=FONT_PT)
        ax_acc.tick_params(axis="y", labelleft=False)  # the same models as on the left
    handles = [Line2D([], [], marker="o", ls="", markerfacecolor="white", markeredgecolor="k", label="before")]
    if meets is None:
        handles.append(Line2D([], [], marker="o", ls="", color="tab:grey", markeredgecolor="k", label="after"))
    else:
        handles += [Line2D([], [], marker="o", ls="", color="tab:green", markeredgecolor="k", label="after: goal met"),
                    Line2D([], [], marker="o", ls="", color="tab:red", markeredgecolor="k", label="after: goal missed")]
    handles.append(Line2D([], [], color="tab:green", ls="--", lw=1, label="ASR 3 %"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=FONT_PT, frameon=False)
    if title:
        fig.suptitle(title, fontsize=FONT_PT + 1, y=0.995, va="top")
    top = 1 - (0.75 if title else 0.45) / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    if title:  # the legend below the title
        fig.legends[0].set_bbox_to_anchor((0.5, 1 - 0.3 / fig.get_figheight()))
    return fig


def premise_map(rows: list[dict], name=None, groups: tuple[tuple[str, bool], ...] = (
        ("per-image perturbations (untargeted)", False), ("universal perturbations (untargeted)", True)),
        marked: str | None = "linf 6/255"):
    """The premise of PBE per infected model, in one picture: for every perturbation family (columns, split
    into `groups` by the measurement's ``universal``) the share of untargeted adversarial labels that land
    on the backdoor's target (the number in each cell, %) and its colour, that share minus the share natural
    confusion predicts (blue: the adversarial examples go to the target more than chance would send them,
    as the premise says; red: less). `rows`: premise rows (``measurements`` per family, ``zoo``); rows of
    clean models (``attack == "none"``) are left out. `marked`: a family whose column is outlined (the
    paper's budget). Returns the figure, or None."""
    rows = [r for r in rows if r.get("attack") != "none" and r.get("measurements")]
    if not rows:
        return None
    plt = _plt()
    import numpy as np
    name = name or (lambda r: f"{r['zoo'].split('/')[-1]} ({r.get('zoo_set') or '?'})")
    parts = [[i for i, m in enumerate(rows[0]["measurements"]) if bool(m["universal"]) == universal]
             for _, universal in groups]
    fig, axes = plt.subplots(1, len(groups), figsize=(14, 1.6 + 0.36 * len(rows)),
                             gridspec_kw={"width_ratios": [len(p) for p in parts]}, squeeze=False)
    cmap = plt.get_cmap("RdBu").copy()
    cmap.set_bad("0.85")
    image = None
    for ax, (title, _), cols in zip(axes[0], groups, parts):
        diff = np.full((len(rows), len(cols)), np.nan)
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                m = r["measurements"][c]
                if m["success"] and m["target_share"] is not None:
                    diff[i, j] = 100 * (m["target_share"] - m["expected_share"])
                    ax.text(j, i, f"{100 * m['target_share']:.0f}", ha="center", va="center", fontsize=FONT_PT - 1,
                            color="white" if abs(diff[i, j]) > 60 else "black")
                else:
                    ax.text(j, i, "–", ha="center", va="center", fontsize=FONT_PT - 1)
        image = ax.imshow(np.ma.masked_invalid(diff), cmap=cmap, vmin=-100, vmax=100, aspect="auto")
        labels = [rows[0]["measurements"][c]["label"].replace("universal ", "") for c in cols]
        ax.set_xticks(range(len(cols)), labels, rotation=40, ha="right", rotation_mode="anchor", fontsize=FONT_PT - 1)
        ax.set_yticks(range(len(rows)), [name(r) for r in rows], fontsize=FONT_PT - 1)
        ax.set_xlabel(f"{title}: kind and budget", fontsize=FONT_PT)
        ax.set_ylabel("infected zoo model (set)", fontsize=FONT_PT)
        if marked in labels:
            j = labels.index(marked)
            ax.add_patch(plt.Rectangle((j - 0.5, -0.5), 1, len(rows), fill=False, lw=2, ec="k"))
            ax.set_title(f"outlined: {marked}, the paper's budget", fontsize=FONT_PT - 1)
    for ax in axes[0][1:]:
        ax.tick_params(axis="y", labelleft=False)
        ax.set_ylabel("")
    fig.suptitle("Where untargeted adversarial examples of each infected model land. Number: share (%) of the fooled "
                 "images whose adversarial label is the backdoor's target;\ncolour: that share minus the share natural "
                 "confusion predicts (the clean runner-up label): blue, the premise holds; red, it does not",
                 fontsize=FONT_PT, y=0.995, va="top")
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    bar = fig.colorbar(image, ax=list(axes[0]), fraction=0.025, pad=0.015)
    bar.set_label("on the target minus natural confusion (percentage points)", fontsize=FONT_PT - 1)
    bar.set_ticks(range(-100, 101, 50))
    bar.ax.tick_params(labelsize=FONT_PT - 1)
    return fig


def show(fig) -> None:
    """Display a figure in a Jupyter notebook as a PNG and close it (the figures here draw headless)."""
    import io

    from IPython.display import Image, display
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    display(Image(buf.getvalue()))
