"""Load run directories, or whole sweeps, into tidy pandas DataFrames.

    from analysis.load import runs, commits
    r = runs("multirun/2026-11-21/13-52-44-846955")        # one row per run: config + summary
    m = commits(["multirun/a", "multirun/b"])              # one row per commit, with its run's columns

A run directory is any folder with a `summary.json` or a `.hydra/config.yaml`; a sweep is any folder above
them. Every run is kept, whatever its status: `completed`, `diverged`, `failed`, or `incomplete` when it has no
summary (killed before it could write one). Config columns are the composed config, flattened to dotted keys
(`lr`, `workers`, `algorithm.kappa`, `engine.staleness`, ...; a group's `name` becomes the group's own column,
`algorithm`, `engine`, `model`, `data`), so runs of different sweeps line up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from gem.metrics import read_table

SUMMARY_COLUMNS = ("status", "reason", "steps", "final_train_loss", "val_loss", "val_accuracy", "test_loss",
                   "test_accuracy", "mean_staleness", "pi_median", "wall_time_s", "lost_workers", "staleness_model",
                   "stopped_by")
GROUPS = ("algorithm", "engine", "model", "data", "logger")
# Summary keys that say what actually ran, over the config's request (a sequential algorithm runs 1 worker, say)
RAN = ("algorithm", "engine", "workers", "model", "data", "seed", "lr", "momentum", "batch_size", "epochs",
       "experiment", "train_examples")


def find_runs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Every run directory at or below the given paths, sorted, each once."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such run or sweep directory")
        if _is_run(p):
            found.add(p.resolve())
            continue
        for marker in list(p.rglob("summary.json")) + list(p.rglob(".hydra/config.yaml")):
            run = marker.parent if marker.name == "summary.json" else marker.parent.parent
            # a sweep's `.superseded/` holds the attempts a resumed sweep replaced: kept, never analysed
            hidden = any(part.startswith(".") for part in run.relative_to(p).parts)
            if _is_run(run) and "wandb" not in run.parts and not hidden:
                found.add(run.resolve())
    return sorted(found)


def _is_run(p: Path) -> bool:
    return (p / "summary.json").exists() or (p / ".hydra" / "config.yaml").exists()


def flatten(node: dict, prefix: str = "") -> dict:
    """Nested config to dotted keys; `<group>.name` becomes `<group>`."""
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif k == "name" and prefix.rstrip(".") in GROUPS:
            out[prefix.rstrip(".")] = v
        else:
            out[key] = v
    return out


def run_record(run_dir: Path) -> dict:
    """One run's config and summary as a flat dict."""
    rec: dict = {}
    config = run_dir / ".hydra" / "config.yaml"
    if config.exists():
        rec.update({k: v for k, v in flatten(_config(config)).items() if not k.startswith("logger.")})
    rec["experiment"] = experiment_of(run_dir)
    summary = _summary(run_dir / "summary.json")
    rec["workers_requested"] = summary.get("workers_requested", rec.get("workers"))  # before `workers` says what ran
    for k in RAN:
        if k in summary:
            rec[k] = summary[k]
    for k in SUMMARY_COLUMNS:
        rec[k] = summary.get(k)
    rec["status"] = summary.get("status", "incomplete")
    if not summary:  # killed before its summary: what the summary would say, from the config
        _as_the_summary_would(rec)
    if isinstance(rec.get("lost_workers"), list):
        rec["lost_workers"] = len(rec["lost_workers"])
    rec["run_dir"] = str(run_dir)
    return rec


def _summary(path: Path) -> dict:
    """A run's summary.json ({} when absent); ValueError naming the file when it is not a JSON object."""
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); move that run directory aside or delete it") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path} holds a JSON {type(summary).__name__}, not a run's summary (an object); move that "
                         "run directory aside or delete it")
    return summary


def _as_the_summary_would(rec: dict) -> None:
    """A run killed before its summary has only its config, which names a model or dataset by `_target_` and
    records the workers asked for: fill in what the summary would have said (the names the runner gives, 1 worker
    for a sequential algorithm), so that it lines up with its completed seeds instead of looking like another
    setting."""
    from experiments.instantiate import display_name
    from gem import algorithms

    for group in ("model", "data"):
        if rec.get(group) is None and isinstance(rec.get(f"{group}._target_"), str):
            rec[group] = display_name(group, {"_target_": rec[f"{group}._target_"]})
    if isinstance(rec.get("algorithm"), str) and rec.get("workers") is not None:
        rec["workers"] = algorithms.workers_that_run(rec["algorithm"], rec["workers"])


