"""A sweep's check before its first job: composing every job's config, side by side.

`python run.py -m experiment=<name>` composes and validates every job of the sweep before any starts
(experiments.command.check_sweep). Hydra's compose reads and merges every config file again for each job;
the check composes each group choice once and sets each job's values on a copy (experiments.config._composed_from).
Both are timed here on the same jobs, alternating round by round, in one process (CPU time, `time.process_time`):
the ratio is Hydra's job-by-job composition over the check's. Every job's two configs are compared, and any that
differ is reported (the exit code is then 1).

    python benchmarks/sweep_check.py [--experiments tune baselines fig1] [--rounds 3]

`--smoke` times `fig1_quick` once, to check that the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from experiments.config import composed, expand  # noqa: E402


def timed(jobs: list[list[str]], shared: bool) -> tuple[float, list]:
    """CPU seconds to compose every job, and the configs: each whole (Hydra's compose), or from the configs of the
    group choices shared by the jobs (what the sweep's check does)."""
    bases: dict | None = {} if shared else None
    began = time.process_time()
    configs = [composed(job, bases=bases) for job in jobs]
    return time.process_time() - began, configs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiments", nargs="+", default=["tune", "baselines", "fig1"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="fig1_quick, one round: to check that the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.experiments, args.rounds = ["fig1_quick"], 1
        print("--smoke: one small experiment, one round, to check that the script runs; its numbers mean little")
    print("| experiment | jobs | group choices | Hydra's compose, job by job | the check | ratio |")
    print("|---|---|---|---|---|---|")
    differ = 0
    for name in args.experiments:
        jobs = expand([f"experiment={name}"], multirun=True)
        whole, shared = [], []
        for _ in range(args.rounds):
            seconds, slow = timed(jobs, shared=False)
            whole.append(seconds)
            seconds, fast = timed(jobs, shared=True)
            shared.append(seconds)
        for job, a, b in zip(jobs, slow, fast, strict=True):
            if OmegaConf.to_container(a, resolve=False) != OmegaConf.to_container(b, resolve=False):
                differ += 1
                print(f"differs: {' '.join(job)}")
        bases: dict = {}
        for job in jobs:
            composed(job, bases=bases)
        w, s = statistics.median(whole), statistics.median(shared)
        print(f"| {name} | {len(jobs)} | {len(bases)} | {w:.2f} s | {s:.2f} s | **{w / s:.1f}x** |")
    print(f"configs compared job by job: {'none differs' if not differ else f'{differ} differ'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
