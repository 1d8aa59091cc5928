"""Load run directories, or whole sweeps, into tidy pandas DataFrames.

    from analysis.load import runs, commits
    r = runs("multirun/2026-11-21/13-52-44-846955")        # one row per run: config + summary
    m = commits(["multirun/a", "multirun/b"])              # one row per commit, with its run's columns

`runs` (one record a run) is `experiments.runs.runs`, re-exported: the Python API's `sweep` returns it too, and
`experiments/` sits below `analysis/`. What a row holds is described there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from experiments.runs import (  # noqa: F401 - reading a run directory lives beside writing one; re-exported here
    GROUPS,
    RAN,
    SUMMARY_COLUMNS,
    experiment_of,
    find_runs,
    flatten,
    is_run,
    run_record,
    runs,
)
from gem.metrics import read_table

# Columns that may differ between the seeds of one curve: the seed itself, results, and where things live.
NOT_SETTINGS = {
    "seed",
    "run_dir",
    "experiment",
    "data.root",
    "data.download",
    "resume",
    "plan",
    "device",
    "train_examples",
    "workers_requested",
    *SUMMARY_COLUMNS,
}


def varying(runs: pd.DataFrame, keys) -> list[str]:
    """Settings that differ between runs sharing the same `keys` (other than the seed): averaging such runs
    as if they were seeds would mix, say, κ = 1 and κ = 4 into one curve."""
    keys = list(keys)
    cols = [c for c in runs.columns if c not in NOT_SETTINGS and c not in keys and not c.startswith("logger.")]
    found = set()
    for _, g in runs.groupby(keys, dropna=False) if keys else [(None, runs)]:
        found.update(c for c in cols if g[c].map(str).nunique() > 1)  # map(str): NaN against a value counts
    return sorted(found)


def without_twins(runs: pd.DataFrame) -> pd.DataFrame:
    """A sweep over n runs a sequential algorithm (momentum SGD) once per n although it ignores n: the same
    computation, once per n. Keep one of each such set of twins (a completed one where there is one), so that no
    figure or table counts them as several seeds; every other run is kept as it is."""
    if runs.empty or "workers_requested" not in runs or "workers" not in runs:
        return runs
    twin = runs["workers_requested"].notna() & (runs["workers_requested"].map(str) != runs["workers"].map(str))
    if not twin.any():
        return runs
    settings = [c for c in runs.columns if (c not in NOT_SETTINGS or c == "seed") and not c.startswith("logger.")]
    seq = runs[twin].sort_values("status", key=lambda s: s != "completed", kind="stable")
    keep = seq.loc[~seq[settings].map(str).duplicated(), "run_dir"]
    return runs[~twin | runs["run_dir"].isin(keep)]


def repeated_seeds(runs: pd.DataFrame, keys) -> str:
    """One line when two runs share `keys` and the seed (the same sweep passed twice, say): averaged as two
    seeds they would narrow every interval without a second draw of anything. Empty when every seed is once."""
    keys = [k for k in keys if k in runs.columns]
    if runs.empty or "seed" not in runs.columns:
        return ""
    for values, g in runs.groupby([*keys, "seed"], dropna=False):
        if len(g) > 1:
            what = ", ".join(f"{k}={v}" for k, v in zip([*keys, "seed"], values, strict=True))
            dirs = " and ".join(sorted(g["run_dir"])[:3]) + (" ..." if len(g) > 3 else "")
            return f"{len(g)} runs share {what} ({dirs}): the same seed twice is not two seeds; pass each run once"
    return ""


def planned_jobs(sweep: str | os.PathLike) -> int | None:
    """How many jobs the sweep in `sweep` was launched with, read from its `multirun.yaml`: the jobs its sweeper's
    params and its command line make (experiments.config.jobs_of, the expansion gem's sweeper launches; Hydra's
    basic sweeper makes the same). None when there is no such file or it cannot be read that way (another
    sweeper)."""
    import yaml

    from experiments.config import jobs_of

    path = Path(sweep) / "multirun.yaml"
    try:
        hydra = yaml.safe_load(path.read_text())["hydra"]
        target = str(hydra["sweeper"].get("_target_", ""))
        if "basic_sweeper" not in target and "GemSweeper" not in target:
            return None
        return len(
            jobs_of(
                dict(hydra["sweeper"].get("params") or {}),
                list(hydra["overrides"]["task"]),
                hydra["sweeper"].get("grids"),
            )
        )
    except Exception:  # no multirun.yaml, or not one this can count
        return None


def unstarted(r: pd.DataFrame, short: bool = False) -> str:
    """One sentence on the jobs of the sweeps behind `r` (a `runs` frame) that have no run directory at all (a
    sweep stopped before it reached them): "25 of the 36 jobs of sweep multirun/x have not run (resume: the
    identical -m command with hydra.sweep.dir=multirun/x resume=true)"; empty when none is missing. `short`: the
    count only, for a figure's title."""
    if r.empty or "run_dir" not in r:
        return ""
    out = []
    for sweep in sorted({str(Path(d).parent) for d in r["run_dir"]}):
        planned = planned_jobs(sweep)
        if planned is None:
            continue
        # every job folder of the sweep, not only the runs in `r` (a figure may draw the GEM runs of a sweep alone)
        found = sum(1 for d in Path(sweep).iterdir() if d.is_dir() and is_run(d))
        if planned > found and short:
            out.append(f"{planned - found} of the {planned} jobs of sweep {Path(sweep).name} have not run")
        elif planned > found:
            out.append(
                f"{planned - found} of the {planned} jobs of sweep {sweep} have not run (to run them: the "
                f"identical -m command with hydra.sweep.dir={sweep} resume=true)"
            )
    return "; ".join(out)


