"""The tuning protocol's second stage: from a tuning sweep, each algorithm's best setting at each n, and the sweep
that reruns it on held-out seeds; then the two protocols side by side.

    python run.py -m experiment=tune_quick                                  # stage 1: every trial, tuning seeds
    python -m analysis.tune <tuning sweep>                                  # the choice, and stage 2's command
    python run.py -m --config-dir <tuning sweep>/heldout experiment=tune_quick_heldout   # stage 2: held-out seeds
    python -m analysis.tune <tuning sweep> --heldout <held-out sweep>       # the table: paper's protocol | tuned

The protocol (REPRODUCTION.md, "Tuning"), as optimiser benchmarks run it (Schmidt et al. 2021, "Descending
through a Crowded Valley"; the MLCommons AlgoPerf rules): the same number of trials for every algorithm, selection
on the validation split, final numbers on fresh seeds and on the test split, which no choice has seen (`--select`
takes no test quantity).

- A trial is one setting of one algorithm at one n: the settings its runs differ in besides the seed (η, and its
  knob: GEM's κ, AGN's window, ...). Its score is the mean final validation loss over the tuning seeds. A trial
  with a diverged seed scores worst (+inf): an unstable setting is not chosen for its lucky seeds. Among trials
  that all diverged, none is better than another, and the first in the grid is kept.
- The choice is the trial with the lowest score, per algorithm and n. A sweep with a failed, killed or missing
  job is refused in one line: a trial on fewer seeds than the others is not the same measurement.
- What a choice is worth: its tuning seeds against the runner-up's (the next best trial of that algorithm and n),
  Welch's t-test on the log scale (`analysis.stats.welch_p`). A choice with p ≥ 0.05 is "not told apart" (on
  these seeds it is as good as the runner-up), and a workload whose chosen trial's mean validation loss is within
  10% of chance's, ln(classes), "did not learn": the choice says nothing there. Both are printed beside each
  choice and counted below the table, and written to tuning.csv.
- Stage 2 reruns, on the held-out seeds, both the chosen setting and the paper's (η as the experiment sets it,
  every knob at its default), so that the two protocols are compared on the same seeds; a chosen setting that is
  the paper's runs once. The held-out seeds are --seeds, else the tuning sweep's declared
  hydra.sweeper.heldout_seeds (experiment=tune: 0, 1, 2, the paper protocol's), else the 3 smallest seeds the
  tuning did not use (tuning seeds 0, 1: 2, 3, 4); seeds the tuning used are refused. Stage 2 is written as an
  experiment, `<tuning sweep>/heldout/experiment/<experiment>_heldout.yaml` (beside the runs it was chosen from;
  Hydra's `--config-dir <tuning sweep>/heldout` finds it; named `<experiment>_heldout_<sweep folder>` where conf/
  has the former name, which Hydra would take instead), or with --write-conf the repository's
  `conf/experiment/<experiment>_heldout.yaml` (the paper's tune_heldout), which a reviewer can read and anyone can
  rerun. Its suggested command repeats the tuning sweep's own command-line settings (its data, with data.root only
  where the data reads files, made absolute; its budget), so that both stages run the same workload, and names
  hydra/launcher=joblib only where that plugin is installed.

- The targets of the time-to-target comparison are announced here, from the tuning seeds and before the held-out
  runs: per workload (n), the best chosen setting's median final validation loss (`analysis.target.announce`,
  AlgoPerf's rule), written to `<tuning sweep>/targets.csv`.

Files: `<tuning sweep>/tuning.csv` (every trial: its setting, seeds, how many diverged, the mean validation loss,
whether it learned, its rank and whether it was chosen; a chosen one's runner-up, p and whether it is told apart),
`<tuning sweep>/targets.csv` and `<tuning sweep>/sensitivity.png` (final validation loss against η, one panel per
n, diverged trials marked); with --heldout, the table as `--out` (.md or .csv; default `<held-out
sweep>/protocols.md`): per algorithm and n, the paper's setting and the tuned one on the held-out seeds, each with
its final test loss and accuracy, its validation loss, and its worker steps and time to the announced target.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import load, stats, target
from analysis.stats import mean_ci
from experiments import rundir
from gem.files import write_atomic

HELDOUT_SEEDS = (0, 1, 2)  # how many seeds the held-out stage runs (and experiment=tune's, which it declares)
CHANCE_MARGIN = 0.1  # a mean validation loss above (1 - this) x ln(classes), chance's loss, learned nothing
SCORE = "val_loss"  # selection: the final validation loss of the central variable
# what --select may name, and whether lower is better: the validation split only (the test split is for the report)
SCORES = {"val_loss": "lower", "val_accuracy": "higher"}


def _text(v) -> str:
    """A setting's value as the override syntax writes it."""
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v)).lower()
    if isinstance(v, (float, np.floating)):
        return f"{float(v):g}"
    return str(v)


def settings_of(runs: pd.DataFrame) -> list[str]:
    """The columns that tell apart the trials of an algorithm at one n, for any algorithm: what varies besides
    the seed. Each trial's own are those of them it has a value in (trials)."""
    return load.varying(runs, ["algorithm", "workers"])


def _setting(row: pd.Series, columns: list[str]) -> dict:
    return {c: row[c] for c in columns if not (isinstance(row[c], float) and math.isnan(row[c]))}


