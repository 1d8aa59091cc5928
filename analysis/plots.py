"""Plots in the paper's style, drawn from the tidy frames of `analysis.load`.

    from analysis import load, plots
    m = load.commits(sweep)                                # one row per commit, with its run's config
    fig, ax = plt.subplots()
    plots.curves(m[m.algorithm == "gem"], ax, x="worker_step", y="loss", hue="workers", band="ci")

Every curve is one line per `hue` value: the mean over the completed runs that share it (the seeds; how many is
in its legend entry), with a band over those runs: from the lowest to the highest (`band="minmax"`), or the 95%
Student's t interval of the mean (`band="ci"`, `analysis.stats.ci_frame`), or none. A run's rows are first
averaged into bins along x (so the commits of n workers at the same worker step become one point), and empty
bins inside the run are interpolated, so that seeds line up on one grid; that is the only smoothing.

Only completed runs are averaged (a frame without a `status` column counts as all completed). Every other run is
drawn on its own, thin, and never averaged in: a diverged run dashed up to a cross at its last finite point; a
failed or incomplete one (killed before its summary) dotted, up to a square (failed) or an open circle
(incomplete) at its last point. A value of `hue` with no completed run gets a legend entry for those runs, and a
panel with no completed run says so. Losses go on a log scale, as in the paper, cut at 10x where the curves
start and, for a t interval, at the lowest value a seed reached in the panel (with 2–3 seeds the interval of a
noisy loss often reaches 0), with plain tick labels (0.2, 0.5, 1) rather than 2×10⁻¹ (`log_y`).

A helper given a frame without a column it needs raises one line, `ValueError("plots.curves: the frame has no
column 'worker_step'; it has: ...")`.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402

from analysis.stats import ci_frame, mean_ci  # noqa: E402

# Text sizes for figures about 10 in wide, two panels to a row, shown at the width of a page
plt.rcParams.update(
    {
        "font.size": 11,
        "axes.titlesize": 12,
        "axes.labelsize": 11,
        "xtick.labelsize": 10,
        "ytick.labelsize": 10,
        "legend.fontsize": 9,
        "figure.titlesize": 12,
    }
)

OFF_SCALE = 10.0  # loss axes stop at 10x the starting loss; a run beyond it is diverging, marked, not scaled to
BINS = 200  # points per curve: enough to show a spike, few enough to average the commits of 30 workers
LABELS = {
    "worker_step": "worker steps",
    "step": "parameter server updates",
    "time_s": "seconds",
    "epoch": "epochs of data",
    "loss": "training loss",
    "pi_median": "median π",
    "val_loss": "validation loss",
    "train_loss": "training loss",
    "workers": "n",
    "algorithm.kappa": "κ",
}
BANDS = {
    "minmax": "min–max over seeds",
    "ci": "95% t interval of the mean over seeds (on a log axis its lower edge stops at the lowest seed)",
    None: "no band",
}
# How a run that is not averaged in is drawn: line style and the marker at its last point
APART = {"diverged": ("--", "x"), "failed": (":", "s"), "incomplete": (":", "o")}


def end_marker(marker: str, colour) -> dict:
    """How the last point of a run drawn apart is marked (by `curves`, and in a legend entry for such runs)."""
    return {
        "marker": marker,
        "ms": 7 if marker == "x" else 5,
        "mew": 2 if marker == "x" else 1.2,
        "mfc": "white" if marker == "o" else colour,
    }


LOG_Y = ("loss", "val_loss", "train_loss", "final_train_loss")


def require(frame: pd.DataFrame, columns, who: str) -> None:
    """Refuse, in one line, a frame that lacks one of `columns` (None entries are skipped)."""
    for c in columns:
        if c is not None and c not in frame.columns:
            have = ", ".join(map(str, frame.columns)) or "no columns"
            where = who if "." in who else f"plots.{who}"  # a caller outside plots names its own module
            raise ValueError(f"{where}: the frame has no column {c!r}; it has: {have}")


def statuses(frame: pd.DataFrame) -> pd.Series:
    """Each row's run status; a frame without a `status` column is all `completed`, a missing status (a run
    still going on W&B) `incomplete`."""
    if "status" not in frame.columns:
        return pd.Series("completed", index=frame.index, dtype=object)
    return frame["status"].fillna("incomplete").astype(str)


def completed(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of completed runs: the only ones a mean, a band or a final loss is taken over."""
    return frame[statuses(frame) == "completed"]


