"""The baselines report: every algorithm × n of one or more sweeps, in one self-contained page.

    python -m analysis.report multirun/2026-11-21/10-00-00-000000 --out baselines.html [--target-loss 0.5]

`.html` embeds its figures; `.md` writes them beside the report as PNG and links them. The table has, per
(algorithm, n, and any other setting that varies between them, such as κ): the runs and their status, the final
training loss (mean ± sd over the completed seeds of each run's last 10% of commits), the validation accuracy of
the central variable, the mean staleness, and the worker steps and seconds to the target loss (the median over
the seeds that reached it, and how many did). The curves are those of `analysis.plots.curves`: mean over seeds
with a min–max band, each diverged run dashed, ending in a cross.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import load, plots
from analysis.plots import plt

DEFAULT_TARGET = 0.5  # a loss every stable MNIST run reaches within one epoch per worker (digits too)


def _status(s: pd.Series) -> str:
    counts = s.value_counts()
    return ", ".join(f"{c} {k}" for k, c in counts.items())


def _mean_sd(s: pd.Series, fmt: str = ".3f") -> str:
    s = s.dropna()
    if s.empty:
        return "n/a"
    return format(s.mean(), fmt) if len(s) == 1 else f"{s.mean():{fmt}} ± {s.std(ddof=1):{fmt}}"


def _reached(s: pd.Series, total: int, fmt: str) -> str:
    s = s.dropna()
    if s.empty:
        return f"not reached (0/{total})"
    return f"{s.median():{fmt}} ({len(s)}/{total})"


def variants(runs: pd.DataFrame) -> tuple[pd.Series, list[str]]:
    """What tells apart the rows of the report: the algorithm, plus any setting that differs between runs of the
    same algorithm and n besides the seed (κ in a fig8 sweep, say). Returns a label per run and those settings."""
    extra = load.varying(runs, ["algorithm", "workers"])
    label = runs["algorithm"].astype(str)
    for c in extra:
        short = c.removeprefix("algorithm.")
        text = runs[c].map(lambda v: f"{v:g}" if isinstance(v, float) else str(v))
        label = label.where(runs[c].isna(), label + " " + short + "=" + text)
    return label, extra


def table(runs: pd.DataFrame, m: pd.DataFrame, target: float) -> pd.DataFrame:
    """One row per (algorithm, n, and any other setting that varies), in the units a reader wants (strings)."""
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
        rows.append({
            "algorithm": a, **{c.removeprefix("algorithm."): g[c].iloc[0] for c in extra}, "n": int(n),
            "runs": len(g), "status": _status(g["status"]),
            "final train loss": _mean_sd(done["final_train_loss"]),
            "val accuracy": _mean_sd(done["val_accuracy"], ".4f"),
            "mean staleness": _mean_sd(g["mean_staleness"], ".2f"),
            f"worker steps to {target:g}": _reached(g["worker_step"], len(g), ".0f"),
            f"seconds to {target:g}": _reached(g["time_s"], len(g), ".1f"),
        })
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    order = ["n", "algorithm", *[c.removeprefix("algorithm.") for c in extra]]
    return out.sort_values(order, key=lambda c: c.map(plots.algorithm_order) if c.name == "algorithm" else c,
                           kind="stable").reset_index(drop=True)


def curves_figure(runs: pd.DataFrame, m: pd.DataFrame, target: float):
    """Every algorithm's training loss against worker steps, one panel per n, and the final loss against n."""
    label, _ = variants(runs)
    runs = runs.assign(variant=label)
    m = m.merge(runs[["run_dir", "variant"]], on="run_dir")
    ns = sorted(m["workers"].unique())
    variants_ = sorted(m["variant"].unique(), key=lambda v: (plots.algorithm_order(v.split(" ")[0]), v))
    palette = plots.colours(variants_)
    cols = len(ns) + 1
    fig, axes = plt.subplots(1, cols, figsize=(4.6 * cols, 4), squeeze=False)
    axes = axes[0]
    for ax, n in zip(axes, ns, strict=False):
        plots.curves(m[m["workers"] == n], ax, x="worker_step", y="loss", hue="variant", palette=palette)
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_title(f"n = {n}")
    plots.same_y(axes[:len(ns)])
    axes[0].legend(fontsize=8)
    plots.final_loss(runs, axes[-1], hue="variant", palette=palette)
    axes[-1].set_title("final training loss (completed runs)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"training loss against worker steps (mean over seeds, band: min–max; dashed and ×: diverged; "
                 f"dotted: target {target:g})", fontsize=10)
    fig.tight_layout()
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


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


def write(paths, out: str | Path, target: float = DEFAULT_TARGET) -> Path:
    """Write the report for every run under `paths` to `out` (.html or .md). Returns its path."""
    out = Path(out)
    if out.suffix not in (".html", ".md"):
        raise ValueError(f"--out {out}: the report is .html (figures embedded) or .md (figures beside it)")
    runs = load.runs(paths)
    if runs.empty:
        raise ValueError(f"no runs found under {paths}")
    m = load.commits(paths, columns=["algorithm", "workers", "seed", "status"], meta=runs)
    tab = table(runs, m, target)
    fig = _png(curves_figure(runs, m, target)) if len(m) else None
    sources = ", ".join(sorted({str(Path(d).parent) for d in runs["run_dir"]}))
    intro = (f"{len(runs)} runs from {sources}. {_describe(runs)}. Final training loss: mean ± sd over seeds of "
             f"each completed run's last 10% of commit losses. Steps and seconds to the target loss {target:g}: "
             "the median over the runs that reached it (how many did), on each run's curve smoothed over 5 bins. "
             "Seconds count from a run's first commit, on its own clock: wall time on the process engine, the "
             "simulation's compute time on the sim engine.")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".html":
        img = (f'<img alt="loss curves" src="data:image/png;base64,{base64.b64encode(fig).decode()}">'
               if fig else "<p>No commit rows to plot.</p>")
        out.write_text(
            "<!doctype html><html><head><meta charset='utf-8'><title>gem baselines report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:100%} table{border-collapse:collapse;font-size:13px}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} img{max-width:100%}</style></head><body>"
            f"<h1>Baselines report</h1><p>{html.escape(intro)}</p>"
            f"{tab.to_html(index=False, escape=True)}<h2>Loss curves</h2>{img}</body></html>\n")
    else:
        png = out.with_suffix(".png")
        if fig:
            png.write_bytes(fig)
        out.write_text(f"# Baselines report\n\n{intro}\n\n{tab.to_markdown(index=False)}\n\n"
                       + (f"![loss curves]({png.name})\n" if fig else "No commit rows to plot.\n"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="+", help="sweep or run directories")
    p.add_argument("--out", default="baselines.html", help="report file: .html (self-contained) or .md")
    p.add_argument("--target-loss", type=float, default=DEFAULT_TARGET, help="the loss for 'steps to target'")
    args = p.parse_args(argv)
    if not np.isfinite(args.target_loss) or args.target_loss <= 0:
        p.error(f"--target-loss={args.target_loss} is not allowed; it must be a number > 0")
    try:
        path = write(args.sweeps, args.out, args.target_loss)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
