"""The report of one or more sweeps: every algorithm × n, as a page, a tidy CSV or a LaTeX table.

    python -m analysis.report <sweep>... --out report.html [--target 0.08 | --target-from <tuning sweep>...]

`--out` picks the format by its suffix: `.html` (one self-contained page, the figures embedded), `.md` (the figures
beside it as `<name>.png` and `<name>_profile.png`), `.csv` (the table's numbers, one row per table row) or `.tex`
(the table as a booktabs `tabular`, no figure); any other suffix is refused in one line and nothing is written.
Every file is written atomically (`gem.files.write_atomic`). Its title names the experiments and sweeps it reads.

The table has one row per (algorithm, n, and any other setting that varies between them, such as κ): how many runs
and their status; the final training loss (each run's mean of its last 10% of commit losses), the final central
variable's validation loss and accuracy and its test loss and accuracy (the test split is evaluated once, at the
end: nothing was chosen on it), the mean staleness and the run's wall time, each as the mean over the completed
runs (the seeds) and its 95% confidence interval, with k, the number of seeds it is over: `0.200 [0.081, 0.49]
(k=3)` (`analysis.stats.mean_ci`: Student's t on the log scale for a positive quantity, the logit scale for an
accuracy, so that no interval leaves the quantity's range). Diverged, failed and incomplete runs (killed before
their summary) are left out of the means: the status column counts them, the page says how many in its first
sentence and lists each under "Runs left out of the means". The staleness model each engine ran is named.

Time to the target (`analysis.target`): the validation loss that the best method reaches, per workload (data,
engine, staleness model, n), AlgoPerf's rule. `--target-from` reads targets announced before (the `targets.csv` that
`python -m analysis.tune` writes from a tuning sweep; several, one per n, are put together); `--target` gives one
for every workload; without either, the
targets are set from the very runs of the report, and the report says they were not announced in advance. For each
row: the median over its runs that ended (completed or diverged: a failed or killed run might have got there) of
the worker steps and of the engine's own time to the target (wall-clock seconds on process and distributed, the
simulated time on sim; never the sim engine's machine seconds), a run that never got there counting as infinite,
and how many got there. The figures: every row's validation loss against worker steps, one panel per n with its
target dotted, the final validation loss against n, and the performance profile of the time to the target over
the workloads of the report (`analysis.target.profile`).

The CSV's columns (one row per table row, numbers unformatted, NaN written as an empty field):

    algorithm, <each varying setting, e.g. kappa>, n    what the row is
    workload                                            its data, engine, staleness model and n
    runs                                                every run of the row, whatever its status
    completed, diverged, failed, incomplete, unreadable how many of them ended so (unreadable: a damaged file)
    <q>_mean, <q>_ci_lo, <q>_ci_hi, <q>_k               for q in QUANTITIES: the mean over the k completed runs
                                                        with a value, and its 95% interval (empty when k < 2)
    target, target_source                               the validation loss of the columns below, and whence
    target_runs, reached                                the runs measured (completed and diverged), how many got
                                                        there
    worker_steps_to_target_median                       the median worker step at which they did (inf: most never)
    time_to_target_median, clock                        the median time, in `clock` (seconds or sim_time)
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import load, plots, target
from analysis.plots import plt
from analysis.stats import LEVEL, Aggregate, mean_ci
from gem.files import WriteError, write_atomic

SUFFIXES = (".html", ".md", ".csv", ".tex")
STATUSES = ("completed", "diverged", "failed", "incomplete", "unreadable")
ENDED = target.ENDED  # the runs the time to the target is measured over
# summary column: (the table's heading, its format, the scale of its interval: analysis.stats)
QUANTITIES = {
    "final_train_loss": ("final train loss", ".3f", "log"),
    "val_loss": ("val loss", ".4f", "log"),
    "val_accuracy": ("val accuracy", ".4f", "logit"),
    "test_loss": ("test loss", ".4f", "log"),
    "test_accuracy": ("test accuracy", ".4f", "logit"),
    "mean_staleness": ("mean staleness", ".2f", "log"),
    "wall_time_s": ("wall time (s)", ".0f", "log"),
}
INTERVAL = (
    f"mean and its {LEVEL:.0%} confidence interval [lo, hi] (Student's t over the seeds, on the log scale "
    "for a loss, a time or τ and on the logit scale for an accuracy, so that no interval leaves the "
    "quantity's range), k = the number of completed seeds it is over"
)
LEFT_OUT = "Runs left out of the means"
# the figure: panels readable at a page's width (at most 3 a row), fonts that stay legible once scaled to it
STYLE = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
}
PANEL = (5.0, 3.6)  # inches
BAND = "minmax"  # the curves' band and the final losses' error bars, unless --band says otherwise
DPI = 110
CLOCKS = {"sim_time": "sim time", "seconds": "s"}


def variants(runs: pd.DataFrame) -> tuple[pd.Series, list[str]]:
    """What tells apart the rows of the report: the algorithm, plus any setting that differs between runs of the
    same algorithm and n besides the seed (κ in a fig8 sweep, say). Returns a label per run and those settings."""
    extra = load.varying(runs, ["algorithm", "workers"])
    repeated = load.repeated_seeds(runs, ["algorithm", "workers", *extra])
    if repeated:
        raise ValueError(repeated)
    label = runs["algorithm"].astype(str)
    for c in extra:
        short = c.removeprefix("algorithm.")
        text = runs[c].map(lambda v: f"{v:g}" if isinstance(v, float) else str(v))
        label = label.where(runs[c].isna(), label + " " + short + "=" + text)
    return label, extra


def _numbers(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s, errors="coerce")


def check_target(given: float | None) -> None:
    """`--target`: a validation loss, so a finite number > 0 (one line, before anything is read or written)."""
    if given is not None and (not np.isfinite(given) or given <= 0):
        raise ValueError(f"--target={given:g} is not allowed; it must be a validation loss > 0")


def targets_for(
    runs: pd.DataFrame, given: float | None = None, source: str | Path | None = None
) -> tuple[pd.DataFrame | float, str]:
    """The targets the report measures against, and a sentence on where they come from: a number given, targets
    announced in a file (`source`: a tuning sweep's targets.csv), or set from these very runs."""
    if given is not None:
        return float(given), f"the validation loss {given:g}, given on the command line"
    if source is not None:
        t = target.read_targets(source)
        sources = source if isinstance(source, (list, tuple)) else [source]
        return t, (
            f"announced before these runs: {', '.join(str(Path(s)) for s in sources)} (per workload, the best tuned "
            "method's median final validation loss, AlgoPerf's rule)"
        )
    t = target.announce(runs.assign(variant=variants(runs)[0]))  # per variant: κ = 1 and κ = 4 are two methods
    return t, (
        "set from these very runs (per workload, the best method's median final validation loss, AlgoPerf's "
        "rule): not announced in advance, so the method that sets a target reaches it by construction; "
        "pass --target-from <tuning sweep> to measure against targets chosen before"
    )


def summary(runs: pd.DataFrame, hit: pd.DataFrame) -> pd.DataFrame:
    """The table's numbers: one row per (algorithm, n, and any other setting that varies), with the columns the
    module docstring lists (what `--out x.csv` writes). Means are over the completed runs only. `hit`:
    `analysis.target.times` of the runs."""
    label, extra = variants(runs)
    runs = runs.assign(variant=label)
    r = (
        runs.merge(hit, on="run_dir", how="left")
        if len(hit)
        else runs.assign(target=np.nan, reached=False, worker_step=np.nan, time=np.nan, clock=None)
    )
    rows = []
    for (a, n, _), g in r.groupby(["algorithm", "workers", "variant"], sort=True):
        done = g[g["status"] == "completed"]
        row = {
            "algorithm": a,
            **{c.removeprefix("algorithm."): g[c].iloc[0] for c in extra},
            "n": int(n),
            "workload": target.describe_workload(g.iloc[0]),
            "runs": len(g),
            **{s: int((g["status"] == s).sum()) for s in STATUSES},
        }
        for q, (_, _, scale) in QUANTITIES.items():
            agg = mean_ci(_numbers(done[q]) if q in done else [], scale=scale)
            row.update({f"{q}_mean": agg.mean, f"{q}_ci_lo": agg.lo, f"{q}_ci_hi": agg.hi, f"{q}_k": agg.k})
        ended = g[g["status"].isin(ENDED) & (_numbers(g["time"]).notna())]
        row.update(
            {
                "target": float(g["target"].iloc[0]) if g["target"].notna().any() else math.nan,
                "target_runs": len(ended),
                "reached": int(ended["reached"].sum()) if len(ended) else 0,
                "worker_steps_to_target_median": target.lower_median(ended["worker_step"]),
                "time_to_target_median": target.lower_median(ended["time"]),
                "clock": ended["clock"].iloc[0] if len(ended) else None,
            }
        )
        rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    order = ["n", "algorithm", *[c.removeprefix("algorithm.") for c in extra]]
    return out.sort_values(
        order, key=lambda c: c.map(plots.algorithm_order) if c.name == "algorithm" else c, kind="stable"
    ).reset_index(drop=True)


def _status(row) -> str:
    """`3 completed, 1 failed`: every status the row's runs ended with, in a fixed order."""
    return ", ".join(f"{row[s]} {s}" for s in STATUSES if row[s])


def _aggregate(row, q: str, fmt: str) -> str:
    """`0.200 [0.081, 0.49] (k=3)`: the mean, its interval, the number of seeds (`Aggregate.text`)."""
    return Aggregate(row[f"{q}_mean"], row[f"{q}_ci_lo"], row[f"{q}_ci_hi"], int(row[f"{q}_k"])).text(fmt)


def _reached(median: float, reached: int, total: int, fmt: str, unit: str = "") -> str:
    """`212 (3/3)`; `never (0/3)`; `not in most (1/3)` when the median run never got there."""
    if total == 0:
        return "n/a (no run ended)"
    if reached == 0:
        return f"never (0/{total})"
    if not np.isfinite(median):
        return f"not in most ({reached}/{total})"
    return f"{median:{fmt}}{unit} ({reached}/{total})"


def table(runs: pd.DataFrame, hit: pd.DataFrame, numbers: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (algorithm, n, and any other setting that varies), in the units a reader wants (strings).
    `numbers`: `summary(runs, hit)`, when the caller has it already."""
    s = summary(runs, hit) if numbers is None else numbers
    if s.empty:
        return s
    first = [c for c in s.columns[: s.columns.get_loc("runs") + 1] if c != "workload"]
    out = s[first].copy()
    out["status"] = s.apply(_status, axis=1)
    for q, (heading, fmt, _) in QUANTITIES.items():
        out[heading] = s.apply(_aggregate, axis=1, q=q, fmt=fmt)
    out["target val loss"] = s["target"].map(lambda v: "n/a" if pd.isna(v) else f"{v:.4f}")
    out["worker steps to target"] = [
        _reached(v, k, t, ".0f")
        for v, k, t in zip(s["worker_steps_to_target_median"], s["reached"], s["target_runs"], strict=True)
    ]
    out["time to target"] = [
        _reached(v, k, t, ".1f" if c == "sim_time" else ".0f", f" {CLOCKS.get(c, '')}".rstrip() if c else "")
        for v, k, t, c in zip(s["time_to_target_median"], s["reached"], s["target_runs"], s["clock"], strict=True)
    ]
    for c in ("worker steps to target", "time to target"):  # targets announced for other workloads only
        out[c] = out[c].where(s["target"].notna(), "n/a (no target announced for this workload)")
    return out


def _relative(run_dir: str, paths: list[Path]) -> str:
    """A run's directory as the reader finds it: relative to the sweep it was given in (prefixed with that
    sweep's name when several were given)."""
    d = Path(run_dir)
    for p in paths:
        try:
            rel = d.relative_to(p)
        except ValueError:
            continue
        name = p.name if str(rel) == "." else str(rel)
        return f"{p.name}/{name}" if len(paths) > 1 and str(rel) != "." else name
    return str(d)


def left_out(runs: pd.DataFrame, m: pd.DataFrame, paths) -> pd.DataFrame:
    """Every run that did not complete, so none of its numbers is in a mean: its directory (relative to its
    sweep), what it ran, its status, the commits it applied (an incomplete run's last logged step) and why."""
    label, extra = variants(runs)
    runs = runs.assign(variant=label)
    bad = runs[runs["status"] != "completed"]
    cols = [
        "run",
        "algorithm",
        *[c.removeprefix("algorithm.") for c in extra],
        "n",
        "seed",
        "status",
        "steps",
        "reason",
    ]
    if bad.empty:
        return pd.DataFrame(columns=cols)
    roots = [Path(p).resolve() for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    last = m.groupby("run_dir")["step"].max() if len(m) and "step" in m else pd.Series(dtype=float)
    steps = _numbers(bad["steps"]).fillna(bad["run_dir"].map(last))

    def whole(v):
        return "" if pd.isna(v) else str(int(v))

    out = pd.DataFrame(
        {
            "run": [_relative(d, roots) for d in bad["run_dir"]],
            "algorithm": bad["algorithm"].fillna("?").astype(str),
            **{c.removeprefix("algorithm."): bad[c] for c in extra},
            "n": bad["workers"].map(whole) if "workers" in bad else "",
            "seed": bad["seed"].map(whole) if "seed" in bad else "",
            "status": bad["status"],
            "steps": steps.map(whole),
            "reason": bad["reason"].fillna("").astype(str).str.replace(r"\s+", " ", regex=True).str.strip(),
        }
    )
    out.loc[(out["status"] == "incomplete") & (out["reason"] == ""), "reason"] = "no summary.json (killed?)"
    order = out["status"].map({s: i for i, s in enumerate(STATUSES)})
    return out.assign(_o=order).sort_values(["_o", "run"], kind="stable").drop(columns="_o").reset_index(drop=True)


def headline(runs: pd.DataFrame) -> str:
    """The report's first sentence: how many runs are not in the means, and why."""
    counts = runs["status"].value_counts()
    bad = int(len(runs) - counts.get("completed", 0))
    missing = load.unstarted(runs)
    missing = f" {missing[0].upper()}{missing[1:]}." if missing else ""
    if bad == 0:
        return f"Every run completed ({len(runs)} of {len(runs)}): none is left out of the means.{missing}"
    kinds = ", ".join(
        f"{counts[s]} {s}" for s in [*STATUSES[1:], *sorted(set(counts.index) - set(STATUSES))] if counts.get(s, 0)
    )
    return (
        f"{bad} of {len(runs)} runs {'is' if bad == 1 else 'are'} not completed ({kinds}) and "
        f"{'is' if bad == 1 else 'are'} left out of the means: see “{LEFT_OUT}” below.{missing}"
    )


# ------------------------------------------------------------------------------------------ the figures


def _target_line(ax, value: float) -> None:
    """The target, dotted, without moving the y-range: where it lies outside, a note says so."""
    if not np.isfinite(value):
        return
    lo, hi = ax.get_ylim()
    if lo <= value <= hi:
        ax.axhline(value, color="grey", ls=":", lw=1.2)
        ax.set_ylim(lo, hi)
    else:
        where = "below" if value < lo else "above"
        ax.text(
            0.98,
            0.03 if where == "below" else 0.97,
            f"target {value:.3g} {where} the range",
            transform=ax.transAxes,
            ha="right",
            va="bottom" if where == "below" else "top",
            fontsize=9,
            color="dimgrey",
        )


def _tight_bottom(axes, room: float = 2.0) -> None:
    """Raise each log axis's bottom to `room` times under the lowest line it shows (the means, the runs drawn
    apart). Autoscaling puts it under the bands, whose 95% t interval over 3 seeds dips to near 0 wherever the
    seeds spread (a t of 4.3), and a margin below a range that still holds the off-scale values cut at the top
    (a diverging loss of 1e4): the curves end up squashed into the top of the panel. A band that reaches lower
    runs off the bottom edge."""
    for ax in axes:
        ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
        v = np.concatenate(ys) if ys else np.array([])
        v = v[np.isfinite(v) & (v > 0)]
        lo, hi = ax.get_ylim()
        if ax.get_yscale() == "log" and len(v) and lo < v.min() / room < hi:
            ax.set_ylim(v.min() / room, hi)


def curves_figure(runs: pd.DataFrame, ev: pd.DataFrame, hit: pd.DataFrame, band=BAND):
    """Every row's validation loss against worker steps (the evaluations), one panel per n with its target
    dotted, and the final validation loss against n, on a grid of at most 3 columns with one legend."""
    from matplotlib.lines import Line2D

    label, _ = variants(runs)
    runs = runs.assign(variant=label)
    ev = ev.merge(runs[["run_dir", "variant"]], on="run_dir")
    ns = sorted(ev["workers"].unique())
    names = sorted(
        set(ev["variant"]) | set(runs.loc[runs["status"] == "completed", "variant"]),
        key=lambda v: (plots.algorithm_order(v.split(" ")[0]), v),
    )
    palette = plots.colours(names)
    goal = runs[["run_dir", "workers"]].merge(hit[["run_dir", "target"]], on="run_dir") if len(hit) else None
    cells = len(ns) + 1
    cols = 2 if cells <= 6 else 3  # two panels a row stay readable at a page's width; three for many n
    rows = math.ceil(cells / cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(
            rows, cols, figsize=(PANEL[0] * cols, PANEL[1] * rows + 0.6), squeeze=False, layout="constrained"
        )
        axes = axes.ravel()
        loss_axes = axes[: len(ns)]
        for ax, n in zip(loss_axes, ns, strict=True):
            plots.curves(
                ev[ev["workers"] == n], ax, x="worker_step", y="val_loss", hue="variant", palette=palette, band=band
            )
            ax.set_title(f"n = {n}")
        _tight_bottom(loss_axes)
        plots.same_y(loss_axes)
        for ax, n in zip(loss_axes, ns, strict=True):
            if goal is not None:
                values = goal.loc[goal["workers"] == n, "target"].dropna().unique()
                if len(values) == 1:
                    _target_line(ax, float(values[0]))
        plots.final_loss(runs, axes[len(ns)], y="val_loss", hue="variant", palette=palette, band=band)
        bars = {"minmax": "min–max", "ci": f"{LEVEL:.0%} CI", None: "no bars"}[plots.band_kind(band)]
        axes[len(ns)].set_ylabel("final validation loss")
        axes[len(ns)].set_title(f"final validation loss (mean, {bars})")
        for ax in axes[cells:]:
            ax.axis("off")
        handles = [Line2D([], [], color=palette[v], lw=2, label=v) for v in names]
        shown = plots.statuses(ev.drop_duplicates("run_dir"))
        for status, (ls, marker) in plots.APART.items():  # how `plots.curves` draws a run it does not average
            if (shown == status).any():
                handles.append(
                    Line2D(
                        [],
                        [],
                        color="grey",
                        lw=1,
                        ls=ls,
                        **plots.end_marker(marker, "grey"),
                        label=f"a {status} run" if status != "incomplete" else "an incomplete run",
                    )
                )
        handles.append(Line2D([], [], color="grey", lw=1.2, ls=":", label="target (validation loss)"))
        if rows * cols > cells:  # a free cell: the legend goes there
            axes[cells].legend(handles=handles, loc="center", frameon=False, ncol=1 if len(handles) <= 12 else 2)
        else:
            # as many columns as the longest entry lets fit across the figure (a 10-point character is about
            # 0.08 inch, the line and the gaps about 0.8): six columns of long labels ran past the right edge
            longest = 0.8 + 0.08 * max(len(h.get_label()) for h in handles)
            fit = max(1, int(PANEL[0] * cols // longest))
            ncol = min(len(handles), 6, fit)
            fig.legend(handles=handles, loc="outside lower center", frameon=False, ncol=ncol)
            width, height = fig.get_size_inches()  # room for the legend's rows, so the panels keep their height
            fig.set_size_inches(width, height + 0.22 * math.ceil(len(handles) / ncol))
        kind = plots.band_kind(band)
        what = "no band" if kind is None else f"band: {plots.BANDS[kind]}"
        fig.suptitle(
            f"Validation loss of the central variable against worker steps: the mean over the completed "
            f"seeds, {what};\neach run left out of the means drawn on its own. Last panel: the final "
            f"validation loss, mean and {bars}.",
            fontsize=11,
        )
    return fig


def profile_png(runs: pd.DataFrame, hit: pd.DataFrame) -> tuple[bytes | None, str]:
    """The performance profile of the time to the target over the report's workloads, as PNG bytes, and a
    sentence on it (the workloads no method reached, which it leaves out)."""
    label, _ = variants(runs)
    runs = runs.assign(variant=label)
    methods = target.per_method(runs, hit)
    if methods.empty:
        return None, "No run ended: no performance profile."
    prof, dropped = target.profile(methods)
    if prof.empty or not prof["workloads"].max():
        return None, "No method reached a target on any workload: no performance profile."
    clocks = sorted(set(methods["clock"].dropna()))
    names = sorted(prof["method"].unique(), key=lambda v: (plots.algorithm_order(str(v).split(" ")[0]), str(v)))
    with plt.rc_context(STYLE):
        # wider: the legend goes beside, in as many columns as it needs (target.legend_columns), and the figure as
        # tall as the longest column of names
        cols = target.legend_columns(len(names))
        rows = -(-len(names) // cols)
        fig, ax = plt.subplots(figsize=(10.0 + 3.6 * (cols - 1), max(4.6, 0.19 * rows + 1.0)), layout="constrained")
        k = int(prof["workloads"].max())
        target.profile_figure(
            prof,
            ax,
            plots.colours(names),
            title=f"Performance profile over {k} workload{'s' if k != 1 else ''}: time "
            f"({' / '.join(CLOCKS.get(c, c) for c in clocks)}) to the validation target",
        )
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        plt.close(fig)
    note = (
        "Each method's time on a workload is the median over its seeds (a seed that never reached the target "
        "counts as infinite); ρ(r) is the fraction of workloads on which it is within r times the fastest "
        "method's."
    )
    if dropped:
        note += f" Left out, as no method reached their target: {'; '.join(dropped)}."
    untargeted = runs.merge(hit, on="run_dir")
    untargeted = untargeted[untargeted["target"].isna()].drop_duplicates(target.workload_keys(runs))
    if len(untargeted):
        note += (
            " Left out, as no target was announced for them: "
            f"{'; '.join(target.describe_workload(r) for _, r in untargeted.iterrows())}."
        )
    return buf.getvalue(), note


def figure_png(runs: pd.DataFrame, ev: pd.DataFrame, hit: pd.DataFrame, band=BAND) -> bytes:
    with plt.rc_context(STYLE):  # ticks are made at draw time: the same sizes then
        fig = curves_figure(runs, ev, hit, band)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        plt.close(fig)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ the files


def _describe(runs: pd.DataFrame) -> str:
    bits = []
    for col in ("data", "engine", "model"):
        if col in runs:
            bits.append(f"{col} " + "/".join(sorted(map(str, runs[col].dropna().unique()))))
    if "staleness_model" in runs and runs["staleness_model"].notna().any():
        bits.append("staleness " + " / ".join(sorted(map(str, runs["staleness_model"].dropna().unique()))))
    for col in ("lr", "momentum", "batch_size", "epochs"):
        if col in runs:
            values = pd.to_numeric(runs[col], errors="coerce").dropna().unique()
            bits.append(f"{col} " + "/".join(f"{v:g}" for v in sorted(values)))
    bits.append(f"seeds {runs['seed'].nunique()}" if "seed" in runs else "")
    return ", ".join(b for b in bits if b)


def title(runs: pd.DataFrame, paths) -> str:
    """`Report: baselines, fig1 (sweeps baselines, fig1)`: what the runs are, by experiment and sweep folder."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    experiments = sorted(map(str, runs["experiment"].dropna().unique())) if "experiment" in runs else []
    folders = ", ".join(Path(p).name for p in paths)
    return f"Report: {', '.join(experiments) or 'runs'} (from {folders})"


def command(paths, out: Path, given: float | None, source) -> str:
    """The command line that writes this report."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    sources = " ".join(map(str, source)) if isinstance(source, (list, tuple)) else source
    extra = (f" --target {given:g}" if given is not None else "") + (f" --target-from {sources}" if source else "")
    return f"python -m analysis.report {' '.join(map(str, paths))} --out {out}{extra}"


_TEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def tex_escape(text) -> str:
    """LaTeX text: its special characters escaped, ± in math mode."""
    out = "".join(_TEX.get(ch, ch) for ch in str(text))
    return out.replace("±", r"$\pm$").replace("−", "$-$")


def to_tex(tab: pd.DataFrame, caption: str, cmd: str) -> str:
    """A booktabs tabular of the human-readable table, a rule between values of n; comments say how it was made
    and give a caption to use."""
    numeric = {"n", "runs"}
    spec = "".join("r" if c in numeric else "l" for c in tab.columns)
    lines = [
        f"% generated by {cmd}",
        f"% \\caption{{{tex_escape(caption)}}}",
        f"\\begin{{tabular}}{{{spec}}}",
        r"\toprule",
        " & ".join(tex_escape(c) for c in tab.columns) + r" \\",
        r"\midrule",
    ]
    previous = None
    for _, row in tab.iterrows():
        if previous is not None and row["n"] != previous:
            lines.append(r"\midrule")
        previous = row["n"]
        lines.append(" & ".join(tex_escape("" if pd.isna(v) else v) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(lines)


def _markdown(frame: pd.DataFrame) -> str:
    cells = frame.astype(str).apply(lambda c: c.str.replace("|", r"\|", regex=False))
    return cells.to_markdown(index=False)


def write(paths, out: str | Path, given: float | None = None, source=None, band=BAND) -> Path:
    """Write the report for every run under `paths` to `out` (.html, .md, .csv or .tex). Returns its path.
    `given`: one validation-loss target for every workload; `source`: targets announced before (a targets.csv,
    or a sweep holding one); neither: set from these runs."""
    return _write(paths, out, given, source, band)[0]


def _write(paths, out: str | Path, given: float | None, source, band=BAND) -> tuple[Path, pd.DataFrame]:
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--out {out}: the report is written as {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}")
    runs = load.without_twins(load.runs(paths))
    if runs.empty:
        where = " ".join(map(str, [paths] if isinstance(paths, (str, os.PathLike)) else paths))
        raise ValueError(f"no runs under {where}: a run's folder holds its summary.json or .hydra/config.yaml")
    variants(runs)  # the same seed twice is refused before anything is read further
    goals, whence = targets_for(runs, given, source)
    ev = load.commits(paths, table="eval", columns=["algorithm", "workers", "seed", "status", "engine"], meta=runs)
    hit = target.times(runs, ev, goals)
    numbers = summary(runs, hit)
    tab = table(runs, hit, numbers)
    suffix = out.suffix.lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    name = title(runs, paths)
    intro = (
        f"Each quantity: {INTERVAL}. Only completed runs count: diverged, failed and incomplete runs are "
        f"left out of the means (the status column counts them). The test split is evaluated once, on the "
        f"final central variable; every choice (the targets, a tuning) is made on the validation split. "
        f"Targets: {whence}. Worker steps and time to the target: the median over the runs that ended "
        f"(completed or diverged), a run that never got there counting as infinite, with how many got there; "
        f"time is wall-clock seconds from a run's first commit on process and distributed, the simulated "
        f"time on sim (mean cycles of one local step; never the sim engine's machine seconds). Wall time is a "
        f"run's seconds from start to end on its machine: on sim the simulation's compute, which measures the "
        f"machine and what else ran on it, not the method."
    )
    numbers = numbers.assign(target_source=whence.split(":")[0] if len(numbers) else None)
    if suffix == ".csv":
        write_atomic(out, numbers.to_csv(index=False))
        return out, runs
    if suffix == ".tex":
        caption = (
            f"{name}: mean and its {LEVEL:.0%} confidence interval (Student's t over seeds, on the log or "
            f"logit scale), k = the number of completed seeds; diverged, failed and incomplete runs are left "
            f"out of the means. Time to the target: the median over the runs that ended."
        )
        write_atomic(out, to_tex(tab, caption, command(paths, out, given, source)))
        return out, runs
    fig = figure_png(runs, ev, hit, band) if len(ev) else None
    prof, prof_note = profile_png(runs, hit)
    missing = left_out(
        runs,
        load.commits(paths, columns=["algorithm", "workers", "seed", "status"], meta=runs)
        if (runs["status"] == "incomplete").any()
        else pd.DataFrame(),
        paths,
    )
    sources = ", ".join(sorted({str(Path(d).parent) for d in runs["run_dir"]}))
    about = f"{len(runs)} run{'s' if len(runs) != 1 else ''} from {sources}. {_describe(runs)}. {intro}"
    gone = (
        f"{LEFT_OUT}: every run that did not complete, with its directory relative to its sweep, the commits "
        "it applied (for an incomplete run, the last step it logged) and why it stopped."
    )
    if suffix == ".html":
        img = (
            f'<img alt="validation loss curves" src="data:image/png;base64,{base64.b64encode(fig).decode()}">'
            if fig
            else "<p>No evaluation rows to plot.</p>"
        )
        pimg = (
            f'<img alt="performance profile" src="data:image/png;base64,{base64.b64encode(prof).decode()}">'
            if prof
            else ""
        )
        missing_html = (
            f"<p>{html.escape(gone)}</p>{missing.to_html(index=False, escape=True)}"
            if len(missing)
            else "<p>Every run completed: none is left out.</p>"
        )
        write_atomic(
            out,
            (
                f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)}</title><style>"
                "body{font-family:sans-serif;margin:2em;max-width:100%} table{border-collapse:collapse;font-size:13px}"
                "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} img{max-width:100%}</style></head><body>"
                f"<h1>{html.escape(name)}</h1><p><strong>{html.escape(headline(runs))}</strong></p>"
                f"<p>{html.escape(about)}</p>{tab.to_html(index=False, escape=True) if len(tab) else ''}"
                f"<h2>{LEFT_OUT}</h2>{missing_html}<h2>Validation loss</h2>{img}"
                f"<h2>Time to the target</h2><p>{html.escape(prof_note)}</p>{pimg}</body></html>\n"
            ),
        )
    else:
        png, ppng = out.with_suffix(".png"), out.with_name(out.stem + "_profile.png")
        if fig:
            write_atomic(png, fig)
        if prof:
            write_atomic(ppng, prof)
        missing_md = f"{gone}\n\n{_markdown(missing)}" if len(missing) else "Every run completed: none is left out."
        write_atomic(
            out,
            (
                f"# {name}\n\n**{headline(runs)}**\n\n{about}\n\n"
                + (f"{_markdown(tab)}\n\n" if len(tab) else "")
                + f"## {LEFT_OUT}\n\n{missing_md}\n\n## Validation loss\n\n"
                + (f"![validation loss curves]({png.name})\n" if fig else "No evaluation rows to plot.\n")
                + f"\n## Time to the target\n\n{prof_note}\n\n"
                + (f"![performance profile]({ppng.name})\n" if prof else "")
            ),
        )
    return out, runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="+", help="sweep or run directories")
    p.add_argument(
        "--out",
        default="baselines.html",
        help="the report: .html (self-contained), .md (PNGs beside it), .csv (tidy numbers) or .tex (booktabs table)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--target", type=float, help="one validation loss to measure the time to, for every workload")
    group.add_argument(
        "--target-from",
        metavar="SWEEP_OR_CSV",
        nargs="+",
        help="targets announced before: a tuning sweep (its targets.csv, written by analysis.tune) "
        "or the file itself, or several (one tuning sweep per n, say: give them after the sweeps); default: set "
        "from these runs, and said so",
    )
    p.add_argument(
        "--band",
        choices=("minmax", "ci", "none"),
        default=BAND,
        help="the curves' band and the final losses' bars: min–max over seeds (default), the 95%% t "
        "interval of the mean, or none (the table always gives the t interval)",
    )
    args = p.parse_args(argv)
    try:
        check_target(args.target)
        path, runs = _write(args.sweeps, args.out, args.target, args.target_from, args.band)
    except (FileNotFoundError, ValueError, WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    print(load.describe(runs))  # what the report says of its runs, here too
    return 0


if __name__ == "__main__":
    sys.exit(main())