def band_kind(band) -> str | None:
    """`band` as one of BANDS: True is "minmax" (the old default), False and None no band."""
    if band is True:
        return "minmax"
    if band is False or band is None or band == "none":
        return None
    if band in BANDS:
        return band
    raise ValueError(f"plots: band must be 'minmax', 'ci' or None, not {band!r}")


def band_text(band) -> str:
    """What a figure's curves are, for its title: the mean over completed seeds and the band."""
    kind = band_kind(band)
    return "lines: mean over the completed seeds (how many: legend); " + (
        "no band" if kind is None else f"band: {BANDS[kind]}"
    )


def seeds_text(k: int) -> str:
    return f"{k} seed{'s' if k != 1 else ''}"


class PlainLogFormatter(ticker.LogFormatterSciNotation):
    """Log-axis tick labels as plain numbers (0.2, 0.5, 1, 20) from 0.001 to 10⁴, powers of ten beyond. The
    default writes the minor ticks it labels on an axis spanning less than a decade as 2×10⁻¹."""

    def __call__(self, x, pos=None):
        text = super().__call__(x, pos)
        if not text or not 1e-3 <= abs(x) < 1e4:
            return text
        return f"{x:g}"


def log_y(ax) -> None:
    """A log y-axis with plain tick labels, major and minor: every loss axis goes through here."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PlainLogFormatter())
    ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))


def note(ax, text: str) -> None:
    """Say in the middle of a panel why it has no curve (never an empty panel without a word)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="dimgrey", wrap=True)


def legend(ax, **kwargs) -> None:
    """A legend when the panel has labelled artists (an empty panel gets none, and no warning)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def algorithm_order(name: str) -> int:
    """The paper's order: the proxy, GEM, then the baselines (gem.algorithms.ALGORITHMS)."""
    from gem.algorithms import ALGORITHMS

    return ALGORITHMS.index(name) if name in ALGORITHMS else len(ALGORITHMS)


def label(key: str) -> str:
    return LABELS.get(key, key)


def binned(run: pd.DataFrame, x: str, y: str, edges: np.ndarray) -> pd.Series:
    """One run's y averaged within the bins of x given by `edges`; indexed by bin centre. Non-finite y (a
    diverged run) are dropped."""
    v = run[[x, y]].replace([np.inf, -np.inf], np.nan).dropna()
    if v.empty:
        return pd.Series(dtype=float)
    centres = (edges[:-1] + edges[1:]) / 2
    return v[y].groupby(centres[bin_of(v[x], edges)]).mean()


def bin_of(values: pd.Series, edges: np.ndarray) -> np.ndarray:
    """The bin of each value (values beyond the edges go to the first or last bin)."""
    return np.clip(np.searchsorted(edges, values.to_numpy(), side="right") - 1, 0, len(edges) - 2)


def edges_for(values: pd.Series, bins: int = BINS) -> np.ndarray:
    """Bin edges from 0 to the largest x: integer-aligned for counts (worker steps, updates), so a bin
    never splits a step."""
    hi = float(values.max()) if len(values) else 1.0
    lo = min(0.0, float(values.min())) if len(values) else 0.0
    if pd.api.types.is_integer_dtype(values) or (len(values) and np.allclose(values, np.round(values))):
        first = float(np.floor(values.min())) if len(values) else 0.0  # 1 for worker steps, 0 for evaluations
        width = max(1, math.ceil((hi - first + 1) / bins))
        return np.arange(first - 0.5, hi + width + 0.5, width, dtype=float)
    return np.linspace(lo, hi + abs(hi) * 1e-9 + 1e-12, bins + 1)


