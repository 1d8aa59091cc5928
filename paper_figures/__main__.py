"""python -m paper_figures <id> <sweep_dir>... [--out DIR]   |   python -m paper_figures all <root> [--out DIR]

<id> is fig1 ... fig8, fig9, fig10, fig9_10 or baselines (the report). Each figure is written as <id>.png and
<id>.pdf in --out (default: ./figures). `all` looks under <root> for the sweeps of each experiment (Hydra records
which `experiment=` launched a run), takes the newest sweep of the first experiment a figure can use (the full
one or its _quick version), draws every figure it can, and says which it could not and why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis import load, report
from paper_figures.figures import FIGURES, SOURCES, NoRuns

IDS = (*FIGURES, "baselines")


def draw(fig_id: str, paths, out: Path, target: float = report.DEFAULT_TARGET) -> list[Path]:
    if fig_id == "baselines":
        return [report.write(paths, out / "baselines.html", target)]
    from analysis.plots import save

    return save(FIGURES[fig_id](paths), out, fig_id)


def sweeps_by_experiment(root) -> dict[str, list[Path]]:
    """{experiment name without _quick: [sweep directories, newest first]} for every run under root."""
    r = load.runs(root)
    found: dict[str, dict[Path, float]] = {}
    for exp, run_dir in zip(r.get("experiment", []), r["run_dir"], strict=False):
        if not isinstance(exp, str):
            continue
        sweep = Path(run_dir).parent
        base = exp.removesuffix("_quick")
        stamp = max((p.stat().st_mtime for p in Path(run_dir).iterdir()), default=0.0)
        found.setdefault(base, {})[sweep] = max(stamp, found.get(base, {}).get(sweep, 0.0))
    return {k: sorted(v, key=v.get, reverse=True) for k, v in found.items()}


def draw_all(root, out: Path, target: float) -> int:
    sweeps = sweeps_by_experiment(root)
    missing = 0
    for fig_id in IDS:
        source = next((s for s in SOURCES[fig_id] if s in sweeps), None)
        if source is None:
            print(f"{fig_id}: skipped, no sweep of experiment={' or '.join(SOURCES[fig_id])} (or _quick) under {root}")
            missing += 1
            continue
        sweep = sweeps[source][0]
        try:
            paths = draw(fig_id, [sweep], out, target)
            print(f"{fig_id}: {', '.join(map(str, paths))}  (from {sweep})")
        except NoRuns as e:
            print(f"{fig_id}: skipped, {e} in {sweep}")
            missing += 1
    return missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m paper_figures", description=__doc__.splitlines()[0])
    p.add_argument("figure", choices=[*IDS, "all"], metavar="{" + ",".join(IDS) + ",all}")
    p.add_argument("paths", nargs="+", help="sweep or run directories (for all: a root to search)")
    p.add_argument("--out", type=Path, default=Path("figures"), help="output folder (default: ./figures)")
    p.add_argument("--target-loss", type=float, default=report.DEFAULT_TARGET, help="baselines report target")
    args = p.parse_args(argv)
    try:
        if args.figure == "all":
            draw_all(args.paths, args.out, args.target_loss)
            return 0
        for path in draw(args.figure, args.paths, args.out, args.target_loss):
            print(path)
    except (NoRuns, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
