"""Time to a target: when each run's central variable first reaches a validation loss, in the clocks that mean
something on its engine; the target chosen as AlgoPerf chooses it; and performance profiles over workloads.

    from analysis import target
    t = target.announce(runs)                       # per workload: the best method's median final val loss
    hit = target.times(runs, evals, t)              # per run: worker steps, commits and time to it (inf: never)
    prof = target.profile(target.per_method(hit))   # Dolan and Moré's performance profile over the workloads

Clocks. A run's time to the target is read at its evaluations (every `logger.eval_every` commits): the first one
whose validation loss is at or below the target. It is given as worker steps (each worker's local steps, t·λ/n, the
x axis of the paper's figures), as commits (t) and in the engine's own time:
- on `process` and `distributed`, wall-clock seconds from the run's first commit (starting n processes is not
  training);
- on `sim`, the simulated time (`sim_time`, in mean cycles of one local step), never the machine's seconds: the sim
  engine runs every virtual worker in turn on one process, so its seconds measure this machine, not the method.
A run that never gets there has an infinite time (AlgoPerf scores it so); a run that diverged counts the same
unless it got there first; a failed or killed run has no time (NaN): it might have got there.

The target (AlgoPerf, Dahl et al. 2023, sets each workload's target from its tuned baselines, before the
submissions are scored): per workload (data, engine, staleness model, n), each method's median over seeds of its
final validation loss (a diverged seed counts as +inf), and the lowest of these medians is the target. Over an even
number of seeds each median is taken on the side of reaching: the target is the upper middle value (with 2 tuning
seeds, the best method's worse seed: both of them reach it), and a method's time (below) the lower middle one (it
counts as reaching the target when at least half of its seeds do). `announce`
computes it from one set of runs (the tuning sweep's, on its tuning seeds); the comparison then measures other runs
(the held-out seeds) against it. Computed from the very runs it scores, the target is not announced in advance,
and every report that does so says it.

The performance profile (Dolan and Moré 2002, as AlgoPerf aggregates): for each method and workload, the ratio of
its time to the best method's time on that workload (a method that never reached the target: +inf); ρ(r) is the
fraction of workloads on which the method is within a factor r of the best (Dolan and Moré's τ, a letter this
project keeps for staleness). Each method's time on a workload is
the median over its seeds (with an infinite time for a seed that never reached the target, so a method that
reached it on fewer than half of its seeds has none).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from gem.metrics import read_table

METRIC = "val_loss"  # what the target is on: the central variable's loss on the validation split
WORKLOAD = ("data", "engine", "staleness_model", "workers")  # what a workload is, where the runs say it
ENDED = ("completed", "diverged")  # a run that ended: it has a time (finite or not)
RATIO_MAX = 4.0  # the profile's x axis runs from 1 to this (AlgoPerf's r_max)


def upper_median(values) -> float:
    """The median, the higher of the two middle values for an even count."""
    v = np.sort(np.asarray(values, dtype=float))
    return float(v[len(v) // 2]) if len(v) else math.nan


def lower_median(values) -> float:
    """The median, the lower of the two middle values for an even count."""
    v = np.sort(np.asarray(values, dtype=float))
    return float(v[(len(v) - 1) // 2]) if len(v) else math.nan


def workload_keys(runs: pd.DataFrame) -> list[str]:
    """The columns of WORKLOAD that the runs have."""
    return [k for k in WORKLOAD if k in runs.columns]


def describe_workload(row) -> str:
    """`mnist, sim, gamma (CV 0.25), n = 10`."""
    parts = [str(row[k]) for k in ("data", "engine", "staleness_model") if k in row and pd.notna(row[k])]
    if "workers" in row and pd.notna(row["workers"]):
        parts.append(f"n = {int(row['workers'])}")
    return ", ".join(parts)


def _final(run: pd.Series) -> float:
    """A run's final validation loss as the target's choice sees it: +inf for a diverged run, NaN (not counted)
    for a failed or killed one."""
    if run.get("status") == "diverged":
        return math.inf
    if run.get("status") != "completed":
        return math.nan
    v = pd.to_numeric(pd.Series([run.get(METRIC)]), errors="coerce").iloc[0]
    return float(v) if np.isfinite(v) else math.inf


def announce(runs: pd.DataFrame, method: str = "variant") -> pd.DataFrame:
    """Per workload: the target (the lowest over methods of a method's median final validation loss over its
    seeds), the method that set it, and how many runs it was read from. `method` names the column that tells the
    methods apart (the report's variants: the algorithm and any setting that differs); `algorithm` when absent."""
    if method not in runs.columns:
        method = "algorithm"
    keys = workload_keys(runs)
    r = runs.assign(_final=runs.apply(_final, axis=1))
    r = r[r["_final"].notna()]
    rows = []
    for key, g in r.groupby(keys, dropna=False, sort=True) if keys else [((), r)]:
        medians = g.groupby(method)["_final"].agg(upper_median)
        finite = medians[np.isfinite(medians)]
        if finite.empty:
            continue
        best = finite.idxmin()
        rows.append(
            {
                **dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True)),
                "target": float(finite.min()),
                "set_by": best,
                "from_runs": len(g),
            }
        )
    return pd.DataFrame(rows, columns=[*keys, "target", "set_by", "from_runs"])


