"""One function per paper figure (docs/design.md). Each takes the run directories of a sweep (and `band`: "minmax",
"ci" or None, the band around each mean, `analysis.plots.curves`) and returns a matplotlib Figure;
`python -m paper_figures <id> <sweep_dir> [--band ci]` saves it as <id>.png and <id>.pdf.

The figures are drawn from what the runs recorded (analysis.load): commit rows for the loss and π curves,
evaluation rows for fig5, per-tensor rows for the heatmaps. Nothing is hard-coded but the paper's layout. Means
are over completed runs only; each figure's title block says what its lines and bands are, and how many runs it
left out of the means and why (a sweep still running, or killed, has incomplete runs: they are drawn dotted).
Panels are at most two to a row, so that a figure is about 10 in wide (1,600 px at 150 dpi).
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pandas as pd

from analysis import load, pi, plots
from analysis.plots import plt


class NoRuns(ValueError):
    """The sweep has no runs this figure can use: one line that says what it needs."""


# The experiments whose sweeps each figure reads, in order of preference (`<name>_quick` counts as <name>).
SOURCES = {
    "fig1": ("fig1",),
    "fig2": ("fig2",),
    "fig3": ("fig3", "fig1"),
    "fig3_cv": ("fig3_cv",),
    "fig4": ("fig4",),
    "fig5": ("fig5",),
    "fig6": ("fig6",),
    "fig7": ("fig7", "fig9_10"),
    "fig8": ("fig8",),
    "fig9": ("fig9_10", "fig7"),
    "fig10": ("fig9_10", "fig7"),
    "fig9_10": ("fig9_10", "fig7"),
    "baselines": ("baselines",),
    "dylu": ("dylu",),
}
COMMIT_COLUMNS = [
    "algorithm",
    "workers",
    "seed",
    "status",
    "experiment",
    "algorithm.kappa",
    "algorithm.window",
    "algorithm.dynamic_window",
    "lr",
    "engine.staleness",
    "engine.cycle_cv",
    "staleness_model",
    "data",
    "engine",
    "epochs",
    "steps",
    "batch_size",
    "train_examples",
]


WALL_CLOCK = ("process", "distributed")  # the engines whose time_s is wall-clock seconds


def load_for(
    fig_id: str, paths, keys, algorithms=None, table: str = "metrics", need: str = ""
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The rows of `table` a figure draws, those of `algorithms` (all if None), and the `load.runs` frame of the
    same runs: every run, also one killed before it wrote a row, which the title counts. Refused with one line
    when there are none (`need` says what the figure needs), or when runs sharing `keys` differ in more than the
    seed or repeat a seed."""
    r = load.without_twins(load.runs(paths))
    if algorithms is not None and len(r):
        r = r[r["algorithm"].isin(algorithms)] if "algorithm" in r else r.iloc[:0]
    frame = load.commits(paths, table, columns=COMMIT_COLUMNS, meta=r)
    if frame.empty:
        raise NoRuns(need)
    check(fig_id, r, keys)
    return frame, r


def wall_clock(fig_id: str, r: pd.DataFrame) -> None:
    """Refuse runs whose time_s is not wall-clock seconds: the sim engine's is its own simulated clock."""
    engines = sorted(set(r["engine"].dropna().map(str)) - set(WALL_CLOCK)) if "engine" in r else []
    if engines:
        clock = "the simulator's clock" if engines == ["sim"] else "not measured by a wall clock"
        raise NoRuns(
            f"{fig_id} plots wall-clock seconds, but these runs ran on engine={'/'.join(engines)}, whose "
            f"time_s is {clock}, not wall-clock; pass runs of engine={' or engine='.join(WALL_CLOCK)}"
        )


def check(fig_id: str, r: pd.DataFrame, keys) -> None:
    """One figure's curves average runs that share `keys` as seeds: refuse runs (the `load.runs` frame `r`)
    that differ in anything else, or that repeat a seed."""
    bad = load.varying(r, keys)
    if bad:
        values = ", ".join(f"{c} = {'/'.join(sorted(map(str, r[c].dropna().unique())))}" for c in bad[:3])
        raise NoRuns(
            f"{fig_id} averages the runs with the same {', '.join(keys)} over seeds, but these runs also "
            f"differ in {values}; pass run or sweep folders that differ only in {', '.join(keys)} and seed"
        )
    repeated = load.repeated_seeds(r, keys)
    if repeated:
        raise NoRuns(f"{fig_id}: {repeated}")


