"""Read run directories: one flat record per run, its composed config and its summary.

`experiments/` writes run directories (`rundir`, `runner`); this is the other half, reading them back, which both
the Python API (`api.sweep` returns its runs) and `analysis/` use. A run directory is any folder with a
`summary.json` or a `.hydra/config.yaml`; a sweep is any folder above them. Every run is kept, whatever its status:
`completed`, `diverged`, `failed`, `incomplete` when it has no summary (killed before it could write one), or
`unreadable` when one of its files cannot be read (its reason names the file). Config
columns are the composed config, flattened to dotted keys (`lr`, `workers`, `algorithm.kappa`, `engine.staleness`,
...; a group's `name` becomes the group's own column, `algorithm`, `engine`, `model`, `data`), so runs of different
sweeps line up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

SUMMARY_COLUMNS = (
    "status",
    "reason",
    "steps",
    "final_train_loss",
    "val_loss",
    "val_accuracy",
    "test_loss",
    "test_accuracy",
    "mean_staleness",
    "pi_median",
    "dropped_commits",
    "wall_time_s",
    "lost_workers",
    "staleness_model",
    "stopped_by",
)
GROUPS = ("algorithm", "engine", "model", "data", "logger")
TABLES = ("metrics", "eval", "tensors")  # a run directory's Parquet tables (docs/contract.md)
# Summary keys that say what actually ran, over the config's request (a sequential algorithm runs 1 worker, say)
RAN = (
    "algorithm",
    "engine",
    "workers",
    "model",
    "data",
    "seed",
    "lr",
    "momentum",
    "batch_size",
    "epochs",
    "experiment",
    "train_examples",
)


def find_runs(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Every run directory at or below the given paths, sorted, each once."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such run or sweep directory")
        if is_run(p):
            found.add(p.resolve())
            continue
        for marker in list(p.rglob("summary.json")) + list(p.rglob(".hydra/config.yaml")):
            run = marker.parent if marker.name == "summary.json" else marker.parent.parent
            # a sweep's `.superseded/` holds the attempts a resumed sweep replaced: kept, never analysed
            hidden = any(part.startswith(".") for part in run.relative_to(p).parts)
            if is_run(run) and "wandb" not in run.parts and not hidden:
                found.add(run.resolve())
    return sorted(found)


def is_run(p: Path) -> bool:
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
    """One run's config and summary as a flat dict. A run whose files cannot be read (a summary, a config or a
    table cut short or overwritten) is `unreadable`, its reason naming the file: one damaged run is left out and
    said, never an error that hides its sweep."""
    rec: dict = {}
    damaged = []
    config = run_dir / ".hydra" / "config.yaml"
    if config.exists():
        try:
            rec.update({k: v for k, v in flatten(_config(config)).items() if not k.startswith("logger.")})
        except ValueError as e:
            damaged.append(str(e))
    rec["experiment"] = experiment_of(run_dir)
    try:
        summary = _summary(run_dir / "summary.json")
    except ValueError as e:
        summary = {}
        damaged.append(str(e))
    damaged += unreadable_tables(run_dir)
    rec["workers_requested"] = summary.get("workers_requested", rec.get("workers"))  # before `workers` says what ran
    for k in RAN:
        if k in summary:
            rec[k] = summary[k]
    for k in SUMMARY_COLUMNS:
        rec[k] = summary.get(k)
    rec["status"] = summary.get("status", "incomplete")
    if not summary:  # killed before its summary: what the summary would say, from the config
        _as_the_summary_would(rec)
    if damaged:
        rec["status"], rec["reason"] = "unreadable", damaged[0]
    if isinstance(rec.get("lost_workers"), list):
        rec["lost_workers"] = len(rec["lost_workers"])
    rec["run_dir"] = str(run_dir)
    return rec


def unreadable_tables(run_dir: Path) -> list[str]:
    """A line for each of the run's Parquet files (its tables, and the parts of a run that did not close) that
    cannot be read: a file cut short has no footer. Only the footers are read: cheap for a whole sweep."""
    import pyarrow.parquet as pq

    out = []
    for name in TABLES:
        for f in [run_dir / f"{name}.parquet", *sorted((run_dir / f"{name}.parts").glob("part-*.parquet"))]:
            if not f.exists():
                continue
            try:
                pq.read_metadata(f)
            except Exception as e:  # noqa: BLE001 - pyarrow's own errors: a damaged or foreign file
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                out.append(f"{f} cannot be read as Parquet ({first}); move that run directory aside or delete it")
    return out


def _summary(path: Path) -> dict:
    """A run's summary.json ({} when absent); ValueError naming the file when it is not a JSON object."""
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); move that run directory aside or delete it") from None
    if not isinstance(summary, dict):
        raise ValueError(
            f"{path} holds a JSON {type(summary).__name__}, not a run's summary (an object); move that "
            "run directory aside or delete it"
        )
    return summary


def _as_the_summary_would(rec: dict) -> None:
    """A run killed before its summary has only its config, which names a model or dataset by `_target_` and
    records the workers asked for: fill in what the summary would have said (the names the runner gives, 1 worker
    for a sequential algorithm), so that it lines up with its completed seeds instead of looking like another
    setting."""
    from experiments.instantiate import display_name  # torch: imported only for a run killed before its summary
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

    from experiments import schema  # noqa: F401 - registers the resolvers the experiments use (per_worker)

    try:
        node = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - YAML's own errors: a damaged or foreign file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{path} cannot be read as YAML ({first}); move that run directory aside or delete it"
        ) from None
    if not isinstance(node, DictConfig):
        raise ValueError(
            f"{path} holds a YAML {type(node).__name__}, not a run's config; move that run directory aside or delete it"
        )
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


def runs(paths) -> pd.DataFrame:
    """One row per run: config columns, then summary columns; `run_dir` identifies the run."""
    records = [run_record(d) for d in find_runs(paths)]
    return pd.DataFrame.from_records(records, columns=None if records else ["run_dir", "status"])
