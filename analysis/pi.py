"""GEM's π statistics by run and by a commit's own staleness (the mechanism of Fig. 3).

Every GEM commit row holds `pi_median` (the median of π over all elements at that commit) and `pi_zero_frac`
(the share of elements clamped to 0). Two views:

- `by_run`: each run's mean of the per-commit medians and zero fractions over the second half of its commits
  (training has settled by then; the paper's Fig. 3 is flat after its first ~5% of steps), then the mean over
  seeds, its standard deviation and the half-width of its 95% Student's t interval (`_ci`, analysis.stats).
- `by_staleness`: the same per-commit numbers grouped by τ/(n − 1) (a commit's staleness relative to round robin's),
  in buckets 0.25 wide centred on 0, 0.25, ..., 1 (round robin's τ = n − 1), ..., pooled over seeds: how π depends
  on the commit's own τ.

    python -m analysis.pi <sweep or run folders>... [--by engine.cycle_cv workers]

prints both as Markdown tables.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from analysis import load
from analysis.plots import require
from analysis.stats import mean_ci

BUCKET = 0.25  # width of a τ/(n − 1) bucket
MIN_COMMITS = 20  # a bucket with fewer commits is not shown: its mean is noise


def settled(m: pd.DataFrame) -> pd.DataFrame:
    """The commits both views read: those of completed runs (when `m` says), after the middle of each run's clock."""
    require(m, ["run_dir", "step", "pi_median", "pi_zero_frac", "staleness", "workers"], "analysis.pi")
    if "status" in m:
        m = m[m["status"] == "completed"]
    last = m.groupby("run_dir")["step"].transform("max")
    return m[m["step"] > last / 2]


def by_run(m: pd.DataFrame, by) -> pd.DataFrame:
    """One row per setting `by`: the mean (over seeds) of each run's mean median π and zero fraction over the
    second half of its commits, their standard deviations, and the number of seeds."""
    by = list(by)
    require(m, by, "analysis.pi.by_run")
    h = settled(m)
    per = h.groupby([*by, "run_dir"], dropna=False).agg(
        pi_median=("pi_median", "mean"),
        pi_zero_frac=("pi_zero_frac", "mean"),
        tau_mean=("staleness", "mean"),
        tau_sd=("staleness", "std"),
    )
    grouped = per.groupby(level=by, dropna=False)
    out = grouped.agg(["mean", "std"])
    out.columns = [f"{a}_{b}" if b == "std" else a for a, b in out.columns]
    for c in per.columns:  # the 95% t interval's half-width, as every table gives it (analysis.stats)
        out[f"{c}_ci"] = grouped[c].agg(lambda v: mean_ci(v).half_width)
    out["seeds"] = grouped.size()
    return out.reset_index()


def by_staleness(m: pd.DataFrame, by=("workers",)) -> pd.DataFrame:
    """Per setting `by` and τ/(n − 1) bucket (its centre in `tau_rel`): the mean of the per-commit median π and
    zero fraction over the second half of every run, and how many commits; buckets with fewer than
    MIN_COMMITS commits are dropped."""
    by = list(by)
    require(m, by, "analysis.pi.by_staleness")
    h = settled(m)
    h = h[h["workers"] > 1]
    rel = h["staleness"] / (h["workers"] - 1)
    h = h.assign(tau_rel=np.floor(rel / BUCKET + 0.5) * BUCKET)  # halves up, not to even
    out = (
        h.groupby([*by, "tau_rel"], dropna=False)
        .agg(pi_median=("pi_median", "mean"), pi_zero_frac=("pi_zero_frac", "mean"), commits=("pi_median", "size"))
        .reset_index()
    )
    return out[out["commits"] >= MIN_COMMITS]


def markdown(t: pd.DataFrame) -> str:
    """Counts as integers, settings as given, statistics to 3 decimals."""
    return t.to_markdown(index=False, floatfmt=tuple(".3f" if c.startswith(("pi_", "tau_")) else "g" for c in t))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.pi", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="sweep or run folders")
    p.add_argument("--by", nargs="+", default=["workers"], help="settings to group runs by (default: workers)")
    args = p.parse_args(argv)
    try:
        r = load.runs(args.paths)
    except (FileNotFoundError, ValueError) as e:  # a folder that does not exist: one line, as the report says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    r = r[r["algorithm"] == "gem"] if "algorithm" in r else r
    if r.empty:
        print(
            f"error: no GEM runs under {' '.join(args.paths)}: π is GEM's (pass the folder of a sweep with "
            "algorithm=gem)",
            file=sys.stderr,
        )
        return 2
    missing = [k for k in args.by if k not in r.columns]
    if missing:
        print(
            f"error: --by {' '.join(missing)}: not a setting of these runs; settings are dotted config keys "
            f"such as workers, engine.cycle_cv, algorithm.kappa",
            file=sys.stderr,
        )
        return 2
    mixed = load.varying(r, args.by)
    if mixed:
        print(
            f"error: runs with the same {', '.join(args.by)} differ in {', '.join(mixed[:3])}: add them to --by, or "
            f"pass folders that differ only in {', '.join(args.by)} and seed",
            file=sys.stderr,
        )
        return 2
    m = load.commits(args.paths, columns=list(dict.fromkeys([*args.by, "workers", "status"])), meta=r)
    unfinished = r[r["status"] != "completed"]
    if len(unfinished):
        left = (f"{d} ({s})" for d, s in zip(unfinished["run_dir"], unfinished["status"], strict=True))
        print(f"left out, not completed: {', '.join(left)}\n")
    by = ", ".join(args.by)
    print(
        f"## π by run: per {by}, the mean over seeds of each run's mean median π and zero fraction over the "
        "second half of its commits\n"
    )
    print(markdown(by_run(m, args.by)))
    print(
        f"\n## π by each commit's own staleness: per {by} and τ/(n − 1) bucket (`tau_rel`, its centre), the "
        f"mean of the per-commit median π over the second half of every run (buckets of fewer than {MIN_COMMITS} "
        "commits left out)\n"
    )
    print(markdown(by_staleness(m, args.by)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