def left_out(r: pd.DataFrame, frame: pd.DataFrame) -> str:
    """How many of the runs `r` (load.runs) are not in the means, and why: "left out of the means: 2 incomplete,
    1 failed (drawn dotted; 1 without a row yet, not drawn); 1 diverged (drawn dashed, ×)"; empty when every run
    completed. A run killed before its first row is counted too."""
    if r is None or r.empty:
        return ""
    s = plots.statuses(r)
    drawn = set(frame["run_dir"]) if "run_dir" in frame else set()
    unfinished, diverged = [], []
    for status in [
        "incomplete",
        "failed",
        *sorted(set(s) - {"incomplete", "failed", "diverged", "completed"}),
        "diverged",
    ]:
        runs = r.loc[s == status, "run_dir"]
        if len(runs):
            (diverged if status == "diverged" else unfinished).append(f"{len(runs)} {status}")
    if not unfinished and not diverged:
        return ""
    silent = int((~r.loc[~s.isin(["completed", "diverged"]), "run_dir"].isin(drawn)).sum())
    parts = []
    if unfinished:
        parts.append(
            ", ".join(unfinished)
            + " (drawn dotted"
            + (f"; {silent} without a row yet, not drawn" if silent else "")
            + ")"
        )
    if diverged:
        parts.append(diverged[0] + " (drawn dashed, ×)")
    return "left out of the means: " + "; ".join(parts)


def _finish(
    fig,
    number: str,
    what: str,
    frame: pd.DataFrame,
    r: pd.DataFrame | None = None,
    band="minmax",
    notes=(),
    curves: bool = True,
):
    """Title the figure with its number and what it shows, then what the runs were (data, engine, seeds, quick
    or full), what its lines and bands are (`band`; a figure without `curves`, a heatmap, says nothing
    of them), how many runs of `r` it left out of the means and why, and any `notes`; and lay it out."""
    runs = frame.drop_duplicates("run_dir")
    bits = []
    for col in ("data", "engine"):
        if col in runs and runs[col].notna().any():
            bits.append("/".join(sorted(map(str, runs[col].dropna().unique()))))
    if "staleness_model" in runs and runs["staleness_model"].notna().any():  # which staleness model ran
        bits.append("staleness " + " / ".join(sorted(map(str, runs["staleness_model"].dropna().unique()))))
    elif "engine.staleness" in runs and runs["engine.staleness"].notna().any() and "sim" in set(runs.get("engine", [])):
        bits.append("staleness " + "/".join(sorted(map(str, runs["engine.staleness"].dropna().unique()))))
    if "seed" in runs:
        bits.append(plots.seeds_text(runs["seed"].nunique()))
    exps = sorted(map(str, runs["experiment"].dropna().unique())) if "experiment" in runs else []
    if exps:
        bits.append("sweep " + ", ".join(exps))
    lines = [f"{number}: {what}", f"({'; '.join(bits)})"]
    if curves:
        lines.append(plots.band_text(band))
    lines += [t for t in (left_out(r, frame), load.unstarted(r, short=True) if r is not None else "", *notes) if t]
    width = max(60, int(fig.get_figwidth() * 11))  # characters that fit across the figure at this font size
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in lines), fontsize=11)
    fig.tight_layout()
    return fig


def grid(panels: int, width: float = 5.2, height: float = 4.0, cols: int = 2):
    """A figure of `panels` axes, at most `cols` to a row (the unused ones switched off), and its axes flat."""
    cols = max(1, min(cols, panels))
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[panels:]:
        ax.axis("off")
    return fig, flat[:panels]


def gaps(m: pd.DataFrame, panel: str, hue: str, where) -> str:
    """A line for the title naming the curves a panel lacks (a sweep still running): each value of `hue` drawn in
    another panel but with no row in this one, "not drawn, no rows: adaptive at n = 30". `where(p, h)` words it."""
    values = sorted(set(m[hue].dropna()))
    missing = [where(p, h) for p, g in m.groupby(panel, sort=True) for h in values if h not in set(g[hue])]
    return "not drawn, no rows: " + "; ".join(missing) if missing else ""


def why_empty(what: str, r: pd.DataFrame, pending: bool = False) -> str:
    """What an empty panel says: no such runs in these folders (yet, when the sweep has jobs that have not run), or
    the runs there and that none has a row."""
    if r.empty and pending:
        return f"no {what} runs yet:\nthe sweep has jobs that have not run"
    if r.empty:
        return f"no {what} runs in these folders"
    counts = plots.statuses(r).value_counts()
    return f"no {what} run has written a row yet\n(" + ", ".join(f"{k} {s}" for s, k in counts.items()) + ")"


