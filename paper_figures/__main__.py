"""python -m paper_figures <id> <sweep_dir>... [--out DIR] [--band B]  |  python -m paper_figures all <root> [--out DIR]

<id> is fig1 ... fig8, fig3_cv (Fig. 3 by the spread of cycle times), fig9, fig10, fig9_10 or baselines (the
report). Each figure is written as <id>.png and <id>.pdf in --out (default: ./figures). `all` looks under <root>
for the sweeps of each experiment (Hydra records which `experiment=` launched a run), takes the first experiment a
figure can use and its newest full sweep (or, when there is none, its newest _quick sweep), draws every figure it
can, and says which it could not and why. --band sets the band around each mean over seeds: minmax (the
default: from the lowest to the highest seed), ci (the 95% Student's t interval of the mean), none; every
figure's title says which, and the legends how many seeds. Means are over completed runs only; the others are
drawn on their own, and the title counts them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from analysis import load, report
from paper_figures.figures import FIGURES, SOURCES, NoRuns

IDS = (*FIGURES, "baselines")


def draw(fig_id: str, paths, out: Path, target: float | None = None, band="minmax", target_from=None) -> list[Path]:
    if fig_id == "baselines":
        return [report.write(paths, out / "baselines.html", target, target_from, band)]
    from analysis.plots import save

    return save(FIGURES[fig_id](paths, band=band), out, fig_id)


def sweeps_by_experiment(root) -> dict[str, list[list[Path]]]:
    """{experiment name without _quick: [the run directories of one sweep, full sweeps first, then newest]}."""
    r = load.runs(root)
    found: dict[str, dict[Path, list[Path]]] = {}
    rank: dict[Path, tuple[bool, float]] = {}  # (a full sweep, newest file): full sweeps first, then the newest
    for exp, run_dir in zip(r.get("experiment", pd.Series(dtype=object)), r["run_dir"], strict=True):
        if not isinstance(exp, str):
            continue
        run_dir = Path(run_dir)
        sweep = run_dir.parent  # a multirun folder; for single runs (no -m) only the matching runs are taken
        found.setdefault(exp.removesuffix("_quick"), {}).setdefault(sweep, []).append(run_dir)
        full, stamp = rank.get(sweep, (False, 0.0))
        newest = max((p.stat().st_mtime for p in run_dir.iterdir()), default=0.0)
        rank[sweep] = (full or not exp.endswith("_quick"), max(stamp, newest))
    return {k: [v[s] for s in sorted(v, key=rank.get, reverse=True)] for k, v in found.items()}


def draw_all(root, out: Path, target: float | None = None, band="minmax", target_from=None) -> tuple[int, int]:
    """Draw every figure it finds runs for; returns (drawn, not drawn)."""
    sweeps = sweeps_by_experiment(root)
    where = " ".join(map(str, [root] if isinstance(root, (str, Path)) else root))
    drawn = missing = 0
    for fig_id in IDS:
        source = next((s for s in SOURCES[fig_id] if s in sweeps), None)
        if source is None:
            print(f"{fig_id}: skipped, no sweep of experiment={' or '.join(SOURCES[fig_id])} (or _quick) under {where}")
            missing += 1
            continue
        run_dirs = sweeps[source][0]
        where = run_dirs[0].parent
        try:
            paths = draw(fig_id, run_dirs, out, target, band, target_from)
            print(f"{fig_id}: {', '.join(map(str, paths))}  (from {where}: {load.describe(load.runs(run_dirs))})")
            drawn += 1
        except Exception as e:  # one figure's problem must not stop the others
            print(
                f"{fig_id}: not drawn, {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (runs in {where})"
            )
            missing += 1
    return drawn, missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m paper_figures", description=__doc__.splitlines()[0])
    p.add_argument("figure", choices=[*IDS, "all"], metavar="{" + ",".join(IDS) + ",all}")
    p.add_argument("paths", nargs="+", help="sweep or run directories (for all: a root to search)")
    p.add_argument("--out", type=Path, default=Path("figures"), help="output folder (default: ./figures)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--target", type=float, help="baselines report: one validation-loss target for every workload")
    group.add_argument(
        "--target-from",
        metavar="SWEEP_OR_CSV",
        nargs="+",
        help="baselines report: targets announced before (a tuning sweep's targets.csv, or several: one per n; "
        "give them after the sweeps)",
    )
    p.add_argument(
        "--band",
        choices=["minmax", "ci", "none"],
        default="minmax",
        help="the band around each mean over seeds: min–max (default), 95%% t interval, or none",
    )
    args = p.parse_args(argv)
    band = None if args.band == "none" else args.band
    try:
        report.check_target(args.target)
        if args.figure == "all":
            drawn, _ = draw_all(args.paths, args.out, args.target, band, args.target_from)
            return 0 if drawn else 1
        for path in draw(args.figure, args.paths, args.out, args.target, band, args.target_from):
            print(path)
        print(load.describe(load.runs(args.paths)))  # what the figure's title says of its runs, here too
    except (NoRuns, FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
