"""The baselines report: every algorithm × n of one or more sweeps, as a page, a tidy CSV or a LaTeX table.

    python -m analysis.report multirun/2026-11-21/10-00-00-000000 --out baselines.html [--target-loss 0.5]

`--out` picks the format by its suffix: `.html` (one self-contained page, the figure embedded), `.md` (the
figure beside it as `<name>.png`), `.csv` (the table's numbers, one row per table row) or `.tex` (the table as a
booktabs `tabular`, no figure); any other suffix is refused in one line and nothing is written. Every file is
written atomically (`gem.files.write_atomic`).

The table has one row per (algorithm, n, and any other setting that varies between them, such as κ): how many
runs and their status, then the final training loss (each run's mean of its last 10% of commit losses), the
validation accuracy of the central variable and the mean staleness, each as the mean over the completed runs
(the seeds) ± the half-width of its 95% confidence interval, with k, the number of seeds it is over:
`0.200 ± 0.248 (k=3)` (`analysis.stats.mean_ci`, Student's t interval; its docstring says why not a bootstrap).
Diverged, failed and incomplete runs (killed before their summary) are left out of the means: the status column
counts them, the page says how many in its first sentence and lists each under "Runs left out of the means".
Worker steps and seconds to the target loss are the median over the runs that reached it, with how many did out
of the runs that ended (completed or diverged; a failed or killed run might have got there), as `plots.speedup`.

The CSV's columns (one row per table row, numbers unformatted, NaN written as an empty field):

    algorithm, <each varying setting, e.g. kappa>, n    what the row is
    runs                                                every run of the row, whatever its status
    completed, diverged, failed, incomplete             how many of them ended so
    <q>_mean, <q>_ci_lo, <q>_ci_hi, <q>_k               for q in final_train_loss, val_accuracy, mean_staleness:
                                                        the mean over the k completed runs with a value, and its
                                                        95% t interval (empty when k < 2; all empty when k = 0)
    target_loss                                         the loss of the columns below
    target_runs                                         the runs measured: completed and diverged
    reached                                             how many of those got to target_loss
    worker_steps_to_target_median                       the median worker step at which they did (empty: none)
    seconds_to_target_median                            the median seconds from their first commit

The figure (html and md): every algorithm's training loss against worker steps, one panel per n, and the final
training loss against n, on a grid of at most 3 columns with one legend. Curves are `analysis.plots.curves`
with `--band` (default `minmax`, as the figures; `ci`: the 95% t interval, which with 3 seeds is t(0.975, 2) = 4.3
standard errors wide each way and, with nine algorithms, covers most of a panel; `none`): the mean over the
completed seeds, each other run drawn on its own (a diverged one dashed, ending in a cross); the final losses are
`plots.final_loss`, mean and the same interval as error bars. The
target loss is a dotted line, or a note in the panel when it lies outside the panel's range.
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

from analysis import load, plots
from analysis.plots import plt
from analysis.stats import LEVEL, Aggregate, mean_ci
from gem.files import WriteError, write_atomic

DEFAULT_TARGET = 0.5  # a loss every stable MNIST run reaches within one epoch per worker (digits too)
SUFFIXES = (".html", ".md", ".csv", ".tex")
STATUSES = ("completed", "diverged", "failed", "incomplete")
ENDED = ("completed", "diverged")  # the runs "steps to the target" is measured over, as `plots.speedup` does
# summary column: (the table's heading, its format)
QUANTITIES = {"final_train_loss": ("final train loss", ".3f"), "val_accuracy": ("val accuracy", ".4f"),
              "mean_staleness": ("mean staleness", ".2f")}
INTERVAL = (f"mean ± the half-width of its {LEVEL:.0%} confidence interval (Student's t over seeds: "
            "mean ± t(0.975, k − 1)·sd/√k), k = the number of completed seeds it is over")
LEFT_OUT = "Runs left out of the means"
# the figure: panels readable at a page's width (at most 3 a row), fonts that stay legible once scaled to it
STYLE = {"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 10,
         "ytick.labelsize": 10, "legend.fontsize": 10}
PANEL = (5.0, 3.6)  # inches
BAND = "minmax"  # the curves' band and the final losses' error bars, unless --band says otherwise
DPI = 110


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


def summary(runs: pd.DataFrame, m: pd.DataFrame, target: float) -> pd.DataFrame:
    """The table's numbers: one row per (algorithm, n, and any other setting that varies), with the columns the
    module docstring lists (what `--out x.csv` writes). Means are over the completed runs only."""
    label, extra = variants(runs)
    runs = runs.assign(variant=label)
    m = m.merge(runs[["run_dir", "variant"]], on="run_dir") if len(m) else m.assign(variant=None)
    m = m.assign(cell=m["variant"].astype(str) + "/" + m["workers"].astype(str)) if len(m) else m
    hit = (plots.time_to_target(plots.since_first_commit(m), target, group="cell") if len(m)
           else pd.DataFrame(columns=["run_dir", "worker_step", "time_s"]))
    r = runs.merge(hit, on="run_dir", how="left")
    rows = []
    for (a, n, _), g in r.groupby(["algorithm", "workers", "variant"], sort=True):
        done = g[g["status"] == "completed"]
        row = {"algorithm": a, **{c.removeprefix("algorithm."): g[c].iloc[0] for c in extra}, "n": int(n),
               "runs": len(g), **{s: int((g["status"] == s).sum()) for s in STATUSES}}
        for q in QUANTITIES:
            agg = mean_ci(_numbers(done[q]) if q in done else [])
            row.update({f"{q}_mean": agg.mean, f"{q}_ci_lo": agg.lo, f"{q}_ci_hi": agg.hi, f"{q}_k": agg.k})
        ended = g[g["status"].isin(ENDED)]  # a failed or killed run might have got there: not counted
        steps = _numbers(ended["worker_step"]).dropna()
        seconds = _numbers(ended["time_s"]).dropna()
        row.update({"target_loss": target, "target_runs": len(ended), "reached": len(steps),
                    "worker_steps_to_target_median": steps.median() if len(steps) else math.nan,
                    "seconds_to_target_median": seconds.median() if len(seconds) else math.nan})
        rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    order = ["n", "algorithm", *[c.removeprefix("algorithm.") for c in extra]]
    return out.sort_values(order, key=lambda c: c.map(plots.algorithm_order) if c.name == "algorithm" else c,
                           kind="stable").reset_index(drop=True)


def _status(row) -> str:
    """`3 completed, 1 failed`: every status the row's runs ended with, in a fixed order."""
    return ", ".join(f"{row[s]} {s}" for s in STATUSES if row[s])