def empty_panel(ax, text: str) -> None:
    """A panel with nothing to draw: it says why, without the axes of a plot."""
    plots.note(ax, text)
    ax.set_xticks([])
    ax.set_yticks([])


def fig1(paths, band="minmax"):
    """(a–c) training loss against worker steps for GEM, DOWNPOUR and adaptive, one line per n; (d) the final
    loss against n. An algorithm without runs (a sweep still running) keeps its panel, which says so."""
    algos = ("gem", "downpour", "adaptive")
    m, r = load_for(
        "fig1",
        paths,
        ["algorithm", "workers"],
        list(algos),
        need="fig1 needs the runs of a fig1 sweep (gem, downpour, adaptive × n)",
    )
    fig, axes = grid(4, width=5.2, height=4.1)
    palette = plots.colours(sorted(m["workers"].unique()))
    for ax, a in zip(axes[:3], algos, strict=True):
        ax.set_title(a)
        ma = m[m["algorithm"] == a]
        if ma.empty:
            empty_panel(ax, why_empty(a, r[r["algorithm"] == a], pending=bool(load.unstarted(r, short=True))))
            continue
        plots.curves(ma, ax, x="worker_step", y="loss", hue="workers", palette=palette, band=band)
        plots.legend(ax, fontsize=8)
    plots.same_y(axes[:3])
    plots.final_loss(r, axes[3], palette=plots.colours(algos), band=band)
    axes[3].set_title("final loss (last 10% of commits)")
    plots.legend(axes[3], fontsize=8)
    gap = gaps(m, "algorithm", "workers", lambda a, n: f"{a} at n = {n}")
    return _finish(
        fig, "Fig. 1", "training loss against worker steps, and the final loss against n", m, r, band, notes=[gap]
    )


def fig2(paths, band="minmax"):
    """GEM's training loss against wall-clock seconds from the first commit, one line per n (100 workers in the
    paper). Runs of the sim engine are refused: their seconds are the simulator's."""
    m, r = load_for("fig2", paths, ["workers"], ["gem"], need="fig2 needs GEM runs (a fig2 sweep)")
    wall_clock("fig2", r)
    m = plots.since_first_commit(m)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plots.curves(m, ax, x="time_s", y="loss", hue="workers", band=band)
    ax.set_xlabel("seconds from the first commit")
    plots.legend(ax, fontsize=9)
    return _finish(fig, "Fig. 2", "GEM, training loss against wall-clock seconds", m, r, band)


# Fig. 3's median π, read off the paper's plot (docs/design.md): not measured here, drawn for comparison
PAPER_FIG3 = {5: 0.8, 10: 0.45, 20: 0.15, 30: 0.08}


def fig3(paths, band="minmax"):
    """(a) GEM's median π against worker steps, one line per n; (b) the fraction of π clamped to 0 (the median
    is 0 whenever more than half of the elements are); (c, d) both against each commit's own staleness, τ/(n − 1),
    over the second half of every run: the mechanism by which the spread of τ sets the median."""
    m, r = load_for("fig3", paths, ["workers"], ["gem"], need="fig3 needs GEM runs (a fig3 or fig1 sweep)")
    fig, axes = grid(4, width=5.4, height=4.2)
    palette = plots.colours(sorted(m["workers"].unique()))
    plots.curves(m, axes[0], x="worker_step", y="pi_median", hue="workers", log=False, palette=palette, band=band)
    plots.curves(m, axes[1], x="worker_step", y="pi_zero_frac", hue="workers", log=False, palette=palette, band=band)
    axes[1].set_ylabel("fraction of π clamped to 0")
    plots.legend(axes[0], fontsize=8)
    by_tau(m, axes[2], axes[3], palette)
    return _finish(
        fig,
        "Fig. 3",
        "GEM's median π (each commit's median over all elements), by worker step and by the commit's own staleness",
        m,
        r,
        band,
        notes=["bottom row: pooled over the commits of the completed runs"],
    )


