"""One function per paper figure (DESIGN §5). Each takes the run directories of a sweep and returns a
matplotlib Figure; `python -m paper_figures <id> <sweep_dir>` saves it as <id>.png and <id>.pdf.

The figures are drawn from what the runs recorded (analysis.load): commit rows for the loss and π curves,
evaluation rows for fig5, per-tensor rows for the heatmaps. Nothing is hard-coded but the paper's layout.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import load, pi, plots
from analysis.plots import plt


class NoRuns(ValueError):
    """The sweep has no runs this figure can use: one line that says what it needs."""


# The experiments whose sweeps each figure reads, in order of preference (`<name>_quick` counts as <name>).
SOURCES = {
    "fig1": ("fig1",), "fig2": ("fig2",), "fig3": ("fig3", "fig1"), "fig3_cv": ("fig3_cv",), "fig4": ("fig4",),
    "fig5": ("fig5",), "fig6": ("fig6",), "fig7": ("fig7", "fig9_10"), "fig8": ("fig8",), "fig9": ("fig9_10", "fig7"),
    "fig10": ("fig9_10", "fig7"), "fig9_10": ("fig9_10", "fig7"), "baselines": ("baselines",),
}
COMMIT_COLUMNS = ["algorithm", "workers", "seed", "status", "experiment", "algorithm.kappa", "algorithm.window", "lr",
                  "engine.staleness", "engine.cycle_cv",
                  "data", "engine", "epochs", "steps", "batch_size", "train_examples"]


def runs_for(fig_id: str, paths, keys, algorithms=None, table: str = "metrics", need: str = "") -> pd.DataFrame:
    """The rows of `table` a figure draws: those of `algorithms` (all if None), refused with one line when there
    are none (`need` says what the figure needs) or when runs sharing `keys` differ in more than the seed."""
    r = load.runs(paths)
    frame = load.commits(paths, table, columns=COMMIT_COLUMNS, meta=r)
    if algorithms is not None and len(frame):
        frame = frame[frame["algorithm"].isin(algorithms)]
    if frame.empty:
        raise NoRuns(need)
    check(fig_id, r, keys, algorithms)
    return frame


def check(fig_id: str, r: pd.DataFrame, keys, algorithms=None) -> None:
    """One figure's curves average runs that share `keys` as seeds: refuse runs (the `load.runs` frame `r`)
    that differ in anything else."""
    if algorithms is not None and len(r):
        r = r[r["algorithm"].isin(algorithms)]
    bad = load.varying(r, keys)
    if bad:
        values = ", ".join(f"{c} = {'/'.join(sorted(map(str, r[c].dropna().unique())))}" for c in bad[:3])
        raise NoRuns(f"{fig_id} averages the runs with the same {', '.join(keys)} over seeds, but these runs also "
                     f"differ in {values}; pass run or sweep folders that differ only in {', '.join(keys)} and seed")


def _finish(fig, number: str, what: str, frame: pd.DataFrame):
    """Title the figure with its number and what it shows, then what the runs were (data, engine, seeds, quick
    or full), and lay it out."""
    runs = frame.drop_duplicates("run_dir")
    bits = []
    for col in ("data", "engine"):
        if col in runs and runs[col].notna().any():
            bits.append("/".join(sorted(map(str, runs[col].dropna().unique()))))
    if "seed" in runs:
        bits.append(f"{runs['seed'].nunique()} seed{'s' if runs['seed'].nunique() > 1 else ''}")
    exps = sorted(map(str, runs["experiment"].dropna().unique())) if "experiment" in runs else []
    if exps:
        bits.append("sweep " + ", ".join(exps))
    fig.suptitle(f"{number}: {what}\n({'; '.join(bits)})", fontsize=10)
    fig.tight_layout()
    return fig


def fig1(paths):
    """(a–c) training loss against worker steps for GEM, DOWNPOUR and adaptive, one line per n; (d) the final
    loss against n."""
    m = runs_for("fig1", paths, ["algorithm", "workers"], ["gem", "downpour", "adaptive"],
                 need="fig1 needs the runs of a fig1 sweep (gem, downpour, adaptive × n)")
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    algos = [a for a in ("gem", "downpour", "adaptive") if a in set(m["algorithm"])]
    palette = plots.colours(sorted(m["workers"].unique()))
    for ax, a in zip(axes[:3], algos, strict=False):
        plots.curves(m[m["algorithm"] == a], ax, x="worker_step", y="loss", hue="workers", palette=palette)
        ax.set_title(a)
    axes[0].legend(fontsize=8)
    plots.same_y(axes[:len(algos)])
    r = load.runs(paths)
    plots.final_loss(r[r["algorithm"].isin(algos)], axes[3], palette=plots.colours(algos))
    axes[3].set_title("final loss (last 10% of commits)")
    axes[3].legend(fontsize=8)
    return _finish(fig, "Fig. 1", "training loss against worker steps, and the final loss against n", m)


def fig2(paths):
    """GEM's training loss against seconds from the first commit, one line per n (100 workers in the paper)."""
    m = plots.since_first_commit(runs_for("fig2", paths, ["workers"], ["gem"],
                                          need="fig2 needs GEM runs (a fig2 sweep)"))
    fig, ax = plt.subplots(figsize=(6, 4))
    plots.curves(m, ax, x="time_s", y="loss", hue="workers")
    ax.set_xlabel("seconds from the first commit")
    ax.legend(fontsize=8)
    return _finish(fig, "Fig. 2", "GEM, training loss against wall-clock seconds", m)