def _aggregate(row, q: str, fmt: str) -> str:
    """`0.200 ± 0.248 (k=3)`: the mean, the half-width of its interval, the number of seeds (`Aggregate.text`)."""
    return Aggregate(row[f"{q}_mean"], row[f"{q}_ci_lo"], row[f"{q}_ci_hi"], int(row[f"{q}_k"])).text(fmt)


def _reached(median: float, reached: int, total: int, fmt: str) -> str:
    if total == 0:
        return "n/a (no run ended)"
    if reached == 0:
        return f"not reached (0/{total})"
    return f"{median:{fmt}} ({reached}/{total})" if np.isfinite(median) else f"n/a ({reached}/{total})"


def table(runs: pd.DataFrame, m: pd.DataFrame, target: float, numbers: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (algorithm, n, and any other setting that varies), in the units a reader wants (strings).
    `numbers`: `summary(runs, m, target)`, when the caller has it already."""
    s = summary(runs, m, target) if numbers is None else numbers
    if s.empty:
        return s
    first = list(s.columns[:s.columns.get_loc("runs") + 1])  # algorithm, the varying settings, n, runs
    out = s[first].copy()
    out["status"] = s.apply(_status, axis=1)
    for q, (heading, fmt) in QUANTITIES.items():
        out[heading] = s.apply(_aggregate, axis=1, q=q, fmt=fmt)
    out[f"worker steps to {target:g}"] = [_reached(v, k, t, ".0f") for v, k, t in
                                          zip(s["worker_steps_to_target_median"], s["reached"], s["target_runs"],
                                              strict=True)]
    out[f"seconds to {target:g}"] = [_reached(v, k, t, ".1f") for v, k, t in
                                     zip(s["seconds_to_target_median"], s["reached"], s["target_runs"],
                                         strict=True)]
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
    cols = ["run", "algorithm", *[c.removeprefix("algorithm.") for c in extra], "n", "seed", "status", "steps",
            "reason"]
    if bad.empty:
        return pd.DataFrame(columns=cols)
    roots = [Path(p).resolve() for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    last = m.groupby("run_dir")["step"].max() if len(m) and "step" in m else pd.Series(dtype=float)
    steps = _numbers(bad["steps"]).fillna(bad["run_dir"].map(last))

    def whole(v):
        return "" if pd.isna(v) else str(int(v))

    out = pd.DataFrame({
        "run": [_relative(d, roots) for d in bad["run_dir"]],
        "algorithm": bad["algorithm"].fillna("?").astype(str),
        **{c.removeprefix("algorithm."): bad[c] for c in extra},
        "n": bad["workers"].map(whole) if "workers" in bad else "",
        "seed": bad["seed"].map(whole) if "seed" in bad else "",
        "status": bad["status"],
        "steps": steps.map(whole),
        "reason": bad["reason"].fillna("").astype(str).str.replace(r"\s+", " ", regex=True).str.strip(),
    })
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
    kinds = ", ".join(f"{counts[s]} {s}" for s in [*STATUSES[1:], *sorted(set(counts.index) - set(STATUSES))]
                      if counts.get(s, 0))
    return (f"{bad} of {len(runs)} runs {'is' if bad == 1 else 'are'} not completed ({kinds}) and "
            f"{'is' if bad == 1 else 'are'} left out of the means: see “{LEFT_OUT}” below.{missing}")


# ------------------------------------------------------------------------------------------ the figure


def _target_line(ax, target: float) -> None:
    """The target loss, dotted, without moving the y-range: where it lies outside, a note says so."""
    lo, hi = ax.get_ylim()
    if lo <= target <= hi:
        ax.axhline(target, color="grey", ls=":", lw=1.2)
        ax.set_ylim(lo, hi)
    else:
        where = "below" if target < lo else "above"
        ax.text(0.98, 0.03 if where == "below" else 0.97, f"target {target:g} {where} the range",
                transform=ax.transAxes, ha="right", va="bottom" if where == "below" else "top", fontsize=9,
                color="dimgrey")


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


def curves_figure(runs: pd.DataFrame, m: pd.DataFrame, target: float, band=BAND):
    """Every algorithm's training loss against worker steps, one panel per n, and the final loss against n, on a
    grid of at most 3 columns with one legend for all of them."""
    from matplotlib.lines import Line2D

    label, _ = variants(runs)
    runs = runs.assign(variant=label)
    m = m.merge(runs[["run_dir", "variant"]], on="run_dir")
    ns = sorted(m["workers"].unique())
    names = sorted(set(m["variant"]) | set(runs.loc[runs["status"] == "completed", "variant"]),
                   key=lambda v: (plots.algorithm_order(v.split(" ")[0]), v))
    palette = plots.colours(names)
    cells = len(ns) + 1
    cols = 2 if cells <= 6 else 3  # two panels a row stay readable at a page's width; three for many n
    rows = math.ceil(cells / cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(PANEL[0] * cols, PANEL[1] * rows + 0.6), squeeze=False,
                                 layout="constrained")
        axes = axes.ravel()
        loss_axes = axes[:len(ns)]
        for ax, n in zip(loss_axes, ns, strict=True):
            plots.curves(m[m["workers"] == n], ax, x="worker_step", y="loss", hue="variant", palette=palette,
                         band=band)
            ax.set_title(f"n = {n}")
        _tight_bottom(loss_axes)
        plots.same_y(loss_axes)
        for ax in loss_axes:
            _target_line(ax, target)
        plots.final_loss(runs, axes[len(ns)], hue="variant", palette=palette, band=band)
        bars = {"minmax": "min–max", "ci": f"{LEVEL:.0%} CI", None: "no bars"}[plots.band_kind(band)]
        axes[len(ns)].set_title(f"final training loss (mean, {bars})")
        for ax in axes[cells:]:
            ax.axis("off")
        handles = [Line2D([], [], color=palette[v], lw=2, label=v) for v in names]
        shown = plots.statuses(m.drop_duplicates("run_dir"))
        for status, (ls, marker) in plots.APART.items():  # how `plots.curves` draws a run it does not average
            if (shown == status).any():
                handles.append(Line2D([], [], color="grey", lw=1, ls=ls, **plots.end_marker(marker, "grey"),
                                      label=f"a {status} run" if status != "incomplete" else "an incomplete run"))
        handles.append(Line2D([], [], color="grey", lw=1.2, ls=":", label=f"target loss {target:g}"))
        if rows * cols > cells:  # a free cell: the legend goes there
            axes[cells].legend(handles=handles, loc="center", frameon=False, ncol=1 if len(handles) <= 12 else 2)
        else:
            fig.legend(handles=handles, loc="outside lower center", frameon=False, ncol=min(len(handles), 6))
        kind = plots.band_kind(band)
        what = "no band" if kind is None else f"band: {plots.BANDS[kind]}"
        fig.suptitle(f"Training loss against worker steps: the mean over the completed seeds, {what};\neach run "
                     f"left out of the means drawn on its own. Last panel: the final loss, mean and {bars}.",
                     fontsize=11)
    return fig


def figure_png(runs: pd.DataFrame, m: pd.DataFrame, target: float, band=BAND) -> bytes:
    with plt.rc_context(STYLE):  # ticks are made at draw time: the same sizes then
        fig = curves_figure(runs, m, target, band)
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
    for col in ("lr", "momentum", "batch_size", "epochs"):
        if col in runs:
            values = pd.to_numeric(runs[col], errors="coerce").dropna().unique()
            bits.append(f"{col} " + "/".join(f"{v:g}" for v in sorted(values)))
    bits.append(f"seeds {runs['seed'].nunique()}" if "seed" in runs else "")
    return ", ".join(b for b in bits if b)


def command(paths, out: Path, target: float) -> str:
    """The command line that writes this report."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    extra = f" --target-loss {target:g}" if target != DEFAULT_TARGET else ""
    return f"python -m analysis.report {' '.join(map(str, paths))} --out {out}{extra}"


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(text) -> str:
    """LaTeX text: its special characters escaped, ± in math mode."""
    out = "".join(_TEX.get(ch, ch) for ch in str(text))
    return out.replace("±", r"$\pm$").replace("−", "$-$")


def to_tex(tab: pd.DataFrame, caption: str, cmd: str) -> str:
    """A booktabs tabular of the human-readable table, a rule between values of n; comments say how it was made
    and give a caption to use."""
    numeric = {"n", "runs"}
    spec = "".join("r" if c in numeric else "l" for c in tab.columns)
    lines = [f"% generated by {cmd}", f"% \\caption{{{tex_escape(caption)}}}", f"\\begin{{tabular}}{{{spec}}}",
             r"\toprule", " & ".join(tex_escape(c) for c in tab.columns) + r" \\", r"\midrule"]
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


def write(paths, out: str | Path, target: float = DEFAULT_TARGET, band=BAND) -> Path:
    """Write the report for every run under `paths` to `out` (.html, .md, .csv or .tex). Returns its path."""
    return _write(paths, out, target, band)[0]


def _write(paths, out: str | Path, target: float, band=BAND) -> tuple[Path, pd.DataFrame]:
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--out {out}: the report is written as {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}")
    runs = load.without_twins(load.runs(paths))
    if runs.empty:
        raise ValueError(f"no runs found under {paths}")
    m = load.commits(paths, columns=["algorithm", "workers", "seed", "status"], meta=runs)
    numbers = summary(runs, m, target)
    tab = table(runs, m, target, numbers)
    suffix = out.suffix.lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    intro = (f"Final training loss (each run's mean of its last 10% of commit losses), validation accuracy and "
             f"mean staleness: {INTERVAL}. Only completed runs count: diverged, failed and incomplete runs are "
             f"left out of the means (the status column counts them). Steps and seconds to the target loss "
             f"{target:g}: the median over the runs that reached it (reached/runs that ended, completed or diverged: a "
             f"failed or incomplete run might have got there), on each run's curve smoothed over 5 bins.")
    if suffix == ".csv":
        write_atomic(out, numbers.to_csv(index=False))
        return out, runs
    if suffix == ".tex":
        caption = (f"Baselines: mean ± the half-width of its {LEVEL:.0%} confidence interval (Student's t over "
                   f"seeds), k = the number of completed seeds; diverged, failed and incomplete runs are left out "
                   f"of the means. Steps and seconds to the target loss {target:g}: the median over the runs that "
                   f"reached it (reached/runs that completed or diverged).")
        write_atomic(out, to_tex(tab, caption, command(paths, out, target)))
        return out, runs
    fig = figure_png(runs, m, target, band) if len(m) else None
    missing = left_out(runs, m, paths)
    sources = ", ".join(sorted({str(Path(d).parent) for d in runs["run_dir"]}))
    about = (f"{len(runs)} run{'s' if len(runs) != 1 else ''} from {sources}. {_describe(runs)}. {intro} Seconds "
             "count from a run's first commit, on its own clock: wall time on the process engine, the simulation's "
             "compute time on the sim engine.")
    gone = (f"{LEFT_OUT}: every run that did not complete, with its directory relative to its sweep, the commits "
            "it applied (for an incomplete run, the last step it logged) and why it stopped.")
    if suffix == ".html":
        img = (f'<img alt="loss curves" src="data:image/png;base64,{base64.b64encode(fig).decode()}">'
               if fig else "<p>No commit rows to plot.</p>")
        missing_html = (f"<p>{html.escape(gone)}</p>{missing.to_html(index=False, escape=True)}" if len(missing)
                        else "<p>Every run completed: none is left out.</p>")
        write_atomic(out, (
            "<!doctype html><html><head><meta charset='utf-8'><title>gem baselines report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:100%} table{border-collapse:collapse;font-size:13px}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} img{max-width:100%}</style></head><body>"
            f"<h1>Baselines report</h1><p><strong>{html.escape(headline(runs))}</strong></p>"
            f"<p>{html.escape(about)}</p>{tab.to_html(index=False, escape=True) if len(tab) else ''}"
            f"<h2>{LEFT_OUT}</h2>{missing_html}<h2>Loss curves</h2>{img}</body></html>\n"))
    else:
        png = out.with_suffix(".png")
        if fig:
            write_atomic(png, fig)
        missing_md = f"{gone}\n\n{_markdown(missing)}" if len(missing) else "Every run completed: none is left out."
        write_atomic(out, (
            f"# Baselines report\n\n**{headline(runs)}**\n\n{about}\n\n"
            + (f"{_markdown(tab)}\n\n" if len(tab) else "")
            + f"## {LEFT_OUT}\n\n{missing_md}\n\n## Loss curves\n\n"
            + (f"![loss curves]({png.name})\n" if fig else "No commit rows to plot.\n")))
    return out, runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="+", help="sweep or run directories")
    p.add_argument("--out", default="baselines.html",
                   help="the report: .html (self-contained), .md (PNG beside it), .csv (tidy numbers) or .tex "
                        "(booktabs table)")
    p.add_argument("--target-loss", type=float, default=DEFAULT_TARGET, help="the loss for 'steps to target'")
    p.add_argument("--band", choices=("minmax", "ci", "none"), default=BAND,
                   help="the curves' band and the final losses' bars: min–max over seeds (default), the 95%% t "
                        "interval of the mean, or none (the table always gives the t interval)")
    args = p.parse_args(argv)
    if not np.isfinite(args.target_loss) or args.target_loss <= 0:
        p.error(f"--target-loss={args.target_loss} is not allowed; it must be a number > 0")
    try:
        path, runs = _write(args.sweeps, args.out, args.target_loss, args.band)
    except (FileNotFoundError, ValueError, WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    print(load.describe(runs))  # what the report says of its runs, here too
    return 0


if __name__ == "__main__":
    sys.exit(main())