def by_tau(m: pd.DataFrame, ax_median, ax_zero, palette: dict) -> None:
    """Median π and the zero fraction against τ/(n − 1), one line per n (analysis.pi.by_staleness)."""
    s = pi.by_staleness(m)
    for n, g in s.groupby("workers"):
        style = {"color": palette.get(n), "marker": "o", "ms": 4, "lw": 1.2, "label": f"n = {n}"}
        ax_median.plot(g["tau_rel"], g["pi_median"], **style)
        ax_zero.plot(g["tau_rel"], g["pi_zero_frac"], **style)
    for ax, what in ((ax_median, "median π (mean over commits)"), (ax_zero, "fraction of π clamped to 0")):
        if s.empty:
            plots.note(ax, f"no completed run has {pi.MIN_COMMITS} commits in a τ bucket")
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")  # round robin's τ = n − 1
        ax.set_xlabel(f"the commit's τ / (n − 1), buckets of {pi.BUCKET:g}\n(second half of each run)")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    plots.legend(ax_median, fontsize=8, title=f"commits ≥ {pi.MIN_COMMITS} per point", title_fontsize=8)


def fig3_cv(paths, band="minmax"):
    """Fig. 3 as the spread of the workers' cycle times grows (a fig3_cv sweep, engine.staleness=gamma): (a) the
    mean over the second half of each run of the per-commit median π against n, one line per CV (mean over the
    completed seeds, bars as `band`), the paper's values beside them; (b) the fraction of π clamped to 0; (c, d)
    both against each commit's own τ/(n − 1), pooled over every CV."""
    need = "fig3_cv needs completed GEM runs with engine.staleness=gamma (a fig3_cv sweep)"
    m, r = load_for("fig3_cv", paths, ["engine.cycle_cv", "workers"], ["gem"], need=need)
    other = sorted(set(m["engine.staleness"].dropna()) - {"gamma"})
    if other:  # engine.cycle_cv is a setting of the gamma model only: another model's runs have no CV to plot at
        raise NoRuns(
            f"fig3_cv plots gamma runs by their engine.cycle_cv, but some of these runs have "
            f"engine.staleness={'/'.join(other)}; pass the runs of a fig3_cv sweep"
        )
    per = (
        pi.settled(m)
        .groupby(["engine.cycle_cv", "workers", "run_dir"])[["pi_median", "pi_zero_frac"]]
        .mean()
        .reset_index()
    )
    if per.empty:
        raise NoRuns(need)
    fig, axes = grid(4, width=5.4, height=4.2)
    cvs = sorted(per["engine.cycle_cv"].unique())
    pal_cv = dict(zip(cvs, plt.get_cmap("plasma")(np.linspace(0.05, 0.8, len(cvs))), strict=True))
    for cv, g in per.groupby("engine.cycle_cv"):
        for ax, y in ((axes[0], "pi_median"), (axes[1], "pi_zero_frac")):
            rows = [(n, *plots.bar(h[y], band)) for n, h in g.groupby("workers")]
            ns, mean, lo, hi, k = (np.array(c) for c in zip(*rows, strict=True))
            ks = plots.seeds_text(int(k[0])) if len(set(k)) == 1 else f"{k.min()}–{k.max()} seeds"
            ax.errorbar(
                ns,
                mean,
                yerr=[mean - lo, hi - mean],
                color=pal_cv[cv],
                marker="o",
                ms=4,
                capsize=3,
                lw=1.2,
                label=f"CV = {cv:g}" + (" (round robin)" if cv == 0 else "") + f", {ks}",
            )
    ns = sorted(per["workers"].unique())
    axes[0].plot(list(PAPER_FIG3), list(PAPER_FIG3.values()), "kx", ms=9, mew=2, label="paper (read off Fig. 3)")
    axes[0].set_ylabel("median π\n(mean over the second half of a run)")
    axes[1].set_ylabel("fraction of π clamped to 0")
    for ax in axes[:2]:
        ax.set_xlabel("n")
        ax.set_xticks(ns)
        ax.grid(True, alpha=0.3)
    plots.legend(axes[0], fontsize=8)
    by_tau(m, axes[2], axes[3], plots.colours(ns))
    kind = plots.band_kind(band)
    what = "points: mean over the completed seeds (how many: legend)" + (
        f"; bars: {plots.BANDS[kind]}" if kind else "; no bars"
    )
    return _finish(
        fig,
        "Fig. 3 by the spread of cycle times",
        "GEM's median π as each worker's cycle time varies (Gamma, coefficient of variation CV)",
        m,
        r,
        band,
        curves=False,
        notes=[what, "bottom row: pooled over the commits of the completed runs, every CV"],
    )