def _config(path: Path) -> dict:
    """A run's composed config with its interpolations resolved. Hydra saves `.hydra/config.yaml` unresolved
    (`batch_size: ${per_worker:256}`); a run killed before its summary has nothing else to say what ran."""
    from omegaconf import DictConfig, OmegaConf

    import experiments.schema  # noqa: F401 - registers the resolvers the experiments use (per_worker)

    try:
        node = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - YAML's own errors: a damaged or foreign file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path} cannot be read as YAML ({first}); move that run directory aside or delete it") \
            from None
    if not isinstance(node, DictConfig):
        raise ValueError(f"{path} holds a YAML {type(node).__name__}, not a run's config; move that run directory "
                         "aside or delete it")
    if "hydra" in node:
        del node["hydra"]
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation that cannot be resolved here: keep what can be read, drop the rest
        raw = OmegaConf.to_container(node, resolve=False)
        return _drop_interpolations(raw)


def _drop_interpolations(node):
    if isinstance(node, dict):
        return {k: _drop_interpolations(v) for k, v in node.items()}
    return None if isinstance(node, str) and "${" in node else node


def experiment_of(run_dir: Path) -> str | None:
    """The `experiment=` a run was launched with (Hydra records the choice in `.hydra/hydra.yaml`)."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.exists():
        return None
    in_choices = False
    for line in path.read_text().splitlines():  # a line scan: yaml-loading all of hydra.yaml is 20x slower
        if line.rstrip() == "    choices:":  # hydra.runtime.choices
            in_choices = True
            continue
        if in_choices:
            key, _, value = line.strip().partition(":")
            if not line.startswith("      "):
                return None
            if key == "experiment":
                return None if value.strip() in ("", "null") else value.strip()
    return None


# Columns that may differ between the seeds of one curve: the seed itself, results, and where things live.
NOT_SETTINGS = {"seed", "run_dir", "experiment", "data.root", "data.download", "resume", "plan", "device",
                "train_examples", "workers_requested",
                *SUMMARY_COLUMNS}


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
            return (f"{len(g)} runs share {what} ({dirs}): the same seed twice is not two seeds; pass each run "
                    "once")
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
        return len(jobs_of(dict(hydra["sweeper"].get("params") or {}), list(hydra["overrides"]["task"]),
                           hydra["sweeper"].get("grids")))
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
        found = sum(1 for d in Path(sweep).iterdir() if d.is_dir() and _is_run(d))
        if planned > found and short:
            out.append(f"{planned - found} of the {planned} jobs of sweep {Path(sweep).name} have not run")
        elif planned > found:
            out.append(f"{planned - found} of the {planned} jobs of sweep {sweep} have not run (to run them: the "
                       f"identical -m command with hydra.sweep.dir={sweep} resume=true)")
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


def runs(paths) -> pd.DataFrame:
    """One row per run: config columns, then summary columns; `run_dir` identifies the run."""
    records = [run_record(d) for d in find_runs(paths)]
    return pd.DataFrame.from_records(records, columns=None if records else ["run_dir", "status"])


def commits(paths, table: str = "metrics", columns: Iterable[str] | None = None,
            meta: pd.DataFrame | None = None) -> pd.DataFrame:
    """The rows of `table` (metrics, eval or tensors) of every run, each joined with its run's columns
    (`columns`, default: every config and summary column). Runs without that table add no rows. `meta`: the
    runs frame of `paths`, when the caller has already loaded it."""
    meta = runs(paths) if meta is None else meta
    keep = list(columns) if columns is not None else [c for c in meta.columns if c != "reason"]
    if "run_dir" not in keep:
        keep.append("run_dir")
    frames = []
    # reindex: a column this sweep does not have (algorithm.kappa without a GEM run, say) comes back empty
    for rec in meta.reindex(columns=keep).to_dict("records"):
        t = read_table(rec["run_dir"], table)
        if len(t):
            clash = [c for c in rec if c in t.columns and c != "run_dir"]
            frames.append(t.assign(**{c: rec[c] for c in rec if c not in clash}))
    if not frames:
        return pd.DataFrame(columns=keep)
    return pd.concat(frames, ignore_index=True)