def on_grid(run: pd.DataFrame, x: str, y: str, edges: np.ndarray) -> pd.Series:
    """One run on the bin centres of `edges`: its bin means, with the empty bins inside the run's own range
    filled by linear interpolation. Seeds of a process run commit at different seconds, so without this most
    time bins would hold a single seed and the "mean over seeds" would zig-zag between them."""
    b = binned(run, x, y, edges)
    if len(b) < 2:
        return b
    centres = (edges[:-1] + edges[1:]) / 2
    inside = centres[(centres >= b.index.min()) & (centres <= b.index.max())]
    return b.reindex(inside).interpolate(method="index")


def smooth(curve: pd.Series, window: int) -> pd.Series:
    """A centred rolling mean over `window` bins (1: unchanged)."""
    return curve if window <= 1 else curve.rolling(window, center=True, min_periods=1).mean()


AGGREGATE = ["mean", "lo", "hi", "ci_lo", "ci_hi", "runs", "seeds"]


def aggregate(frame: pd.DataFrame, x: str, y: str, hue: str, bins: int = BINS) -> pd.DataFrame:
    """Tidy curves: one row per (hue, x bin) over the completed runs (`curves` draws the others on their own;
    averaged in, a diverged loss of 1e30 would be the mean, a killed run would end the mean in a step): the
    mean; lo and hi, the lowest and highest run; ci_lo and ci_hi, the 95% t interval of the mean
    (`analysis.stats.ci_frame`; equal to the mean where one run has a value); runs, how many runs have a value
    in that bin; seeds, how many runs the curve is over."""
    require(frame, [x, y, hue, "run_dir"], "aggregate")
    out = []
    for key, group in completed(frame).groupby(hue, sort=True, dropna=False):
        edges = edges_for(group[x], bins)
        per_run = pd.DataFrame({r: on_grid(g, x, y, edges) for r, g in group.groupby("run_dir")})
        per_run = per_run.loc[:, per_run.notna().any()] if len(per_run.columns) else per_run
        if per_run.empty:
            continue
        ci = ci_frame(per_run)
        out.append(
            pd.DataFrame(
                {
                    hue: key,
                    x: per_run.index,
                    "mean": ci["mean"],
                    "lo": per_run.min(axis=1),
                    "hi": per_run.max(axis=1),
                    "ci_lo": ci["lo"],
                    "ci_hi": ci["hi"],
                    "runs": ci["runs"],
                    "seeds": per_run.shape[1],
                }
            )
        )
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=[hue, x, *AGGREGATE])


def _fmt(hue: str, value) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{label(hue)} = {value}" if hue in ("workers", "algorithm.kappa") else str(value)


# tab10, then four darker hues that no tab10 colour is close to: the twelve algorithms of the baselines, each its own
NAMED = [matplotlib.colors.to_rgba(c) for c in plt.get_cmap("tab10").colors] + [
    matplotlib.colors.to_rgba(c) for c in ("black", "#00008b", "#8b0000", "#556b2f")
]


def colours(values) -> dict:
    """Distinct colours for names (algorithms: `NAMED`, up to 14), a sequential scale for many ordered numbers.
    More than 10 names that are variants of at most 14 algorithms ("downpour lr=0.025", "downpour lr=0.05": the
    algorithm is the first word) take their algorithm's colour, each further variant a lighter shade of it: on a
    sequential scale two algorithms next to each other were indistinguishable (12 algorithms drew as 12 greens)."""
    values = list(values)
    names = all(isinstance(v, str) for v in values)
    heads = list(dict.fromkeys(v.split(" ")[0] for v in values)) if names else []
    if names and len(heads) < len(values) and len(values) > 10 and len(heads) <= len(NAMED):
        out = {}
        for i, head in enumerate(heads):
            mine = [v for v in values if v.split(" ")[0] == head]
            for k, v in enumerate(mine):
                lighter = 0.55 * k / max(len(mine) - 1, 1)  # the first variant in the algorithm's own colour
                out[v] = tuple((1 - lighter) * c + lighter for c in NAMED[i][:3]) + (1.0,)
        return out
    if len(values) <= (len(NAMED) if names else 6):
        return {v: NAMED[i] for i, v in enumerate(values)}
    cmap, n = plt.get_cmap("viridis"), len(values) - 1  # many numbers (or names): ordered
    return {v: cmap(i / n) for i, v in enumerate(values)}