def fig4(paths, band="minmax"):
    """(a) GEM's training loss against wall-clock seconds for each n at a fixed effective batch; (b) the speedup
    to a common loss, relative to n = 1. Runs of the sim engine are refused: their seconds are the simulator's."""
    m, r = load_for("fig4", paths, ["workers"], ["gem"], need="fig4 needs GEM runs on engine=process (a fig4 sweep)")
    wall_clock("fig4", r)
    m = plots.since_first_commit(m)
    fig, axes = grid(2, width=5.4, height=4.3)
    plots.curves(m, axes[0], x="time_s", y="loss", hue="workers", band=band)
    axes[0].set_xlabel("seconds from the first commit")
    target = plots.common_target(m, "time_s", "workers")
    plots.legend(axes[0], fontsize=8)
    ax = axes[1]
    sp = plots.speedup(m, target) if np.isfinite(target) else pd.DataFrame(columns=["workers", "speedup"])
    if np.isfinite(target):
        axes[0].axhline(target, color="grey", ls=":", lw=1)
    if sp["speedup"].notna().any():
        speedup_panel(ax, sp)
    elif not np.isfinite(target):
        empty_panel(ax, "no completed run: no common loss to reach")
    else:
        empty_panel(
            ax,
            "not every n = 1 run reached the common loss"
            if 1 in set(sp["workers"])
            else "no completed n = 1 run to measure the speedup against",
        )
    ax.set_ylabel(f"speedup to loss {target:.3g}" if np.isfinite(target) else "speedup")
    ax.set_xlabel("n")
    ax.grid(True, alpha=0.3)
    return _finish(fig, "Fig. 4", "wall-clock speedup at a fixed effective batch (b = B/n)", m, r, band)