def describe(setting: dict) -> str:
    """`lr=0.05 kappa=2`: a setting as a reader reads it."""
    return " ".join(f"{k.removeprefix('algorithm.')}={_text(v)}" for k, v in setting.items())


def _check_finished(runs: pd.DataFrame, sweep) -> None:
    missing = load.unstarted(runs)
    if missing:
        raise ValueError(f"{sweep}: {missing}; a trial on fewer seeds than the others is not comparable")
    bad = runs[~runs["status"].isin(["completed", "diverged"])]
    running = [d for d in bad["run_dir"] if rundir.in_use(Path(d))]
    if running:  # resume=true would be refused for them: their own command still holds them
        raise ValueError(
            f"{sweep}: {len(running)} run(s) still running ({running[0]}{', ...' if len(running) > 1 else ''}): "
            "wait for their command to end, then tune"
        )
    if len(bad):
        first = bad.iloc[0]
        raise ValueError(
            f"{sweep}: {len(bad)} run(s) {'/'.join(sorted(set(bad['status'])))} ({first['run_dir']}, "
            f"...); finish them first: the identical -m command with hydra.sweep.dir={sweep} resume=true"
        )


def check_select(select: str) -> str:
    """`--select`: a validation quantity (SCORES); the test split is refused in one line, as anything else."""
    if select not in SCORES:
        why = (
            " the tuning protocol chooses on the validation split; the test split is kept for the held-out "
            "report (--heldout gives its test loss), and a choice made on it would leak into the result"
            if select.startswith("test")
            else ""
        )
        raise ValueError(
            f"--select={select} is not allowed; choose one of: {', '.join(SCORES)}" + (";" + why if why else "")
        )
    return select


def trials(runs: pd.DataFrame, select: str = SCORE) -> pd.DataFrame:
    """One row per (algorithm, n, setting): seeds, how many diverged, the mean of `select` (a validation quantity)
    over the tuning seeds, its score (what is minimised: the loss, or 1 − the accuracy; +inf with a diverged seed),
    its rank within (algorithm, n) and whether it is chosen. The rows are in the sweep's order (the grid's), which
    breaks ties."""
    check_select(select)
    runs = runs.sort_values("run_dir", key=lambda s: s.map(_job_number), kind="stable")
    # each algorithm's own settings: what its trials differ in (GEM's κ is not a setting of AGN's trials)
    own = {a: load.varying(g, ["workers"]) for a, g in runs.groupby("algorithm", sort=False)}
    rows = []
    for (algorithm, n), g in runs.groupby(["algorithm", "workers"], sort=False):
        columns = own[algorithm]
        keys = g[columns].map(_text).apply(tuple, axis=1) if columns else pd.Series([()] * len(g), index=g.index)
        for _, t in g.groupby(keys, sort=False):
            first = t.iloc[0]
            diverged = int((t["status"] == "diverged").sum())
            done = t["status"] == "completed"
            values = pd.to_numeric(t[select], errors="coerce")[done]
            mean = float(values.mean()) if diverged < len(t) else math.nan
            score = mean if SCORES[select] == "lower" else 1.0 - mean
            loss = pd.to_numeric(t[SCORE], errors="coerce")[done] if SCORE in t else pd.Series(dtype=float)
            loss_mean = float(loss.mean()) if len(loss) and diverged < len(t) else math.nan
            classes = _classes(first)
            chance = math.log(classes) if classes and classes > 1 else math.nan
            rows.append(
                {
                    "algorithm": algorithm,
                    "workers": int(n),
                    **{c: first[c] for c in columns},
                    "setting": describe(_setting(first, columns)),
                    "seeds": len(t),
                    "diverged": diverged,
                    f"{SCORE}_mean": loss_mean,
                    f"{select}_mean": mean,
                    "score": math.inf if diverged or not np.isfinite(mean) else score,
                    # chance's loss, ln(classes): a trial whose mean validation loss is within CHANCE_MARGIN of
                    # it learned nothing, and its rank among others like it is noise
                    "chance_val_loss": chance,
                    "learned": bool(loss_mean < (1 - CHANCE_MARGIN) * chance)
                    if np.isfinite(loss_mean) and np.isfinite(chance)
                    else math.nan,
                    "values": list(values),
                }
            )
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["rank"] = out.groupby(["algorithm", "workers"], sort=False)["score"].rank(method="first").astype(int)
    out["chosen"] = out["rank"] == 1
    _against_runner_up(out, select)
    return out.drop(columns="values")