def _text(v) -> str:
    """A workload's value as one text whatever its type: 10, 10.0 and "10" alike; nothing for a missing one."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return str(int(v))
    return str(v)


def _first_commit_s(run_dir: str) -> float:
    m = read_table(run_dir, "metrics")
    return float(m["time_s"].min()) if len(m) and "time_s" in m else 0.0


def _sim_time(run_dir: str, ev: pd.DataFrame) -> pd.Series:
    """The simulated clock at each evaluation: its own column, or (a run from before eval rows carried it) the
    commit row's at that step; 0 at t = 0."""
    if "sim_time" in ev and ev["sim_time"].notna().all():
        return ev["sim_time"].astype(float)
    m = read_table(run_dir, "metrics")
    if not len(m) or "sim_time" not in m:
        return pd.Series(np.nan, index=ev.index)
    at = m.drop_duplicates("step").set_index("step")["sim_time"]
    return ev["step"].map(at).where(ev["step"] > 0, 0.0).astype(float)


def times(runs: pd.DataFrame, evals: pd.DataFrame, targets: pd.DataFrame | float) -> pd.DataFrame:
    """One row per run: its target, whether it reached it, and when: `worker_step`, `step` (commits), `seconds`
    (process, distributed: wall clock from its first commit) or `sim_time` (sim), and `time`, the engine's own
    (seconds or sim_time; `clock` says which). +inf when it never got there, NaN when it did not end or when its
    workload has no target (`targets` announced for other workloads). `targets`: a number for every run, or
    `announce`'s frame, joined on the workload's columns."""
    keys = workload_keys(runs)
    if isinstance(targets, (int, float)):
        r = runs.assign(target=float(targets))
    else:
        on = [k for k in keys if k in targets.columns]
        if on:  # joined on the workload's values as text: a CSV read back, or a column with no value, still meets
            left = runs.assign(**{f"_{k}": runs[k].map(_text) for k in on})
            right = targets.assign(**{f"_{k}": targets[k].map(_text) for k in on})[[f"_{k}" for k in on] + ["target"]]
            r = left.merge(right, on=[f"_{k}" for k in on], how="left").drop(columns=[f"_{k}" for k in on])
        else:
            r = runs.assign(target=float(targets["target"].iloc[0]))
    by_run = dict(tuple(evals.groupby("run_dir"))) if len(evals) else {}
    out = []
    for run in r.to_dict("records"):
        engine = run.get("engine")
        clock = "sim_time" if engine == "sim" else "seconds"
        rec = {
            "run_dir": run["run_dir"],
            "target": run["target"],
            "clock": clock,
            "reached": False,
            "worker_step": math.nan,
            "step": math.nan,
            "seconds": math.nan,
            "sim_time": math.nan,
            "time": math.nan,
        }
        ev = by_run.get(run["run_dir"])
        ended = run.get("status") in ENDED
        if ev is not None and len(ev) and np.isfinite(run["target"]) and METRIC in ev:
            ev = ev.sort_values("step")
            hit = ev[pd.to_numeric(ev[METRIC], errors="coerce") <= run["target"]]
            if len(hit):
                first = hit.iloc[0]
                rec.update(reached=True, worker_step=float(first["worker_step"]), step=float(first["step"]))
                if engine == "sim":
                    rec["sim_time"] = float(_sim_time(run["run_dir"], ev).loc[hit.index[0]])
                else:
                    rec["seconds"] = max(0.0, float(first["time_s"]) - _first_commit_s(run["run_dir"]))
                rec["time"] = rec[clock]
        if not rec["reached"] and ended and np.isfinite(run["target"]):  # AlgoPerf: never reached takes forever
            rec.update(worker_step=math.inf, step=math.inf, time=math.inf, **{clock: math.inf})
        out.append(rec)
    return pd.DataFrame(out)