def speedup_panel(ax, sp: pd.DataFrame) -> None:
    """Fig. 4(b): the speedup against n (`plots.speedup`'s frame), linear beside it, and k/N above each point
    (the seeds that reached the loss), kept inside the panel by its margins."""
    ns = sp["workers"].to_numpy()
    ax.plot(ns, sp["speedup"], marker="o", label="GEM (median time over seeds)")
    ax.plot(ns, ns, ls="--", color="grey", label="linear")
    for n, v, k, total in zip(ns, sp["speedup"], sp["reached"], sp["runs"], strict=True):
        ax.annotate(
            f"{k}/{total}" + ("" if np.isfinite(v) else ": no speedup"),
            (n, v if np.isfinite(v) else 1.0),
            textcoords="offset points",
            xytext=(0, 7),
            ha="center",
            va="bottom",
            fontsize=9,
            color="dimgrey",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.margins(x=0.12, y=0.15)
    plots.legend(ax, fontsize=8, loc="upper left")
    ax.set_title("k/N: seeds that reached the loss", fontsize=10)


def data_epochs(ev: pd.DataFrame) -> pd.Series:
    """Epochs of data behind each evaluation: commits × batch size × window / training examples (a run
    from before `train_examples` was recorded: commits × workers × epochs per worker / all its commits)."""
    window = ev["algorithm.window"].fillna(1) if "algorithm.window" in ev else 1
    fallback = ev["step"] * ev["workers"] * ev["epochs"] / ev["steps"]
    if "train_examples" not in ev:
        return fallback
    return (ev["step"] * ev["batch_size"] * window / ev["train_examples"]).fillna(fallback)


def fig5(paths, band="minmax"):
    """GEM against its proxy, momentum SGD: training and validation loss of the central variable against
    epochs of data processed, and the final test loss (the test split is evaluated once, at the end: a star at the
    last epoch, the mean over the completed seeds). Runs at several η (the proxy at a smaller η beside the paper's,
    say) are curves of their own, each named with its η."""
    ev, r = load_for(
        "fig5",
        paths,
        ["algorithm", "workers", "lr"],
        table="eval",
        need="fig5 needs evaluation rows of gem and sgd runs (a fig5 sweep)",
    )
    ev = ev[~(ev["steps"] <= 0)]  # NaN steps: a run without its summary
    if "train_examples" in ev and "data" in ev:  # such a run has the training set of the other runs on its data
        known = ev.groupby("data")["train_examples"].transform("max")
        ev = ev.assign(train_examples=ev["train_examples"].fillna(known))
    ev = ev.assign(epoch=data_epochs(ev))
    ev["who"] = [
        f"{a}, n = {n}" if a != "sgd" else "momentum SGD" for a, n in zip(ev["algorithm"], ev["workers"], strict=True)
    ]
    if ev["lr"].nunique() > 1:
        ev["who"] = [f"{w}, η = {lr:g}" for w, lr in zip(ev["who"], ev["lr"], strict=True)]
    fig, axes = grid(2, width=5.4, height=4.3)
    palette = plots.colours(sorted(ev["who"].unique()))
    for ax, y in zip(axes, ("train_loss", "val_loss"), strict=True):
        plots.curves(ev, ax, x="epoch", y=y, hue="who", palette=palette, bins=1000, band=band)
        ax.set_title(plots.label(y))
    notes = []
    if "test_loss" in r and r["test_loss"].notna().any():  # the final θ on the test split: one point per method
        done = plots.completed(r).merge(ev.drop_duplicates("run_dir")[["run_dir", "who", "epoch"]], on="run_dir")
        last = ev.groupby("who")["epoch"].max()
        for who, g in done.groupby("who"):
            test = pd.to_numeric(g["test_loss"], errors="coerce").dropna()
            if len(test):
                axes[1].plot(
                    [last[who]],
                    [test.mean()],
                    marker="*",
                    ms=13,
                    color=palette[who],
                    ls="none",
                    label=f"{who}: final test loss {test.mean():.4f}",
                )
        notes.append(
            "★: the final central variable's test loss (the test split, evaluated once at the end), mean "
            "over the completed seeds"
        )
        axes[1].set_title("validation loss (★ test loss, final)")
    plots.same_y(axes)
    plots.legend(axes[0], fontsize=8)
    plots.legend(axes[1], fontsize=8)
    return _finish(
        fig, "Fig. 5", "generalisation: training and validation loss of the central variable", ev, r, band, notes=notes
    )


def fig6(paths, band="minmax"):
    """η = 0.1: GEM, DOWNPOUR and momentum SGD, one panel per n (two to a row). Momentum SGD runs one worker, so
    its runs are the same reference in every panel."""
    m, r = load_for(
        "fig6", paths, ["algorithm", "workers"], need="fig6 needs gem, downpour and sgd runs (a fig6 sweep)"
    )
    sgd = m[m["algorithm"] == "sgd"]  # one run per seed: load_for keeps one of the twins a sweep over n makes
    asy = m[m["algorithm"] != "sgd"]
    ns = sorted(asy["workers"].unique()) or [1]
    fig, axes = grid(len(ns), width=5.2, height=4.0)
    palette = plots.colours(sorted(asy["algorithm"].unique(), key=plots.algorithm_order) + ["momentum SGD"])
    for ax, n in zip(axes, ns, strict=True):
        panel = pd.concat([asy[asy["workers"] == n], sgd.assign(algorithm="momentum SGD")])
        plots.curves(panel, ax, x="worker_step", y="loss", hue="algorithm", palette=palette, band=band)
        ax.set_title(f"n = {n}")
        plots.legend(ax, fontsize=8)
    plots.same_y(axes)
    lr = ", ".join(f"{v:g}" for v in sorted(m["lr"].unique()))
    gap = gaps(asy, "workers", "algorithm", lambda n, a: f"{a} at n = {n}")
    return _finish(fig, "Fig. 6", f"a misspecified learning rate (η = {lr})", m, r, band, notes=[gap])


def fig7(paths, band="minmax"):
    """AlexNet with n = 8 and 16 GEM workers at a fixed effective batch: training loss and median π against
    worker steps."""
    m, r = load_for("fig7", paths, ["workers"], ["gem"], need="fig7 needs GEM runs (a fig7 or fig9_10 sweep)")
    fig, axes = grid(2, width=5.4, height=4.2)
    plots.curves(m, axes[0], x="worker_step", y="loss", hue="workers", band=band)
    plots.curves(m, axes[1], x="worker_step", y="pi_median", hue="workers", log=False, band=band)
    plots.legend(axes[0], fontsize=8)
    return _finish(fig, "Fig. 7", "AlexNet, training loss and median π against worker steps", m, r, band)


def fig8(paths, band="minmax"):
    """κ, the energy amplification: training loss and median π against worker steps, one line per κ."""
    m, r = load_for(
        "fig8",
        paths,
        ["algorithm.kappa"],
        ["gem"],
        need="fig8 needs GEM runs with several algorithm.kappa (a fig8 sweep)",
    )
    fig, axes = grid(2, width=5.4, height=4.2)
    palette = plots.colours(sorted(m["algorithm.kappa"].unique()))
    plots.curves(m, axes[0], x="worker_step", y="loss", hue="algorithm.kappa", palette=palette, band=band)
    plots.curves(
        m, axes[1], x="worker_step", y="pi_median", hue="algorithm.kappa", palette=palette, log=False, band=band
    )
    plots.legend(axes[0], fontsize=8)
    ns = ", ".join(str(n) for n in sorted(m["workers"].unique()))
    return _finish(
        fig, "Fig. 8", f"GEM with κ ∈ {{{', '.join(f'{k:g}' for k in sorted(palette))}}}, n = {ns}", m, r, band
    )


HEAT_QUANTILE = 0.99  # a panel's colours run from 0 to this quantile of its cells: a few spikes must not wash it out
HEAT_GAMMA = 0.5  # a square-root scale: most cells are near 0 at large n, and their structure is in that range


def heatmaps(paths, ns=None, number="Figs. 9 and 10"):
    """One heatmap per n (a panel per row; two to a row beyond three), each of one run: the lowest seed's
    completed run (an unfinished one when none completed). Each panel has its own colour scale, a square root
    from 0 to its 99th percentile: π falls with n (the cells' median about 0.25 at n = 5, 0 at n = 30, where 97%
    of the per-commit medians are 0), so one linear scale for all leaves the large-n panels black."""
    t, r = load_for(
        "the π heatmaps",
        paths,
        ["workers"],
        ["gem"],
        table="tensors",
        need="the π heatmaps need the per-tensor rows of GEM runs (a fig9_10 or fig7 sweep)",
    )
    wanted = ns
    ns = [n for n in (ns or sorted(t["workers"].unique())) if n in set(t["workers"])]
    if not ns:  # fig9 and fig10 draw one n each (the paper's 8 and 16); fig9_10 draws every n there is
        have = ", ".join(str(int(n)) for n in sorted(t["workers"].unique()))
        raise NoRuns(
            f"{number} needs GEM runs with workers={'/'.join(map(str, wanted))}, and these have workers={have}; "
            "fig9_10 draws a heatmap for each n there is"
        )
    cols = 1 if len(ns) <= 3 else 2
    fig, axes = grid(len(ns), width=10.5 / cols, height=3.4, cols=cols)
    for ax, n in zip(axes, ns, strict=True):
        tn = t[t["workers"] == n]
        tn = tn.assign(_unfinished=plots.statuses(tn) != "completed").sort_values(
            ["_unfinished", "seed", "run_dir"], kind="stable"
        )
        run = tn[tn["run_dir"] == tn["run_dir"].iloc[0]]
        status = plots.statuses(run).iloc[0]
        image = plots.pi_heatmap(run, ax, quantile=HEAT_QUANTILE, gamma=HEAT_GAMMA)
        ax.set_title(f"n = {n} (seed {run['seed'].iloc[0]}" + ("" if status == "completed" else f", {status}") + ")")
        fig.colorbar(image, ax=ax, label="median π", pad=0.01, extend="max")
    note = (
        f"one run per panel; colour: square root, 0 to the panel's {HEAT_QUANTILE:.0%} quantile "
        "(each panel its own colour bar)"
    )
    return _finish(
        fig, number, "per-tensor median π against parameter-server updates", t, r, curves=False, notes=[note]
    )


def fig9(paths, band=None):
    """The per-tensor median π heatmap with 8 workers (`band`: unused, heatmaps have none)."""
    return heatmaps(paths, [8], "Fig. 9")


def fig10(paths, band=None):
    """The per-tensor median π heatmap with 16 workers (`band`: unused)."""
    return heatmaps(paths, [16], "Fig. 10")


def fig9_10(paths, band=None):
    """Both heatmaps, one above the other (every n in the sweep; `band`: unused)."""
    return heatmaps(paths)


def dylu(paths, band="minmax"):
    """Beyond the paper: async_localsgd with fixed windows against dynamic local updates (DyLU, Liu et al. 2024)
    on sim with stragglers (a dylu sweep). (a) validation loss against simulated time; (b) the window each commit
    ends, against simulated time, stragglers and the others apart (DyLU); (c) the mean τ of the stragglers' commits
    and of the others'; (d) their commits per worker. A straggler is a worker whose pace (local steps per unit of
    simulated time, from its rows) is under half the median's."""
    key = "algorithm.dynamic_window"
    m, r = load_for("dylu", paths, [key, "workers"], ["async_localsgd"], need="dylu needs the runs of a dylu sweep")
    ev, _ = load_for("dylu", paths, [key, "workers"], ["async_localsgd"], table="eval", need="dylu needs evaluations")
    label = {False: "fixed windows", True: "DyLU"}
    for f in (m, ev):
        f["windows"] = f[key].map(lambda v: label[bool(v)] if pd.notna(v) else "fixed windows")
    done = m[m["status"] == "completed"].sort_values(["run_dir", "step"])
    # each worker's pace from its own rows: local steps over the simulated time they took
    span = done.groupby(["run_dir", "worker"]).agg(
        steps=("worker_step", "max"), began=("sim_time", "min"), ended=("sim_time", "max"), first=("worker_step", "min")
    )
    span["pace"] = (span["steps"] - span["first"]) / (span["ended"] - span["began"]).where(lambda d: d > 0)
    median = span.groupby(level="run_dir")["pace"].transform("median")
    span["kind"] = np.where(span["pace"] < 0.5 * median, "stragglers", "the others")
    done = done.join(span["kind"], on=["run_dir", "worker"])
    fig, axes = grid(4, width=5.2, height=4.0)
    palette = plots.colours(["fixed windows", "DyLU"])
    plots.curves(ev, axes[0], x="sim_time", y="val_loss", hue="windows", palette=palette, band=band)
    axes[0].set_title("(a) validation loss")
    axes[0].set_xlabel("simulated time (mean cycles of one local step)")
    plots.legend(axes[0], fontsize=8)
    dy = done[done["windows"] == "DyLU"]
    if "window" in dy and dy["window"].notna().any():
        kinds = {"the others": "tab:gray", "stragglers": "tab:red"}  # not the colours of the two variants
        for kind, g in dy.groupby("kind"):
            axes[1].scatter(g["sim_time"], g["window"], s=6, alpha=0.4, color=kinds[kind], label=kind)
        axes[1].set_ylim(bottom=0)
        plots.legend(axes[1], fontsize=8)
    else:
        empty_panel(axes[1], "no DyLU runs with windows yet")
    axes[1].set_title("(b) DyLU: the window each commit ends")
    axes[1].set_xlabel("simulated time")
    axes[1].set_ylabel("window (local steps)")
    per_run = done.groupby(["windows", "kind", "run_dir"]).agg(
        tau=("staleness", "mean"), commits=("step", "size"), workers=("worker", "nunique")
    )
    per_run["commits"] = per_run["commits"] / per_run["workers"]
    for ax, col, title in ((axes[2], "tau", "(c) mean τ of a commit"), (axes[3], "commits", "(d) commits per worker")):
        stats = per_run.groupby(["windows", "kind"])[col].agg(["mean", "min", "max"]).reset_index()
        kinds = ["the others", "stragglers"]
        for i, windows in enumerate(["fixed windows", "DyLU"]):
            s = stats[stats["windows"] == windows].set_index("kind").reindex(kinds)
            xs = np.arange(len(kinds)) + (i - 0.5) * 0.38
            ax.bar(xs, s["mean"], width=0.36, color=palette[windows], label=windows)
            ax.errorbar(xs, s["mean"], yerr=[s["mean"] - s["min"], s["max"] - s["mean"]], fmt="none", color="k", lw=1)
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_title(title)
        plots.legend(ax, fontsize=8)
    # the outer step's η_o decides whether either variant trains (REPRODUCTION.md, DyLU): the title names it
    outer = sorted({float(v) for v in r.get("algorithm.outer_lr", pd.Series(dtype=float)).dropna()})
    outer_text = f" (η_o {' / '.join(f'{v:g}' for v in outer)})" if outer else ""
    return _finish(
        fig,
        "DyLU",
        f"async_localsgd's fixed windows against dynamic local updates{outer_text}"
        + (", with stragglers" if "stragglers" in set(r.get("engine.staleness", pd.Series(dtype=str))) else ""),
        m,
        r,
        band,
        notes=["bars: mean over seeds, from the lowest to the highest"],
    )


FIGURES = {
    "fig1": fig1,
    "fig2": fig2,
    "fig3": fig3,
    "fig3_cv": fig3_cv,
    "fig4": fig4,
    "fig5": fig5,
    "fig6": fig6,
    "fig7": fig7,
    "fig8": fig8,
    "fig9": fig9,
    "fig10": fig10,
    "fig9_10": fig9_10,
    "dylu": dylu,
}