def _classes(run: pd.Series) -> int | None:
    """The class count of a run's data (`data.num_classes`, else the model's), None when its config says none."""
    for key in ("data.num_classes", "model.num_classes"):
        v = run.get(key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            try:
                return int(v)
            except (TypeError, ValueError):  # an unresolved interpolation
                continue
    return None


def _against_runner_up(out: pd.DataFrame, select: str) -> None:
    """Each chosen trial against the next best of its algorithm and n: `runner_up` (its setting), `p_runner_up`
    (Welch's t-test of their tuning seeds' values of `select`, on the log scale for a loss and the logit scale for
    an accuracy: analysis.stats.welch_p) and `told_apart` (p < 1 − LEVEL, or a runner-up with a diverged seed).
    Empty, NaN and NaN on the other rows, and where there is no runner-up or too few seeds to test."""
    out["runner_up"], out["p_runner_up"], out["told_apart"] = "", math.nan, None
    scale = "log" if SCORES[select] == "lower" else "logit"
    for _, g in out.groupby(["algorithm", "workers"], sort=False):
        by_rank = g.sort_values("rank")
        if len(by_rank) < 2 or not np.isfinite(by_rank["score"].iloc[0]):
            continue
        first, second = by_rank.index[0], by_rank.index[1]
        out.loc[first, "runner_up"] = out.loc[second, "setting"]
        if not np.isfinite(out.loc[second, "score"]):  # it had a diverged seed: the choice is the stable one
            out.loc[first, "told_apart"] = True
            continue
        p = stats.welch_p(out.loc[first, "values"], out.loc[second, "values"], scale=scale)
        out.loc[first, "p_runner_up"] = p
        out.loc[first, "told_apart"] = None if math.isnan(p) else bool(p < 1 - stats.LEVEL)


def verdict(row: pd.Series, select: str = SCORE) -> str:
    """What a chosen trial's choice is worth, in words: whether it learned, and whether its tuning seeds tell it
    apart from the runner-up (`trials`' columns)."""
    if not np.isfinite(row["score"]):
        return "every trial had a diverged seed"
    if _is(row.get("learned"), False):
        return (
            f"did not learn: mean val loss {row[f'{SCORE}_mean']:.3f}, within {CHANCE_MARGIN:.0%} of chance's "
            f"(ln {math.exp(row['chance_val_loss']):.0f} = {row['chance_val_loss']:.3f})"
        )
    if not row["runner_up"]:
        return "the only trial"
    p, apart = row["p_runner_up"], row["told_apart"]
    if _is(apart, True) and not np.isfinite(p):
        return f"told apart from {row['runner_up']}, which had a diverged seed"
    if _is(apart, True):
        return f"told apart from {row['runner_up']} ({_p(p)})"
    if _is(apart, False):
        return f"not told apart from {row['runner_up']} at {stats.LEVEL:.0%} ({_p(p)})"
    return f"not tested against {row['runner_up']}: fewer than 2 completed seeds"


def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.2g}"


def _is(value, flag: bool) -> bool:
    """`value` is the boolean `flag` (a column of booleans and NaN holds Python's or numpy's)."""
    return isinstance(value, (bool, np.bool_)) and bool(value) is flag


def _job_number(run_dir: str) -> int:
    name = Path(run_dir).name
    return int(name) if name.isdigit() else 1 << 30


def paper_setting(algorithm: str, experiment: str | None, columns: list[str], config_dirs=()) -> dict:
    """The paper protocol's setting of `algorithm` in `columns`: η as the experiment sets it, every knob at the
    algorithm's default (its conf/algorithm YAML), composed as a job would be (`config_dirs`: the folders besides
    conf/ the tuning sweep's command searched, where its experiment may live)."""
    from omegaconf import OmegaConf

    from experiments.config import compose

    cfg = compose(
        [f"algorithm={algorithm}", *([f"experiment={experiment}"] if experiment else []), *_searchpath(config_dirs)]
    )
    flat = load.flatten(OmegaConf.to_container(cfg, resolve=False))
    return {c: flat[c] for c in columns if c in flat and flat[c] is not None}


def _same(a: dict, b: dict) -> bool:
    return {k: _text(v) for k, v in a.items()} == {k: _text(v) for k, v in b.items() if k in a}


def heldout_experiment(
    chosen: pd.DataFrame, columns: list[str], experiment: str | None, seeds, select: str = SCORE, config_dirs=()
) -> tuple[str, int]:
    """The held-out stage as an experiment file's text: every algorithm at the paper's setting, and each chosen
    setting that is not the paper's, at its n, on `seeds`; on top of the tuning's `experiment`, or of nothing for
    a sweep without one (its command's own settings come with the command: stage_two_overrides). Returns the text
    and how many of the chosen settings are the paper's."""
    grids, same = [], 0
    for algorithm, g in chosen.groupby("algorithm", sort=False):
        # η always (a sweep that tunes only κ, say, has no lr among its settings), compared on the settings only
        full = paper_setting(algorithm, experiment, [*columns, "lr"], config_dirs)
        paper = {k: v for k, v in full.items() if k in columns}
        workers = ",".join(str(int(n)) for n in g["workers"])
        grids.append(
            f'      - {{algorithm: {algorithm}, workers: "{workers}", lr: {_text(full["lr"])}}}'
            "  # the paper's protocol"
        )
        for _, row in g.iterrows():
            setting = _setting(row, columns)
            if _same(setting, paper):
                same += 1
                continue
            keys = ", ".join(f"{k}: {_text(v)}" for k, v in setting.items())
            grids.append(
                f"      - {{algorithm: {algorithm}, workers: {int(row['workers'])}, {keys}}}"
                f"  # tuned: {select.replace('_', ' ')} {row[f'{select}_mean']:.4f} over {row['seeds']} "
                "seeds"
            )
    source = f"experiment={experiment}" if experiment else "no experiment (its settings come with stage 2's command)"
    text = (
        "# @package _global_\n"
        f"# The tuning protocol's held-out stage, written by `python -m analysis.tune` from a sweep of {source}:\n"
        "# each algorithm at the paper's setting and, at each n, at the setting the tuning chose (where it differs),\n"
        "# on seeds the tuning did not use. Then: python -m analysis.tune <tuning sweep> --heldout <this sweep>\n"
        + (f"defaults:\n  - {experiment}\n" if experiment else "")
        + "\nhydra:\n  sweeper:\n    params:\n"
        f"      seed: {','.join(str(s) for s in seeds)}\n"
        "    heldout_seeds: null  # this is the held-out stage: nothing is held out of it\n"
        "    grids:\n" + "\n".join(grids) + "\n"
    )
    return text, same