def floor(lo: pd.Series) -> float:
    """Where a log axis cuts a t interval: the lowest value any seed reached in the panel (`lo`). With 2–3 seeds
    the interval of a noisy loss often reaches 0 or below; drawn in full it would stretch the axis over decades
    where no run went."""
    v = lo.astype(float)
    v = v[np.isfinite(v) & (v > 0)]
    return float(v.min()) if len(v) else math.nan


def _band(c: pd.DataFrame, kind: str, bottom: float | None) -> tuple[pd.Series, pd.Series]:
    """The band's edges; on a log axis (`bottom` given) a t interval is cut at `bottom`."""
    if kind == "minmax":
        return c["lo"], c["hi"]
    lo = c["ci_lo"].clip(lower=bottom) if bottom is not None and np.isfinite(bottom) else c["ci_lo"]
    return lo, c["ci_hi"]


def curves(
    frame: pd.DataFrame,
    ax,
    x: str = "worker_step",
    y: str = "loss",
    hue: str = "workers",
    log: bool | None = None,
    bins: int = BINS,
    palette: dict | None = None,
    band="minmax",
    seeds: bool = True,
) -> pd.DataFrame:
    """Mean over the completed seeds, one line per value of `hue`, labelled with how many seeds (`seeds`), and
    a band (`band`: "minmax", "ci" or None; True/False as "minmax"/None); every other run on its own (the
    module's docstring says how). Returns the aggregated frame (`aggregate`: completed runs only)."""
    require(frame, [x, y, hue, "run_dir"], "curves")
    kind = band_kind(band)
    agg = aggregate(frame, x, y, hue, bins)
    own = apart(frame, x, y, hue, bins)
    values = sorted(set(agg[hue]) | set(own[hue]), key=lambda v: (isinstance(v, str), v))
    if palette:  # the caller's order (the paper's order of algorithms, say), for the legend too
        order = {v: i for i, v in enumerate(palette)}
        values = sorted(values, key=lambda v: order.get(v, len(order)))
    palette = palette or colours(values)
    log = log if log is not None else y in LOG_Y
    if log and (len(agg) or len(own)):
        log_y(ax)
    tops = []
    bottom = floor(agg["lo"]) if log else None
    for v in values:
        c = agg[agg[hue] == v]
        if c.empty:  # no run of this value completed: drawn below, on its own
            continue
        name = _fmt(hue, v) + (f" ({seeds_text(int(c['seeds'].iloc[0]))})" if seeds else "")
        ax.plot(c[x], c["mean"], color=palette[v], lw=1.4, label=name)
        hi = c["mean"]
        if kind and c["runs"].max() > 1:
            lo, hi = _band(c, kind, bottom)
            ax.fill_between(c[x], lo, hi, color=palette[v], alpha=0.2, lw=0)
        tops.append(pd.DataFrame({hue: v, x: c[x], "top": hi}))
    top = None
    if log and (tops or len(own)):
        # a diverging run reaches 1e30: keep the scale on the others, at most 10x where the curves start
        both = pd.concat([*tops, own.rename(columns={y: "top"})[[hue, x, "top"]]])
        start = both.sort_values(x).groupby(hue)["top"].first().median()
        if np.isfinite(start) and start > 0 and both["top"].max() > OFF_SCALE * start:
            top = OFF_SCALE * start
    labelled = set(agg[hue])
    counts = own.drop_duplicates("run_dir").groupby(hue)["status"].value_counts()
    for (v, _), d in own.groupby([hue, "run_dir"], sort=False):
        if v not in palette:
            continue
        status = d["status"].iloc[0]
        ls, marker = APART.get(status, APART["incomplete"])
        shown = d[y].clip(upper=top) if top is not None else d[y]
        name = None
        if v not in labelled:  # a legend entry when nothing else has one
            c = counts.loc[v]
            what = status if c.sum() == 1 else ", ".join(f"{k} {s}" for s, k in c.items())
            name = f"{_fmt(hue, v)} ({what})"
            labelled.add(v)
        ax.plot(d[x], shown, color=palette[v], lw=0.9, ls=ls, alpha=0.8, label=name)
        ax.plot(
            d[x].iloc[-1:],
            shown.iloc[-1:],
            color=palette[v],
            ls="none",
            clip_on=False,
            **end_marker(marker, palette[v]),
        )
    if top is not None:
        ax.set_ylim(top=top)
    if agg.empty:
        note(ax, "no completed run" if len(frame) else "no runs")
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    ax.grid(True, which="major", alpha=0.3)
    return agg


