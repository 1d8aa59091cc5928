"""Plots in the paper's style, drawn from the tidy frames of `analysis.load`.

    from analysis import load, plots
    m = load.commits(sweep)                                # one row per commit, with its run's config
    fig, ax = plt.subplots()
    plots.curves(m[m.algorithm == "gem"], ax, x="worker_step", y="loss", hue="workers")

Every curve is one line per `hue` value: the mean over the runs that share it (the seeds), with a band from the
lowest to the highest run. A run's rows are first averaged into bins along x (so the commits of n workers at
the same worker step become one point), and empty bins inside the run are interpolated, so that seeds line up
on one grid; that is the only smoothing. A run that diverged is left out of the mean and drawn on its own,
dashed, up to a cross at its last finite point. Losses go on a log scale, as in the paper, cut at 10x where the
curves start.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

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


def aggregate(frame: pd.DataFrame, x: str, y: str, hue: str, bins: int = BINS) -> pd.DataFrame:
    """Tidy curves: one row per (hue, x bin) with the mean, min and max over runs and how many runs had a
    value there. Diverged runs are left out (`curves` draws them on their own): averaged in, a loss of 1e30
    would be the mean."""
    out = []
    if "status" in frame.columns:
        frame = frame[frame["status"] != "diverged"]
    for key, group in frame.groupby(hue, sort=True, dropna=False):
        edges = edges_for(group[x], bins)
        per_run = pd.DataFrame({r: on_grid(g, x, y, edges) for r, g in group.groupby("run_dir")})
        if per_run.empty:
            continue
        out.append(pd.DataFrame({hue: key, x: per_run.index, "mean": per_run.mean(axis=1),
                                 "lo": per_run.min(axis=1), "hi": per_run.max(axis=1),
                                 "runs": per_run.notna().sum(axis=1)}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=[hue, x, "mean", "lo", "hi", "runs"])


def _fmt(hue: str, value) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{label(hue)} = {value}" if hue in ("workers", "algorithm.kappa") else str(value)


def colours(values) -> dict:
    """Distinct colours for names (algorithms: tab10, up to 10), a sequential scale for many ordered numbers."""
    values = list(values)
    ordered = len(values) > (10 if all(isinstance(v, str) for v in values) else 6)
    cmap = plt.get_cmap("viridis" if ordered else "tab10")
    n = max(len(values) - 1, 1)
    return {v: cmap(i / n if ordered else i) for i, v in enumerate(values)}


def curves(frame: pd.DataFrame, ax, x: str = "worker_step", y: str = "loss", hue: str = "workers",
           log: bool | None = None, bins: int = BINS, palette: dict | None = None, band: bool = True) -> pd.DataFrame:
    """Mean over seeds with a min–max band, one line per value of `hue`; each diverged run on its own, dashed,
    up to a cross at its last finite point. Returns the aggregated frame (completed and failed runs)."""
    agg = aggregate(frame, x, y, hue, bins)
    values = sorted(set(agg[hue]) | set(frame.loc[frame.get("status", pd.Series(dtype=str)) == "diverged", hue]),
                    key=lambda v: (isinstance(v, str), v))
    if palette:  # the caller's order (the paper's order of algorithms, say), for the legend too
        order = {v: i for i, v in enumerate(palette)}
        values = sorted(values, key=lambda v: order.get(v, len(order)))
    palette = palette or colours(values)
    for v in values:
        c = agg[agg[hue] == v]
        if c.empty:  # every run of this value diverged: drawn below, on its own
            continue
        ax.plot(c[x], c["mean"], color=palette[v], lw=1.4, label=_fmt(hue, v))
        if band and c["runs"].max() > 1:
            ax.fill_between(c[x], c["lo"], c["hi"], color=palette[v], alpha=0.2, lw=0)
    diverged = _diverged(frame, x, y, hue, bins)
    log = log if log is not None else y in ("loss", "val_loss", "train_loss")
    top = None
    if log and (len(agg) or len(diverged)):
        ax.set_yscale("log")
        # a diverging run reaches 1e30: keep the scale on the others, at most 10x where the curves start
        both = pd.concat([agg[[hue, x, "hi"]], diverged.rename(columns={y: "hi"})[[hue, x, "hi"]]])
        start = both.sort_values(x).groupby(hue)["hi"].first().median()
        if np.isfinite(start) and start > 0 and both["hi"].max() > OFF_SCALE * start:
            top = OFF_SCALE * start
    labelled = set(agg[hue])
    for (v, _), d in diverged.groupby([hue, "run_dir"]):
        if v not in palette:
            continue
        shown = d[y].clip(upper=top) if top is not None else d[y]
        name = None if v in labelled else _fmt(hue, v) + " (diverged)"  # a legend entry when nothing else has one
        labelled.add(v)
        ax.plot(d[x], shown, color=palette[v], lw=0.9, ls="--", alpha=0.8, label=name)
        ax.plot(d[x].iloc[-1:], shown.iloc[-1:], marker="x", ms=8, mew=2, color=palette[v], ls="none",
                clip_on=False)
    if top is not None:
        ax.set_ylim(top=top)
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    ax.grid(True, which="major", alpha=0.3)
    return agg


def same_y(axes) -> None:
    """One y-range for panels that are compared side by side: the union of their (already capped) ranges."""
    lims = [ax.get_ylim() for ax in axes]
    for ax in axes:
        ax.set_ylim(min(lo for lo, _ in lims), max(hi for _, hi in lims))


def _diverged(frame, x, y, hue, bins) -> pd.DataFrame:
    """Each diverged run's own binned curve, up to its last finite point."""
    cols = [hue, "run_dir", x, y]
    if "status" not in frame.columns:
        return pd.DataFrame(columns=cols)
    out = []
    for (v, r), g in frame[frame["status"] == "diverged"].groupby([hue, "run_dir"]):
        b = binned(g, x, y, edges_for(frame.loc[frame[hue] == v, x], bins))
        if len(b):
            out.append(pd.DataFrame({hue: v, "run_dir": r, x: b.index, y: b.to_numpy()}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def final_loss(runs: pd.DataFrame, ax, x: str = "workers", hue: str = "algorithm",
               y: str = "final_train_loss", palette: dict | None = None) -> pd.DataFrame:
    """Fig. 1(d): a run's final loss against n, mean over seeds with min–max error bars, one line per hue.
    Only runs that completed count: a diverged run has no final loss worth averaging (curves marks it)."""
    r = runs[runs["status"] == "completed"].dropna(subset=[y]) if "status" in runs else runs.dropna(subset=[y])
    agg = r.groupby([hue, x])[y].agg(["mean", "min", "max", "count"]).reset_index()
    palette = palette or colours(sorted(agg[hue].unique()))
    for v in [v for v in palette if v in set(agg[hue])]:  # the palette's order, as in the curves' legends
        g = agg[agg[hue] == v]
        ax.errorbar(g[x], g["mean"], yerr=[g["mean"] - g["min"], g["max"] - g["mean"]], marker="o", capsize=3,
                    color=palette[v], label=str(v))
    ax.set_yscale("log")
    ax.set_xlabel(label(x))
    ax.set_ylabel("final " + label("loss"))
    ax.set_xticks(sorted(agg[x].unique()))
    ax.grid(True, which="major", alpha=0.3)
    return agg


def pi_heatmap(tensors: pd.DataFrame, ax, value: str = "pi_median", bins: int = BINS, vmax: float | None = None):
    """Figs. 9/10: the per-tensor median π (rows, in the model's order) against parameter-server updates
    (columns, binned: the mean over the commits in a bin, as a downsampled image would). Returns the image for
    a colour bar."""
    t = tensors.sort_values("tensor_index")
    names = t.drop_duplicates("tensor_index").set_index("tensor_index")["tensor"]
    edges = edges_for(t["step"], bins)
    grid = (t.assign(bin=bin_of(t["step"], edges)).groupby(["tensor_index", "bin"])[value].mean().unstack("bin")
            .reindex(index=names.index, columns=range(len(edges) - 1)))
    image = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", interpolation="nearest", cmap="magma",
                      origin="upper", extent=(edges[0], edges[-1], len(names) - 0.5, -0.5), vmin=0, vmax=vmax)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names.tolist(), fontsize=7)
    ax.set_xlabel(label("step"))
    return image


def time_to_target(frame: pd.DataFrame, target: float, x: str = "worker_step", y: str = "loss",
                   bins: int = BINS, window: int = 5, group: str | None = None) -> pd.DataFrame:
    """For each run, the first x (and the seconds) at which its curve is at or below `target`; NaN when it never
    gets there. The curve is the one `curves` draws (bins shared by the runs of a `group`, e.g. one n), smoothed
    over `window` bins so that one lucky batch does not count as arriving."""
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
    """A loss that every `hue` curve reaches by its end: the highest of their smoothed final values, plus 5%."""
    agg = aggregate(frame, x, y, hue)
    ends = [smooth(c.set_index(x)["mean"], window).iloc[-1] for _, c in agg.groupby(hue)]
    return float(max(ends)) * 1.05


def speedup(frame: pd.DataFrame, target: float, x: str = "time_s", by: str = "workers",
            base=1, window: int = 5) -> pd.DataFrame:
    """Per value of `by`: the median time to `target` over the runs, how many runs reached it, and the
    speedup over `by == base`. A value where not every run got there has no speedup (NaN): the median of the
    survivors would flatter it."""
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