# Fig. 3's median π, read off the paper's plot (DESIGN §5): not measured here, drawn for comparison
PAPER_FIG3 = {5: 0.8, 10: 0.45, 20: 0.15, 30: 0.08}


def fig3(paths):
    """(a) GEM's median π against worker steps, one line per n; (b) the fraction of π clamped to 0 (the median
    is 0 whenever more than half of the elements are); (c, d) both against each commit's own staleness, τ/(n − 1),
    over the second half of every run: the mechanism by which the spread of τ sets the median."""
    m = runs_for("fig3", paths, ["workers"], ["gem"], need="fig3 needs GEM runs (a fig3 or fig1 sweep)")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    palette = plots.colours(sorted(m["workers"].unique()))
    plots.curves(m, axes[0, 0], x="worker_step", y="pi_median", hue="workers", log=False, palette=palette)
    plots.curves(m, axes[0, 1], x="worker_step", y="pi_zero_frac", hue="workers", log=False, palette=palette)
    axes[0, 1].set_ylabel("fraction of π clamped to 0")
    axes[0, 0].legend(fontsize=8)
    by_tau(m, axes[1, 0], axes[1, 1], palette)
    return _finish(fig, "Fig. 3", "GEM's median π (each commit's median over all elements), by worker step and by "
                   "the commit's own staleness", m)


def by_tau(m: pd.DataFrame, ax_median, ax_zero, palette: dict) -> None:
    """Median π and the zero fraction against τ/(n − 1), one line per n (analysis.pi.by_staleness)."""
    s = pi.by_staleness(m)
    for n, g in s.groupby("workers"):
        style = {"color": palette.get(n), "marker": "o", "ms": 4, "lw": 1.2, "label": f"n = {n}"}
        ax_median.plot(g["tau_rel"], g["pi_median"], **style)
        ax_zero.plot(g["tau_rel"], g["pi_zero_frac"], **style)
    for ax, what in ((ax_median, "median π (mean over commits)"), (ax_zero, "fraction of π clamped to 0")):
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")  # round robin's τ = n − 1
        ax.set_xlabel(f"the commit's staleness τ / (n − 1), buckets of {pi.BUCKET:g}; second half of each run")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    ax_median.legend(fontsize=8, title=f"commits ≥ {pi.MIN_COMMITS} per point", title_fontsize=7)


def fig3_cv(paths):
    """Fig. 3 as the spread of the workers' cycle times grows (a fig3_cv sweep, engine.staleness=gamma): (a) the
    mean over the second half of each run of the per-commit median π against n, one line per CV, the paper's
    values beside them; (b) the fraction of π clamped to 0; (c, d) both against each commit's own τ/(n − 1),
    pooled over every CV."""
    need = "fig3_cv needs completed GEM runs with engine.staleness=gamma (a fig3_cv sweep)"
    m = runs_for("fig3_cv", paths, ["engine.cycle_cv", "workers"], ["gem"], need=need)
    other = sorted(set(m["engine.staleness"].dropna()) - {"gamma"})
    if other:  # engine.cycle_cv is a setting of the gamma model only: another model's runs have no CV to plot at
        raise NoRuns(f"fig3_cv plots gamma runs by their engine.cycle_cv, but some of these runs have "
                     f"engine.staleness={'/'.join(other)}; pass the runs of a fig3_cv sweep")
    t = pi.by_run(m, ["engine.cycle_cv", "workers"])
    if t.empty:
        raise NoRuns(need)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    cvs = sorted(t["engine.cycle_cv"].unique())
    pal_cv = dict(zip(cvs, plt.get_cmap("plasma")(np.linspace(0.05, 0.8, len(cvs))), strict=True))
    for cv, g in t.groupby("engine.cycle_cv"):
        for ax, y in ((axes[0, 0], "pi_median"), (axes[0, 1], "pi_zero_frac")):
            ax.errorbar(g["workers"], g[y], yerr=g[f"{y}_std"].fillna(0), color=pal_cv[cv], marker="o", ms=4,
                        capsize=3, lw=1.2, label=f"CV = {cv:g}" + (" (round robin)" if cv == 0 else ""))
    ns = sorted(t["workers"].unique())
    axes[0, 0].plot(list(PAPER_FIG3), list(PAPER_FIG3.values()), "kx", ms=9, mew=2, label="paper (read off Fig. 3)")
    seeds = "/".join(str(s) for s in sorted(t["seeds"].unique()))
    axes[0, 0].set_ylabel(f"median π, mean over the second half ({seeds} seeds; bars: sd)")
    axes[0, 1].set_ylabel("fraction of π clamped to 0")
    for ax in axes[0]:
        ax.set_xlabel("n")
        ax.set_xticks(ns)
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    by_tau(m, axes[1, 0], axes[1, 1], plots.colours(ns))
    return _finish(fig, "Fig. 3 by the spread of cycle times", "GEM's median π as each worker's cycle time varies "
                   "(Gamma, coefficient of variation CV)", m)