def same_y(axes) -> None:
    """One y-range for panels that are compared side by side: the union of their (already capped) ranges.
    Panels with nothing drawn (a note only) are left alone."""
    axes = [ax for ax in axes if ax.has_data()]
    lims = [ax.get_ylim() for ax in axes]
    for ax in axes:
        ax.set_ylim(min(lo for lo, _ in lims), max(hi for _, hi in lims))


def apart(frame: pd.DataFrame, x: str, y: str, hue: str, bins: int = BINS) -> pd.DataFrame:
    """Each run that is not averaged in (diverged, failed, incomplete), binned on its hue's grid, up to its last
    finite point: columns hue, run_dir, status, x, y."""
    cols = [hue, "run_dir", "status", x, y]
    s = statuses(frame)
    out = []
    for (v, r), g in frame[s != "completed"].groupby([hue, "run_dir"], sort=True):
        b = binned(g, x, y, edges_for(frame.loc[frame[hue] == v, x], bins))
        if len(b):
            out.append(pd.DataFrame({hue: v, "run_dir": r, "status": s[g.index[0]], x: b.index, y: b.to_numpy()}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def bar(values, band) -> tuple[float, float, float, int]:
    """A mean over seeds and the edges of its error bar for `band` (min–max, the 95% t interval, none: the
    mean itself): (mean, lo, hi, k). Non-finite values are not seeds (`analysis.stats.mean_ci`)."""
    v = pd.to_numeric(pd.Series(values), errors="coerce")
    v = v[np.isfinite(v)]
    a, kind = mean_ci(v), band_kind(band)
    if kind == "minmax" and a.k:
        return a.mean, float(v.min()), float(v.max()), a.k
    if kind == "ci" and a.k > 1:
        return a.mean, a.lo, a.hi, a.k
    return a.mean, a.mean, a.mean, a.k


def final_loss(
    runs: pd.DataFrame,
    ax,
    x: str = "workers",
    hue: str = "algorithm",
    y: str = "final_train_loss",
    palette: dict | None = None,
    band="minmax",
) -> pd.DataFrame:
    """Fig. 1(d): a run's final loss against n, the mean over the completed seeds with error bars (`band`:
    min–max, the 95% t interval, or none), one line per hue labelled with how many seeds. Only completed runs
    count: a diverged run has no final loss worth averaging (curves marks it), a killed one has none. Returns one
    row per (hue, x): the lowest seed, the mean, the bar's edges lo and hi (`bar`) and the count of seeds."""
    require(runs, [x, hue, y], "final_loss")
    kind = band_kind(band)
    r = completed(runs)
    r = r[np.isfinite(pd.to_numeric(r[y], errors="coerce"))]
    rows = [
        {hue: h, x: v, "min": g[y].min(), **dict(zip(("mean", "lo", "hi", "count"), bar(g[y], band), strict=True))}
        for (h, v), g in r.groupby([hue, x])
    ]
    agg = pd.DataFrame(rows, columns=[hue, x, "min", "mean", "lo", "hi", "count"])
    palette = palette or colours(sorted(agg[hue].unique()))
    log_y(ax)
    ys = agg[["mean", "lo", "hi"]].to_numpy(dtype=float)
    ys = ys[np.isfinite(ys) & (ys > 0)]
    if len(ys) and ys.min() == ys.max():  # one point, no spread (one run): a decade around it, set before the
        ax.set_ylim(ys.min() / 3, ys.max() * 3)  # point is drawn (autoscaling to it warned of an empty range)
    bottom = floor(agg["min"])  # a t interval reaching 0 or below is cut at the lowest seed in the panel
    for v in [v for v in palette if v in set(agg[hue])]:  # the palette's order, as in the curves' legends
        g = agg[agg[hue] == v]
        lo = g["lo"].clip(lower=bottom) if np.isfinite(bottom) else g["lo"]
        yerr = None if kind is None else [(g["mean"] - lo).fillna(0), (g["hi"] - g["mean"]).fillna(0)]
        k = sorted(set(g["count"]))
        ks = seeds_text(k[0]) if len(k) == 1 else f"{k[0]}–{k[-1]} seeds"
        ax.errorbar(g[x], g["mean"], yerr=yerr, marker="o", capsize=3, color=palette[v], label=f"{v} ({ks})")
        for at, mean, count in zip(g[x], g["mean"], g["count"], strict=True):
            if count < k[-1]:  # fewer seeds here than elsewhere on this line: say how many
                ax.annotate(
                    f"k={count}", (at, mean), textcoords="offset points", xytext=(5, 4), fontsize=8, color=palette[v]
                )
    if agg.empty:
        note(ax, "no completed run")
    ax.set_xlabel(label(x))
    ax.set_ylabel("final " + label("loss"))
    ax.set_xticks(sorted(agg[x].unique()))
    ax.grid(True, which="major", alpha=0.3)
    return agg


def pi_heatmap(
    tensors: pd.DataFrame,
    ax,
    value: str = "pi_median",
    bins: int = BINS,
    vmax: float | None = None,
    quantile: float | None = None,
    gamma: float = 1.0,
):
    """Figs. 9/10: the per-tensor median π (rows, in the model's order) against parameter-server updates
    (columns, binned: the mean over the commits in a bin, as a downsampled image would). Colours run from 0 to
    `vmax`, or to the `quantile` of the cells drawn (so that a few spikes do not wash the rest out), or to the
    largest; `gamma` < 1 spreads the low values (a power-law scale, matplotlib's PowerNorm). Returns the image
    for a colour bar."""
    require(tensors, ["step", "tensor_index", "tensor", value], "pi_heatmap")
    t = tensors.sort_values("tensor_index")
    names = t.drop_duplicates("tensor_index").set_index("tensor_index")["tensor"]
    edges = edges_for(t["step"], bins)
    grid = (
        t.assign(bin=bin_of(t["step"], edges))
        .groupby(["tensor_index", "bin"])[value]
        .mean()
        .unstack("bin")
        .reindex(index=names.index, columns=range(len(edges) - 1))
    ).to_numpy(dtype=float)
    finite = grid[np.isfinite(grid)]
    if vmax is None and quantile is not None and finite.size:
        vmax = float(np.quantile(finite, quantile))
    if vmax is None or not np.isfinite(vmax) or vmax <= 0:
        vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    norm = matplotlib.colors.PowerNorm(gamma, vmin=0.0, vmax=vmax)
    image = ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap="magma",
        norm=norm,
        origin="upper",
        extent=(edges[0], edges[-1], len(names) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names.tolist(), fontsize=8)
    ax.set_xlabel(label("step"))
    return image


def time_to_target(
    frame: pd.DataFrame,
    target: float,
    x: str = "worker_step",
    y: str = "loss",
    bins: int = BINS,
    window: int = 5,
    group: str | None = None,
) -> pd.DataFrame:
    """For each run, the first x (and the seconds) at which its curve is at or below `target`; NaN when it never
    gets there. The curve is the one `curves` draws (bins shared by the runs of a `group`, e.g. one n), smoothed
    over `window` bins so that one lucky batch does not count as arriving. Every run is measured, whatever its
    status (the caller decides which count)."""
    require(frame, ["run_dir", x, y, group], "time_to_target")
    out = []
    groups = frame.groupby(group) if group else [(None, frame)]
    for _, members in groups:
        edges = edges_for(members[x], bins)
        for run_dir, g in members.groupby("run_dir"):
            curve = smooth(on_grid(g, x, y, edges), window)
            hit = curve[curve <= target]
            rec = {"run_dir": run_dir, x: np.nan, "time_s": np.nan}
            if len(hit):
                at = hit.index[0]
                if "time_s" in g:  # the run's clock at x = at (interpolated: a bin may hold no commit of its own)
                    clock = g.groupby(x)["time_s"].median()
                    rec["time_s"] = float(np.interp(at, clock.index.to_numpy(float), clock.to_numpy(float)))
                rec[x] = at  # after time_s: when x is time_s, the bin centre is the answer
            out.append(rec)
    return pd.DataFrame(out, columns=list(dict.fromkeys(["run_dir", x, "time_s"])))


def common_target(frame: pd.DataFrame, x: str, hue: str, y: str = "loss", window: int = 10) -> float:
    """A loss that every `hue` curve (completed runs) reaches by its end: the highest of their smoothed final
    values, plus 5%; NaN when no run completed."""
    agg = aggregate(frame, x, y, hue)
    ends = [smooth(c.set_index(x)["mean"], window).iloc[-1] for _, c in agg.groupby(hue)]
    return float(max(ends)) * 1.05 if ends else math.nan


def speedup(
    frame: pd.DataFrame, target: float, x: str = "time_s", by: str = "workers", base=1, window: int = 5
) -> pd.DataFrame:
    """Per value of `by`: the median time to `target` over the runs that ended (completed or diverged: a
    failed or killed run is left out, it might have got there), how many of them reached it, and the speedup
    over `by == base`. A value where not every run got there has no speedup (NaN): the median of the survivors
    would flatter it."""
    require(frame, ["run_dir", x, by, "loss"], "speedup")
    frame = frame[statuses(frame).isin(["completed", "diverged"])]
    hit = time_to_target(frame, target, x=x, group=by, window=window)
    hit = hit.merge(frame.drop_duplicates("run_dir")[["run_dir", by]])
    t = hit.groupby(by).agg(time=(x, "median"), reached=(x, "count"), runs=(x, "size"))
    complete = t["reached"] == t["runs"]
    t["time"] = t["time"].where(complete)
    t["speedup"] = t.loc[base, "time"] / t["time"] if base in t.index else np.nan
    return t.reset_index()


def since_first_commit(m: pd.DataFrame) -> pd.DataFrame:
    """time_s counted from each run's first commit: starting n processes is not training (on 2 cores, 16 spawns
    take several seconds), and the paper's clocks start with training."""
    require(m, ["run_dir", "time_s"], "since_first_commit")
    return m.assign(time_s=m["time_s"] - m.groupby("run_dir")["time_s"].transform("min"))


def save(fig, out_dir, name: str, formats=("png", "pdf")) -> list:
    """Write `fig` as <out_dir>/<name>.<fmt> for each format; returns the paths."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        p = out / f"{name}.{fmt}"
        fig.savefig(p, dpi=150, bbox_inches="tight")
        paths.append(p)
    plt.close(fig)
    return paths
