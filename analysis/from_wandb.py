"""The frames of `analysis.load`, pulled from the W&B API instead of run directories (for runs logged online).

    from analysis.from_wandb import runs, commits
    r = runs("my-entity/gem", filters={"group": "fig1 2026-11-21 10:00:00"})
    m = commits("my-entity/gem", filters={"group": "..."})              # table="eval" for the evaluations

The columns match the local loader, so `analysis.plots`, `analysis.report` and `paper_figures` take these frames
too. `run_dir` holds the W&B run path (entity/project/id). Two differences: W&B holds every
`logger.wandb.log_every`-th commit row, not all of them, and its per-tensor π is not logged (heatmaps need the
run directory's tensors.parquet). A run resumed with `resume=true` is a second W&B run (status `failed` for the
part before the kill), so filter on `status` or use the run directory. Needs network access and an API key;
`api` lets a caller pass its own client.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from analysis.load import RAN, SUMMARY_COLUMNS, flatten

PREFIX = {"metrics": "train/", "eval": "eval/"}  # what experiments.wandb_logger puts before each column
STATE = {"running": "incomplete", "crashed": "failed", "failed": "failed", "killed": "failed"}


def _api(api):
    if api is not None:
        return api
    import wandb

    return wandb.Api(timeout=30)


def _record(run) -> dict:
    config = {k: v for k, v in dict(run.config).items() if not k.startswith("_")}
    rec = {k: v for k, v in flatten(config).items() if not k.startswith("logger.") and not k.startswith("hydra.")}
    summary = dict(run.summary)
    for k in RAN:
        if k in summary:
            rec[k] = summary[k]
    for k in SUMMARY_COLUMNS:
        rec[k] = summary.get(k)
    rec["status"] = summary.get("status") or STATE.get(getattr(run, "state", ""), "incomplete")
    rec.setdefault("experiment", None)
    rec["run_dir"] = "/".join(run.path) if isinstance(run.path, (list, tuple)) else str(run.path)
    return rec


def runs(path: str, filters: dict | None = None, api=None) -> pd.DataFrame:
    """One row per W&B run of `path` ("entity/project"), config and summary columns as in analysis.load.runs."""
    return pd.DataFrame.from_records([_record(r) for r in _api(api).runs(path, filters=filters)])


def commits(
    path: str, table: str = "metrics", filters: dict | None = None, api=None, columns: Iterable[str] | None = None
) -> pd.DataFrame:
    """The logged rows of `table` ("metrics": commit rows, "eval": evaluations) of every run, each with its
    run's columns, via `scan_history` (which pages through the whole history, unsampled)."""
    if table not in PREFIX:
        raise ValueError(f"table={table} is not on W&B; choose one of: {', '.join(PREFIX)}")
    prefix = PREFIX[table]
    frames = []
    for run in _api(api).runs(path, filters=filters):
        rec = _record(run)
        if columns is not None:
            rec = {k: rec.get(k) for k in [*columns, "run_dir"]}
        rows = []
        for row in run.scan_history():
            values = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
            if values:  # a W&B row can hold a commit and an evaluation at the same step
                rows.append({"step": int(row["_step"]), **values})
        if rows:
            t = pd.DataFrame(rows)
            frames.append(t.assign(**{k: v for k, v in rec.items() if k not in t.columns}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "run_dir"])