def fig4(paths):
    """(a) GEM's training loss against seconds for each n at a fixed effective batch; (b) the speedup to a
    common loss, relative to n = 1."""
    m = plots.since_first_commit(runs_for("fig4", paths, ["workers"], ["gem"],
                                          need="fig4 needs GEM runs on engine=process (a fig4 sweep)"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    plots.curves(m, axes[0], x="time_s", y="loss", hue="workers")
    axes[0].set_xlabel("seconds from the first commit")
    target = plots.common_target(m, "time_s", "workers")
    axes[0].axhline(target, color="grey", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    sp = plots.speedup(m, target)
    ns = sp["workers"].to_numpy()
    if sp["speedup"].notna().any():
        axes[1].plot(ns, sp["speedup"], marker="o", label="GEM")
        axes[1].plot(ns, ns, ls="--", color="grey", label="linear")
        for n, v, k, total in zip(ns, sp["speedup"], sp["reached"], sp["runs"], strict=True):
            axes[1].annotate(f"{k}/{total}", (n, v if np.isfinite(v) else 1.0), textcoords="offset points",
                             xytext=(4, -12), fontsize=7, color="grey")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xticks(ns, [str(n) for n in ns])
        axes[1].legend(fontsize=8)
    else:
        axes[1].text(0.5, 0.5, "not every n = 1 run reached the common loss", ha="center",
                     transform=axes[1].transAxes)
    axes[1].set_ylabel(f"speedup to loss {target:.3g}\n(median time over seeds; k/N seeds got there)")
    axes[1].set_xlabel("n")
    axes[1].grid(True, alpha=0.3)
    return _finish(fig, "Fig. 4", "wall-clock speedup at a fixed effective batch (b = B/n)", m)


def data_epochs(ev: pd.DataFrame) -> pd.Series:
    """Epochs of data behind each evaluation: commits × batch size × window / training examples (a run
    from before `train_examples` was recorded: commits × workers × epochs per worker / all its commits)."""
    window = ev["algorithm.window"].fillna(1) if "algorithm.window" in ev else 1
    if "train_examples" in ev and ev["train_examples"].notna().all():
        return ev["step"] * ev["batch_size"] * window / ev["train_examples"]
    return ev["step"] * ev["workers"] * ev["epochs"] / ev["steps"]


def fig5(paths):
    """GEM against its proxy, momentum SGD: training and validation loss of the central variable against
    epochs of data processed."""
    ev = runs_for("fig5", paths, ["algorithm", "workers"], table="eval",
                  need="fig5 needs evaluation rows of gem and sgd runs (a fig5 sweep)")
    ev = ev[ev["steps"] > 0].assign(epoch=lambda d: data_epochs(d))
    ev["who"] = [f"{a} (n = {n})" if a != "sgd" else "momentum SGD"
                 for a, n in zip(ev["algorithm"], ev["workers"], strict=True)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    palette = plots.colours(sorted(ev["who"].unique()))
    for ax, y in zip(axes, ("train_loss", "val_loss"), strict=False):
        plots.curves(ev, ax, x="epoch", y=y, hue="who", palette=palette, bins=1000)
        ax.set_title(plots.label(y))
    plots.same_y(axes)
    axes[0].legend(fontsize=8)
    return _finish(fig, "Fig. 5", "generalisation: training and validation loss of the central variable", ev)


def fig6(paths):
    """η = 0.1: GEM, DOWNPOUR and momentum SGD, one panel per n. Momentum SGD runs one worker, so its runs are
    the same reference in every panel."""
    m = runs_for("fig6", paths, ["algorithm", "workers"], need="fig6 needs gem, downpour and sgd runs (a fig6 sweep)")
    sgd = m[m["algorithm"] == "sgd"]
    # momentum SGD ignores n, so a fig6 sweep runs it once per n: keep one run per seed (the others are equal;
    # `check` has made sure nothing but n and the seed varies among them)
    sgd = sgd[sgd["run_dir"].isin(sgd.drop_duplicates("seed")["run_dir"])]
    asy = m[m["algorithm"] != "sgd"]
    ns = sorted(asy["workers"].unique()) or [1]
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), squeeze=False)
    palette = plots.colours(sorted(asy["algorithm"].unique(), key=plots.algorithm_order) + ["momentum SGD"])
    for ax, n in zip(axes[0], ns, strict=True):
        panel = pd.concat([asy[asy["workers"] == n], sgd.assign(algorithm="momentum SGD")])
        plots.curves(panel, ax, x="worker_step", y="loss", hue="algorithm", palette=palette)
        ax.set_title(f"n = {n}")
    plots.same_y(axes[0])
    axes[0][0].legend(fontsize=8)
    lr = ", ".join(f"{v:g}" for v in sorted(m["lr"].unique()))
    return _finish(fig, "Fig. 6", f"a misspecified learning rate (η = {lr})", m)


def fig7(paths):
    """AlexNet with n = 8 and 16 GEM workers at a fixed effective batch: training loss and median π against
    worker steps."""
    m = runs_for("fig7", paths, ["workers"], ["gem"], need="fig7 needs GEM runs (a fig7 or fig9_10 sweep)")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    plots.curves(m, axes[0], x="worker_step", y="loss", hue="workers")
    plots.curves(m, axes[1], x="worker_step", y="pi_median", hue="workers", log=False)
    axes[0].legend(fontsize=8)
    return _finish(fig, "Fig. 7", "AlexNet, training loss and median π against worker steps", m)


def fig8(paths):
    """κ, the energy amplification: training loss and median π against worker steps, one line per κ."""
    m = runs_for("fig8", paths, ["algorithm.kappa"], ["gem"],
                 need="fig8 needs GEM runs with several algorithm.kappa (a fig8 sweep)")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    palette = plots.colours(sorted(m["algorithm.kappa"].unique()))
    plots.curves(m, axes[0], x="worker_step", y="loss", hue="algorithm.kappa", palette=palette)
    plots.curves(m, axes[1], x="worker_step", y="pi_median", hue="algorithm.kappa", palette=palette, log=False)
    axes[0].legend(fontsize=8)
    ns = ", ".join(str(n) for n in sorted(m["workers"].unique()))
    return _finish(fig, "Fig. 8", f"GEM with κ ∈ {{{', '.join(f'{k:g}' for k in sorted(palette))}}}, n = {ns}", m)


def heatmaps(paths, ns=None, number="Figs. 9 and 10"):
    t = runs_for("the π heatmaps", paths, ["workers"], ["gem"], table="tensors",
                 need="the π heatmaps need the per-tensor rows of GEM runs (a fig9_10 or fig7 sweep)")
    ns = [n for n in (ns or sorted(t["workers"].unique())) if n in set(t["workers"])]
    if not ns:
        raise NoRuns("the π heatmaps need GEM runs with the requested number of workers")
    fig, axes = plt.subplots(1, len(ns), figsize=(7 * len(ns), 4.5), squeeze=False)
    chosen = []
    for n in ns:  # one run per panel: the lowest seed's
        tn = t[t["workers"] == n]
        run = tn[tn["seed"] == tn["seed"].min()]
        chosen.append(run[run["run_dir"] == run["run_dir"].iloc[0]])
    # one colour scale for every panel, so that they compare; a few spikes to π_max should not wash it out
    vmax = max(1.0, float(pd.concat(chosen)["pi_median"].quantile(0.99)))
    for ax, n, run in zip(axes[0], ns, chosen, strict=True):
        seed = run["seed"].iloc[0]
        image = plots.pi_heatmap(run, ax, vmax=vmax)
        ax.set_title(f"n = {n} (seed {seed})")
        fig.colorbar(image, ax=ax, label="median π of the tensor")
    return _finish(fig, number, "per-tensor median π against parameter-server updates", t)


def fig9(paths):
    """The per-tensor median π heatmap with 8 workers."""
    return heatmaps(paths, [8], "Fig. 9")


def fig10(paths):
    """The per-tensor median π heatmap with 16 workers."""
    return heatmaps(paths, [16], "Fig. 10")


def fig9_10(paths):
    """Both heatmaps side by side (every n in the sweep)."""
    return heatmaps(paths)


FIGURES = {"fig1": fig1, "fig2": fig2, "fig3": fig3, "fig3_cv": fig3_cv, "fig4": fig4, "fig5": fig5, "fig6": fig6,
           "fig7": fig7, "fig8": fig8, "fig9": fig9, "fig10": fig10, "fig9_10": fig9_10}