def per_method(runs: pd.DataFrame, hit: pd.DataFrame, method: str = "variant") -> pd.DataFrame:
    """Per workload and method: the median over its ended runs of the time to the target (`time`, the engine's
    clock, and `worker_step`), how many reached it, of how many."""
    if method not in runs.columns:
        method = "algorithm"
    keys = workload_keys(runs)
    r = runs[["run_dir", method, *keys]].merge(hit, on="run_dir")
    r = r[np.isfinite(r["time"]) | np.isinf(r["time"])]  # ended runs only (NaN: it might have got there)
    rows = []
    for key, g in r.groupby([*keys, method], dropna=False, sort=True):
        rows.append(
            {
                **dict(zip([*keys, method], key, strict=True)),
                "method": key[-1],
                "time": lower_median(g["time"]),
                "worker_step": lower_median(g["worker_step"]),
                "clock": g["clock"].iloc[0],
                "reached": int(g["reached"].sum()),
                "runs": len(g),
                "target": float(g["target"].iloc[0]),
            }
        )
    return pd.DataFrame(rows)


def profile(methods: pd.DataFrame, at: np.ndarray | None = None) -> tuple[pd.DataFrame, list[str]]:
    """Dolan and Moré's performance profile of `per_method`'s frame: one row per (method, r) with ρ, the fraction
    of workloads on which the method's time is within r times the best method's (at `at`, default a grid from 1 to
    RATIO_MAX). Returns it and the workloads
    left out because no method reached the target on them (each said in one line)."""
    keys = [k for k in WORKLOAD if k in methods.columns]
    at = np.geomspace(1.0, RATIO_MAX, 200) if at is None else np.asarray(at, dtype=float)
    ratios: dict[str, list[float]] = {m: [] for m in methods["method"].unique()}
    dropped = []
    for key, g in methods.groupby(keys, dropna=False, sort=True) if keys else [((), methods)]:
        best = g["time"].min()
        if not np.isfinite(best):
            dropped.append(describe_workload(dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))))
            continue
        for _, row in g.iterrows():
            # a best time of 0 (reached at the first evaluation): the others' ratios are taken against one unit
            ratios[row["method"]].append(row["time"] / best if best > 0 else (1.0 if row["time"] == 0 else math.inf))
        for m in set(ratios) - set(g["method"]):  # a method that did not run on this workload: never there
            ratios[m].append(math.inf)
    rows = []
    for m, rs in ratios.items():
        rs = np.asarray(rs, dtype=float)
        for r in at:
            rows.append(
                {
                    "method": m,
                    "r": float(r),
                    "rho": float((rs <= r * (1 + 1e-12)).mean()) if len(rs) else math.nan,
                    "workloads": len(rs),
                }
            )
    return pd.DataFrame(rows), dropped