def announce(runs: pd.DataFrame, trial_table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """The targets of the held-out comparison, from the tuning seeds: per workload, the best chosen setting's
    median final validation loss (`analysis.target.announce` over the chosen trials' runs)."""
    chosen = trial_table[trial_table["chosen"]]
    keep = []
    for _, t in chosen.iterrows():
        here = runs[(runs["algorithm"] == t["algorithm"]) & (runs["workers"] == t["workers"])]
        setting = _setting(t, columns)
        keep.append(
            here[here.apply(lambda r, s=setting: _same(s, _setting(r, list(s))), axis=1)] if len(here) else here
        )
    picked = pd.concat(keep) if keep else runs.iloc[:0]
    return target.announce(picked, method="algorithm")


def compare(
    trial_table: pd.DataFrame,
    heldout: pd.DataFrame,
    experiment: str | None,
    columns: list[str],
    hit: pd.DataFrame | None = None,
    config_dirs=(),
) -> pd.DataFrame:
    """Per algorithm and n: the held-out runs at the paper's setting and at the chosen one, side by side (the
    same runs when the choice is the paper's setting): final test loss and accuracy (the split no choice saw), the
    validation loss, and (`hit`: `analysis.target.times` of the held-out runs) the worker steps and time to the
    announced target. `columns`: the settings the trials differ in; `config_dirs`: as paper_setting takes them."""
    rows, papers = [], {}
    for _, t in trial_table[trial_table["chosen"]].iterrows():
        algorithm, n = t["algorithm"], int(t["workers"])
        here = heldout[(heldout["algorithm"] == algorithm) & (heldout["workers"] == n)]
        tuned = _setting(t, columns)
        if algorithm not in papers:  # composed once per algorithm
            papers[algorithm] = paper_setting(algorithm, experiment, columns, config_dirs)
        paper = {k: v for k, v in papers[algorithm].items() if k in tuned}
        row = {"algorithm": algorithm, "n": n}
        for name, setting in (("paper", paper), ("tuned", tuned)):
            match = here[here.apply(lambda r, s=setting: _same(s, _setting(r, list(s))), axis=1)] if len(here) else here
            done = match[match["status"] == "completed"]

            def q(column, scale="log", done=done):
                return mean_ci(pd.to_numeric(done[column], errors="coerce") if column in done else [], scale=scale)

            test, acc, val = q("test_loss"), q("test_accuracy", "logit"), q(SCORE)
            row.update(
                {
                    f"{name} setting": describe(setting),
                    f"{name} runs": len(match),
                    f"{name} diverged": int((match["status"] == "diverged").sum()),
                    f"{name} test loss": test.text(".4f"),
                    f"{name} test accuracy": acc.text(".4f"),
                    f"{name} val loss": val.text(".4f"),
                    f"{name}_test_loss_mean": test.mean,
                    f"{name}_test_loss_ci_lo": test.lo,
                    f"{name}_test_loss_ci_hi": test.hi,
                    f"{name}_{SCORE}_mean": val.mean,
                    f"{name}_k": test.k,
                }
            )
            if hit is not None:
                times = hit[hit["run_dir"].isin(match["run_dir"]) & hit["time"].notna()]
                steps, when = target.lower_median(times["worker_step"]), target.lower_median(times["time"])
                unit = " sim time" if len(times) and times["clock"].iloc[0] == "sim_time" else " s"
                row.update(
                    {
                        f"{name} steps to target": _when(steps, times, ".0f", ""),
                        f"{name} time to target": _when(when, times, ".1f", unit),
                        f"{name}_worker_steps_to_target": steps,
                        f"{name}_time_to_target": when,
                        "target": float(times["target"].iloc[0]) if len(times) else math.nan,
                    }
                )
        rows.append(row)
    return pd.DataFrame(rows)


def _when(value: float, times: pd.DataFrame, fmt: str, unit: str) -> str:
    """`212 (3/3)`: the median time to the target and how many runs got there; `never (0/3)`."""
    reached, total = int(times["reached"].sum()), len(times)
    if total == 0:
        return "n/a"
    if not np.isfinite(value):
        return f"never ({reached}/{total})" if reached == 0 else f"not in most ({reached}/{total})"
    return f"{value:{fmt}}{unit} ({reached}/{total})"


def sensitivity_figure(trial_table: pd.DataFrame, out: Path) -> Path:
    """Final validation loss against η, one panel per n, one line per algorithm (at each η its best knob value:
    how forgiving the method is of η, given its knob); a trial with a diverged seed is an × at the panel's top."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from analysis import plots

    ns = sorted(trial_table["workers"].unique())
    algorithms = sorted(trial_table["algorithm"].unique(), key=plots.algorithm_order)
    colours = plots.colours(algorithms)
    fig, axes = plt.subplots(1, len(ns), figsize=(4.6 * len(ns), 4.2), sharey=True, squeeze=False)
    finite = trial_table.loc[np.isfinite(trial_table["score"]), "score"]
    top = float(finite.max()) * 1.15 if len(finite) else 3.0
    crossed = False  # an × drawn in some panel
    for ax, n in zip(axes[0], ns, strict=True):
        here = trial_table[trial_table["workers"] == n]
        crosses = []  # (η, colour): the panel's ×'s
        for a in algorithms:
            g = here[here["algorithm"] == a]
            best = g.groupby("lr")["score"].min().sort_index()
            ok = best.where(np.isfinite(best))  # NaN at a crossed η: the line breaks there rather than bridge it
            ax.plot(ok.index, ok.values, "-o", color=colours[a], ms=4, lw=1.5, label=a)
            chosen = g[g["chosen"] & np.isfinite(g["score"])]
            ax.plot(chosen["lr"], chosen["score"], "o", ms=10, mfc="none", mec=colours[a], mew=1.5)
            crosses += [(lr, colours[a]) for lr in best[~np.isfinite(best)].index]
        # the ×'s of several algorithms at one η, side by side (one on another, only the last one drawn showed)
        for lr in sorted({lr for lr, _ in crosses}):
            here_x = [c for x, c in crosses if x == lr]
            for k, colour in enumerate(here_x):
                ax.plot(lr * 1.12 ** (k - (len(here_x) - 1) / 2), top, "x", color=colour, ms=8, mew=2)
        crossed = crossed or bool(crosses)
        ax.set_xscale("log")
        grid = sorted(here["lr"].unique())
        ax.xaxis.set_major_locator(FixedLocator(grid))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(f"n = {n}")
        ax.set_xlabel("η (learning rate)")
        ax.axhline(top, color="lightgrey", lw=0.8, zorder=0)
        ax.grid(True, which="major", alpha=0.3)
    plots.log_y(axes[0][0])
    axes[0][0].set_ylabel("final validation loss (mean over tuning seeds)")
    # the ×'s meaning in the legend, beside the panels: written above the line in the panel, an × there covered it
    handles, labels = axes[0][-1].get_legend_handles_labels()
    if crossed:
        handles.append(Line2D([], [], marker="x", ls="", color="grey", ms=7, mew=2))
        labels.append("× on the top line: every\ntrial at this η had a\ndiverged seed")
    axes[0][-1].legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(
        "Sensitivity to η: each algorithm's best knob value at each η (circled: chosen; ×: diverged)", fontsize=11
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


def _markdown(frame: pd.DataFrame) -> str:
    return frame.to_markdown(index=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.tune", description=__doc__.splitlines()[0])
    p.add_argument("sweep", help="the tuning sweep (python run.py -m experiment=tune ...)")
    p.add_argument(
        "--seeds",
        help="the held-out seeds, none of them a tuning seed (default: the tuning sweep's "
        f"hydra.sweeper.heldout_seeds, else the {len(HELDOUT_SEEDS)} smallest seeds the tuning sweep did not use)",
    )
    p.add_argument(
        "--write-conf",
        action="store_true",
        help="write the held-out experiment into the repository's conf/experiment/ (as the paper's tune_heldout), "
        "not under the tuning sweep's folder",
    )
    p.add_argument("--force", action="store_true", help="overwrite the held-out experiment file if it exists")
    p.add_argument("--heldout", help="the held-out sweep: print and write the two protocols side by side")
    p.add_argument("--out", help="with --heldout: the table, .md or .csv (default <held-out sweep>/protocols.md)")
    p.add_argument(
        "--select",
        default=SCORE,
        help=f"what a trial is chosen on: {' or '.join(SCORES)} (the "
        "validation split; default val_loss), averaged over the tuning seeds",
    )
    args = p.parse_args(argv)
    try:
        return _main(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    """Every check first (the sweeps, the seeds, --out, an existing choice), then the files: a refused command
    writes nothing."""
    select = check_select(args.select)  # before anything is read
    if args.write_conf and args.heldout:
        raise ValueError(
            "--write-conf is not allowed with --heldout; --write-conf places the held-out experiment that "
            "python -m analysis.tune <sweep> writes, --heldout reports on its runs"
        )
    sweep = Path(args.sweep)
    runs = _finished_runs(sweep)
    experiment = runs["experiment"].dropna().iloc[0] if runs["experiment"].notna().any() else None
    seeds, why = heldout_seeds(args.seeds, sweep, sorted({int(s) for s in runs["seed"]}))
    config_dirs = _config_dirs(sweep)
    tuned = {int(s) for s in runs["seed"]}
    table = trials(runs, select)
    columns = settings_of(runs)
    chosen = table[table["chosen"]]
    goals = announce(runs, table, columns)
    if args.heldout:
        heldout = Path(args.heldout)
        held = _finished_runs(heldout)
        shared = sorted(tuned & set(int(s) for s in held["seed"]))
        if shared:
            raise ValueError(
                f"--heldout {heldout} has runs on seed{'s' if len(shared) > 1 else ''} "
                f"{', '.join(map(str, shared))}, which the tuning sweep {sweep} used: the held-out stage must run on "
                f"new seeds; pass the sweep of the held-out experiment that analysis.tune {sweep} wrote"
            )
        out = Path(args.out) if args.out else heldout / "protocols.md"
        if out.suffix not in (".md", ".csv"):
            raise ValueError(f"--out={out} is not allowed; its suffix must be .md or .csv")
    else:
        from experiments.schema import CONF_DIR

        name = f"{experiment or 'tuning'}_heldout"
        if args.write_conf:  # the repository's own: the paper's tune_heldout, committed and rerun by name
            config_dir, path = None, CONF_DIR / "experiment" / f"{name}.yaml"
        else:  # beside the sweep it was chosen from, as run outputs are; Hydra's --config-dir finds it there
            if any((Path(d) / "experiment" / f"{name}.yaml").is_file() for d in [CONF_DIR, *config_dirs]):
                # Hydra would take that one (the repository's n = 10 tune_heldout): a name of this sweep's own
                name += "_" + re.sub(r"[^A-Za-z0-9_-]", "_", sweep.resolve().name)
            config_dir = (sweep / "heldout").resolve()
            path = config_dir / "experiment" / f"{name}.yaml"
        # the tuning's experiment may live in a folder of its command's own (--config-dir): the held-out one,
        # which stands on it, searches there too (Hydra takes one --config-dir, and hydra.searchpath the others)
        others = list(config_dirs)
        if config_dir is None and others:
            config_dir = others.pop(0)
        text, same = heldout_experiment(chosen, columns, experiment, seeds, select, config_dirs)
        if path.exists() and path.read_text() != text and not args.force:
            raise ValueError(f"{path} exists and holds another choice; add --force to replace it")
        carried, left = stage_two_overrides(sweep, runs, columns)

    write_atomic(sweep / "tuning.csv", table.to_csv(index=False).encode())
    write_atomic(sweep / "targets.csv", goals.to_csv(index=False).encode())
    # against η: none where the sweep did not vary it (it crashed with KeyError: 'lr')
    figure = sensitivity_figure(table, sweep / "sensitivity.png") if select == SCORE and "lr" in table else None
    _show_choices(table, runs, sweep, select)
    print(
        f"trials: {sweep / 'tuning.csv'}; targets announced for the held-out comparison: {sweep / 'targets.csv'} ("
        + "; ".join(
            f"{target.describe_workload(r)}: {r['target']:.4f}, set by {r['set_by']}" for _, r in goals.iterrows()
        )
        + ")"
        + (f"; sensitivity figure: {figure}" if figure else "")
    )
    if args.heldout:
        ev = load.commits(
            heldout, table="eval", columns=["algorithm", "workers", "seed", "status", "engine"], meta=held
        )
        hit = target.times(held, ev, goals)
        _write_comparison(compare(table, held, experiment, columns, hit, config_dirs), sweep, heldout, out, goals)
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())
    run = f"python {_run_py()} -m" + (f" --config-dir {config_dir}" if config_dir else "")
    run += "".join(f" '{o}'" for o in _searchpath(others)) + f" experiment={name}"
    run += "".join(f" {o}" for o in carried)
    from experiments.command import launcher_installed

    joblib = launcher_installed("joblib")  # not in the README's install: suggested only where it is there
    print(
        f"held-out stage: {path} ({len(chosen)} chosen settings, {same} of them the paper's), on seeds "
        f"{','.join(map(str, seeds))} ({why}). Run it, then compare:\n"
        f"  {run} plan=true\n"
        f"  {run}" + (" hydra/launcher=joblib hydra.launcher.n_jobs=2" if joblib else "") + "\n"
        f"  python -m analysis.tune {sweep} --heldout <its sweep folder>"
    )
    if carried:
        print(f"  (the tuning sweep's own settings, so that both stages run the same workload: {' '.join(carried)})")
    if left:
        print(
            f"  (left out of the tuning sweep's command: {' '.join(left)}: the held-out experiment sets the seeds, "
            "n and the settings, and the logger's keys change what is recorded, not what is trained)"
        )
    if not joblib:
        print(
            '  (to run its jobs side by side: pip install -e ".[joblib]" in this project\'s folder, then add '
            "hydra/launcher=joblib hydra.launcher.n_jobs=2)"
        )
    return 0


def _show_choices(table: pd.DataFrame, runs: pd.DataFrame, sweep: Path, select: str) -> None:
    """The chosen setting of each algorithm at each n, with what its choice is worth (`verdict`), and a line that
    counts the choices that are not told apart from noise."""
    chosen = table[table["chosen"]]
    show = chosen[["algorithm", "workers", "setting", "seeds", "diverged", f"{select}_mean"]].copy()
    show[f"{select}_mean"] = show[f"{select}_mean"].map(lambda v: f"{v:.4f}")  # as the held-out file writes it
    show["against the runner-up"] = [verdict(r, select) for _, r in chosen.iterrows()]
    best = "lowest mean validation loss" if select == SCORE else "highest mean validation accuracy"
    print(
        f"tuning: {len(table)} trials of {table['algorithm'].nunique()} algorithms in {sweep} "
        f"({len(runs)} runs); the chosen setting of each algorithm at each n ({best}, on the tuning seeds):"
    )
    print(
        _markdown(show.rename(columns={"workers": "n", f"{select}_mean": f"{select.replace('_', ' ')} (tuning seeds)"}))
    )
    seeds = int(chosen["seeds"].max()) if len(chosen) else 0
    dead = np.array([_is(v, False) for v in chosen["learned"]], dtype=bool) | ~np.isfinite(chosen["score"])
    apart = np.array([_is(v, True) for v in chosen["told_apart"]], dtype=bool) & ~dead
    scale = "log" if SCORES[select] == "lower" else "logit"
    print(
        f"told apart from the runner-up at {stats.LEVEL:.0%} (Welch's t-test over the {seeds} tuning seeds, "
        f"{select.replace('_', ' ')} on the {scale} scale): {int(apart.sum())} of {len(chosen)} choices"
        + (f" ({_names(chosen[apart])})" if apart.any() and not apart.all() else "")
    )
    rest = chosen[~apart & ~dead & (chosen["runner_up"] != "")]  # the only trial: its row says so
    if len(rest):
        print(
            f"not told apart: {_names(rest)}: on these seeds each is as good as its runner-up, so its setting is a "
            "guess among them; more tuning seeds or a longer budget would tell them apart"
        )
    if dead.any():
        print(
            f"did not learn: {_names(chosen[dead])}: no trial's mean validation loss is below chance's by more than "
            f"{CHANCE_MARGIN:.0%}, or every trial diverged; the choice says nothing about the algorithm: give the "
            "runs a longer budget"
        )


def _names(chosen: pd.DataFrame) -> str:
    return ", ".join(f"{a} at n = {n}" for a, n in zip(chosen["algorithm"], chosen["workers"], strict=True))


def heldout_seeds(given: str | None, sweep: Path, tuning: list[int]) -> tuple[list[int], str]:
    """The held-out seeds and, in words, where they come from: --seeds (`given`), else the tuning sweep's
    declared hydra.sweeper.heldout_seeds, else the len(HELDOUT_SEEDS) smallest seeds the tuning did not use
    (tuning seeds 0,1 -> 2,3,4: a user's own sweep on the first seeds gets fresh ones, not a refusal). Seeds
    given or declared that the tuning used are refused, naming where they came from."""
    declared = _declared_seeds(sweep)
    if given is not None:
        key, where, text = "--seeds", "", given
    elif declared is not None:
        key, text = "hydra.sweeper.heldout_seeds", declared
        where = f" (declared by the tuning sweep, in {sweep / 'multirun.yaml'})"
    else:
        seeds = _fresh(tuning, len(HELDOUT_SEEDS))
        return seeds, (
            f"the {len(seeds)} smallest seeds the tuning sweep did not use: it ran seeds "
            f"{','.join(map(str, tuning))}; --seeds picks others"
        )
    try:
        seeds = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        seeds = []
    if not seeds:
        raise ValueError(f"{key}={text}{where} is not allowed; it must be integers separated by commas, such as 0,1,2")
    used = sorted(set(seeds) & set(tuning))
    if used:
        raise ValueError(
            f"{key}={','.join(map(str, seeds))}{where} is not allowed; seed {used[0]} was a tuning seed (the tuning "
            f"sweep ran seeds {','.join(map(str, tuning))}), the held-out seeds must be new"
            + ("" if given is not None else f": pass others with --seeds, such as --seeds={_text_seeds(tuning, seeds)}")
        )
    return seeds, ("--seeds" if given is not None else "the tuning sweep's hydra.sweeper.heldout_seeds")


def _text_seeds(tuning: list[int], seeds: list[int]) -> str:
    return ",".join(map(str, _fresh(tuning, len(seeds))))


def _fresh(used: list[int], k: int) -> list[int]:
    """The k smallest non-negative seeds not in `used`."""
    out, s, taken = [], 0, set(used)
    while len(out) < k:
        if s not in taken:
            out.append(s)
        s += 1
    return out


def stage_two_overrides(sweep: Path, runs: pd.DataFrame, columns: list[str]) -> tuple[list[str], list[str]]:
    """What the held-out stage's command repeats of the tuning sweep's command line (its multirun.yaml), so that
    it runs the workload that was tuned (its data, model, engine, budget, ...): every override that is not swept,
    is not a key the held-out experiment sets itself (seed, workers, the settings, experiment) and is not the
    logger's (what is recorded, not what is trained: the held-out runs keep the experiment's evaluations, which
    their time to the target is read from); Hydra's own and plan, resume aside. A relative data.root is made
    absolute (the sweep's working folder), and left out where the data reads no files (digits, synthetic).
    Without a multirun.yaml (runs gathered by hand), the runs' own data.root where the data needs one. Returns
    those carried and those left out (the experiment's and the logger's keys)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    needs_root = _needs_root(runs)
    task, cwd = _sweep_command(sweep)
    if task is None:
        roots = runs["data.root"].dropna().map(str).unique() if "data.root" in runs else []
        return ([f"data.root={roots[0]}"] if needs_root and len(roots) == 1 else []), []
    own = {"seed", "workers", "algorithm", "lr", "experiment", *columns}
    carried, left = [], []
    for o in OverridesParser.create().parse_overrides(task):
        key = o.key_or_group
        if o.is_sweep_override() or key.startswith("hydra") or key in ("plan", "resume"):
            continue
        if key in own or key.startswith(("algorithm.", "logger")):
            if key != "experiment":
                left.append(o.input_line)
            continue
        if key == "data.root":
            if not needs_root:
                continue
            root = o.get_value_element_as_str()
            carried.append(f"data.root={root if cwd is None else os.path.normpath(os.path.join(cwd, root))}")
            continue
        carried.append(o.input_line)
    return carried, left


def _needs_root(runs: pd.DataFrame) -> bool:
    """Whether the sweep's data reads files under data.root: every dataset but the bundled digits and the
    generated synthetic, and but a file of tensors (data.path)."""
    names = set(runs["data"].dropna().map(str)) if "data" in runs else set()
    has_root = "data.root" in runs and runs["data.root"].notna().any()
    return bool(has_root and names - {"digits", "synthetic"})


def _sweep_command(sweep: Path) -> tuple[list[str] | None, str | None]:
    """The tuning sweep's command-line overrides and working folder (hydra.overrides.task and hydra.runtime.cwd
    in its multirun.yaml); None, None without one."""
    import yaml

    try:
        hydra = yaml.safe_load((sweep / "multirun.yaml").read_text())["hydra"]
        return list(hydra["overrides"]["task"] or []), (hydra.get("runtime") or {}).get("cwd")
    except Exception:  # no multirun.yaml (runs copied by hand), or not Hydra's
        return None, None


def _run_py() -> str:
    """`run.py` as the suggested commands name it: from the repository's folder as the README runs it, else by
    its whole path, so that a command printed elsewhere runs as printed."""
    here = Path(__file__).resolve().parent.parent / "run.py"
    return "run.py" if Path.cwd().resolve() == here.parent else str(here)


def _config_dirs(sweep: Path) -> list[str]:
    """The config folders the tuning sweep's command searched besides the repository's conf/ (--config-dir,
    hydra.searchpath: hydra.runtime.config_sources in its multirun.yaml), where its experiment may live."""
    import yaml

    try:
        sources = yaml.safe_load((sweep / "multirun.yaml").read_text())["hydra"]["runtime"]["config_sources"]
    except Exception:  # no multirun.yaml (runs copied by hand): conf/ alone
        return []
    return [
        str(s["path"])
        for s in sources or []
        if s.get("schema") == "file" and s.get("provider") != "main" and s.get("path")
    ]


def _searchpath(config_dirs) -> list[str]:
    """The override that adds `config_dirs` to Hydra's search path (none for none)."""
    return [f"hydra.searchpath=[{','.join(f'file://{d}' for d in config_dirs)}]"] if config_dirs else []


def _finished_runs(sweep: Path) -> pd.DataFrame:
    runs = load.runs(sweep)
    if runs.empty:
        raise ValueError(f"{sweep} holds no runs")
    _check_finished(runs, sweep)
    return runs


def _declared_seeds(sweep: Path) -> str | None:
    """The held-out seeds the tuning experiment declares (hydra.sweeper.heldout_seeds in the sweep's
    multirun.yaml), else None."""
    import yaml

    try:
        seeds = yaml.safe_load((sweep / "multirun.yaml").read_text())["hydra"]["sweeper"].get("heldout_seeds")
    except Exception:  # no multirun.yaml (runs copied by hand), or another sweeper's
        seeds = None
    return str(seeds) if seeds is not None else None


def _write_comparison(c: pd.DataFrame, sweep: Path, heldout: Path, out: Path, goals: pd.DataFrame) -> None:
    cols = ["algorithm", "n"]
    for name in ("paper", "tuned"):
        cols += [
            f"{name} setting",
            f"{name} test loss",
            f"{name} test accuracy",
            f"{name} diverged",
            *([f"{name} steps to target", f"{name} time to target"] if f"{name} steps to target" in c else []),
        ]
    text = _markdown(c[[x for x in cols if x in c]])
    targets = "; ".join(
        f"{target.describe_workload(r)}: val loss {r['target']:.4f} (set by {r['set_by']})" for _, r in goals.iterrows()
    )
    page = (
        f"# The tuning protocol: the paper's setting and the tuned one, on held-out seeds\n\n"
        f"Each algorithm at each n, at the paper's setting (η as the experiment sets it, every knob at its "
        f"default) and at the setting chosen on the tuning sweep {sweep} (lowest mean validation loss over its "
        f"seeds), both rerun on the held-out seeds ({heldout}). Test loss and accuracy: the final central "
        f"variable on the test split, which no choice has seen; the mean and its 95% t interval over the k "
        f"completed seeds (log scale for the loss, logit for the accuracy). Steps and time to target: the "
        f"median over the held-out runs that ended of when the validation loss first reached the target "
        f"announced from the tuning seeds ({targets}; analysis.target), a run that never did counting as "
        f"infinite, with how many got there. Written by `python -m analysis.tune`.\n\n{text}\n"
    )
    write_atomic(out, (c.to_csv(index=False) if out.suffix == ".csv" else page).encode())
    print(
        "held-out seeds: final test loss and accuracy, mean [95% t interval] (k seeds), and the time to the "
        "announced target; the paper's protocol and the tuned one"
    )
    print(text)
    print(f"table: {out}")


if __name__ == "__main__":
    sys.exit(main())