def describe(r: pd.DataFrame) -> str:
    """One line on a set of runs (a `runs` frame) for the terminal, what a figure's title and a report say: how
    many runs of each status, that means and final losses are over the completed ones, and the jobs of their
    sweeps that have not run."""
    status = r["status"].fillna("incomplete").astype(str) if "status" in r else pd.Series(dtype=object)
    counts = status.value_counts()
    order = ["completed", *sorted(set(counts.index) - {"completed"})]
    line = f"{len(r)} run{'s' if len(r) != 1 else ''}: " + ", ".join(f"{counts[k]} {k}" for k in order if k in counts)
    if len(counts) > 1 or "completed" not in counts:
        line += f"; means and final losses are over the {counts.get('completed', 0)} completed"
    missing = unstarted(r)
    return f"{line}; {missing}" if missing else line


def commits(
    paths, table: str = "metrics", columns: Iterable[str] | None = None, meta: pd.DataFrame | None = None
) -> pd.DataFrame:
    """The rows of `table` (metrics, eval or tensors) of every run, each joined with its run's columns
    (`columns`, default: every config and summary column). Runs without that table add no rows, and nor do
    `unreadable` ones (a damaged file: their status and reason say which). `meta`: the runs frame of `paths`, when
    the caller has already loaded it."""
    meta = runs(paths) if meta is None else meta
    damaged = set(meta.loc[meta["status"] == "unreadable", "run_dir"]) if "status" in meta else set()
    keep = list(columns) if columns is not None else [c for c in meta.columns if c != "reason"]
    if "run_dir" not in keep:
        keep.append("run_dir")
    frames = []
    # reindex: a column this sweep does not have (algorithm.kappa without a GEM run, say) comes back empty
    for rec in meta.reindex(columns=keep).to_dict("records"):
        if rec["run_dir"] in damaged:
            continue
        t = read_table(rec["run_dir"], table)
        if len(t):
            clash = [c for c in rec if c in t.columns and c != "run_dir"]
            frames.append(t.assign(**{c: rec[c] for c in rec if c not in clash}))
    if not frames:
        return pd.DataFrame(columns=keep)
    return pd.concat(frames, ignore_index=True)