def profile_figure(prof: pd.DataFrame, ax, palette: dict | None = None, title: str = "") -> None:
    """ρ(r) against r (log axis, 1 to RATIO_MAX), one step line per method, as AlgoPerf draws it."""
    from analysis import plots

    methods = sorted(prof["method"].unique(), key=lambda v: (plots.algorithm_order(str(v).split(" ")[0]), str(v)))
    palette = palette or plots.colours(methods)
    workloads = int(prof["workloads"].max()) if len(prof) else 0
    for i, m in enumerate(methods):
        g = prof[prof["method"] == m].sort_values("r")
        # methods that tie would hide each other: each is nudged by a hair, in drawing order, all of them within
        # ±0.015 of their value however many they are (a method at 1 still reads as 1)
        nudge = (i - (len(methods) - 1) / 2) * min(0.004, 0.03 / max(len(methods), 1))
        ax.step(
            g["r"],
            g["rho"] + nudge,
            where="post",
            color=palette.get(m),
            lw=2,
            label=f"{m} ({g['rho'].iloc[-1]:.0%} at r = {RATIO_MAX:g})",
        )
    ax.set_xscale("log")
    ax.set_xlim(1, RATIO_MAX)
    ticks = [t for t in (1, 1.5, 2, 3, 4, 6, 8) if t <= RATIO_MAX]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("r: time within r × the best method's (Dolan and Moré's τ; here τ is staleness)")
    ax.set_ylabel(f"fraction of the {workloads} workloads" if workloads != 1 else "reached within r (1 workload)")
    ax.grid(True, alpha=0.3)
    # (on the left: a title longer than the axes, centred, ran off the figure's left edge)
    ax.set_title(title or "Performance profile: time to the validation target", loc="left")
    ax.legend(  # beside: inside, it hid steps; in two columns where one would run off the figure's foot
        fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False, ncol=legend_columns(len(methods))
    )


def legend_columns(methods: int) -> int:
    """The profile legend's columns: one for up to 16 methods, then two."""
    return 1 if methods <= 16 else 2


def read_targets(path) -> pd.DataFrame:
    """Targets announced earlier: a CSV that `announce` wrote (`targets.csv`: the workload's columns and
    `target`), or a sweep folder holding one; or several of them (a list: the tuning sweeps of n = 5, 10 and 30,
    say), whose workloads are put together, a workload announced twice with two targets refused in one line."""
    if isinstance(path, (list, tuple)):
        if len(path) == 1:
            return read_targets(path[0])
        if not path:
            raise ValueError("--target-from needs a tuning sweep or its targets.csv")
        parts = [read_targets(p).assign(_from=str(p)) for p in path]
        columns = [[k for k in WORKLOAD if k in t.columns] for t in parts]
        if any(c != columns[0] for c in columns):  # a workload described two ways would match no run or two
            said = "; ".join(f"{p}: {', '.join(c) or 'none'}" for p, c in zip(path, columns, strict=True))
            raise ValueError(f"--target-from: the files describe their workloads by different columns ({said})")
        t = pd.concat(parts, ignore_index=True)
        keys = columns[0]
        for key, g in t.groupby(keys, dropna=False) if keys else [((), t)]:
            if g["target"].nunique(dropna=False) > 1:
                said = " and ".join(f"{v:.10g} ({f})" for v, f in zip(g["target"], g["_from"], strict=True))
                where = describe_workload(dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True)))
                raise ValueError(f"--target-from: the workload {where} has different announced targets, {said}")
        return t.drop(columns="_from").drop_duplicates(keys + ["target"] if keys else ["target"], ignore_index=True)
    p = Path(path)
    if p.is_dir():
        p = p / "targets.csv"
    if not p.is_file():
        raise FileNotFoundError(
            f"{path}: no targets.csv (python -m analysis.tune <tuning sweep> writes one; the sweeps to report go "
            "before --target-from)"
        )
    t = pd.read_csv(p)
    if "target" not in t.columns:
        raise ValueError(f"{p} has no target column; it is not a file of announced targets")
    return t
