"""GEM's commit on CPU: its fused loops against the torch operations they replace, side by side.

The inputs are real: a short `sim` run of GEM (mnist_cnn, b = 64, 4 workers, round robin) records, at some of
its commits, what the worker rule gets (the worker's m and s, θ, the gradient). Each recorded commit is then
replayed, in one thread, as every engine runs it: `prepare`, the worker rule, the server rule, `diagnostics`
(π's medians, mean and clamped fractions over all elements and per tensor, the energies). The two variants
(`gem.FUSED` True and False) alternate commit by commit, so both see the same machine; the headline is the ratio of
their CPU time per commit (`time.thread_time`), and its parts.

    python benchmarks/gem_commit.py --root ../shared/data [--commits 60] [--reps 20]

`--smoke` records the commits from a sim run on 256 training examples, to check that the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gem.algorithms import View, gem  # noqa: E402
from gem.data import load_dataset  # noqa: E402
from gem.engines import Job, sim  # noqa: E402
from gem.engines.core import build_flat_model  # noqa: E402
from gem.metrics import Recorder  # noqa: E402

SEED, BATCH_SIZE = 0, 64


def record_commits(data, commits: int, every: int = 3) -> list[dict]:
    """The inputs of every `every`-th commit of a sim run, until `commits` are kept."""
    kept: list[dict] = []
    rule = gem.worker_rule

    def recording(state, x, grad, view, hp):
        if len(kept) < commits and view.t % every == 0:
            kept.append(
                {
                    "m": state["m"].clone(),
                    "stale": state["stale"].clone(),
                    "theta": view.theta.clone(),
                    "grad": grad.clone(),
                }
            )
        return rule(state, x, grad, view, hp)

    hp = gem.Params()
    job = Job(
        algorithm="gem",
        hp=hp,
        model="mnist_cnn",
        data=data,
        workers=4,
        batch_size=BATCH_SIZE,
        epochs=max(1, -(-commits * every * BATCH_SIZE // (4 * len(data.train_y)))),
        seed=SEED,
        engine={"staleness": "round_robin"},
        eval_every=10**9,
        eval_train_size=64,
    )
    original = gem.ALGORITHM
    gem.ALGORITHM = dataclasses.replace(original, worker_rule=recording)  # what algorithms.get("gem") returns
    try:
        with tempfile.TemporaryDirectory() as d:
            rec = Recorder(d)
            sim.run(job, rec)
            rec.close()
    finally:
        gem.ALGORITHM = original
    return kept


def one_commit(inputs: dict, hp, layout, parts: dict[str, float]) -> None:
    state = {"m": inputs["m"].clone(), "stale": inputs["stale"].clone()}
    theta, grad = inputs["theta"].clone(), inputs["grad"]
    t0 = time.thread_time()
    gem.prepare(state, None, grad, hp)
    t1 = time.thread_time()
    commit = gem.worker_rule(state, None, grad, View(theta, {}, 0, 0, 0), hp)
    t2 = time.thread_time()
    gem.server_rule(View(theta, {}, 0, 0, 0), commit, hp)
    t3 = time.thread_time()
    gem.diagnostics(commit, layout, hp)
    t4 = time.thread_time()
    for k, v in (
        ("prepare", t1 - t0),
        ("worker rule", t2 - t1),
        ("server rule", t3 - t2),
        ("diagnostics", t4 - t3),
        ("commit", t4 - t0),
    ):
        parts[k] = parts.get(k, 0.0) + v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="../shared/data")
    ap.add_argument("--commits", type=int, default=60, help="real commits to replay")
    ap.add_argument("--reps", type=int, default=20, help="replays of each commit per variant")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a short sim run to record from, to check that the script "
        "runs (tests/test_benchmarks.py, with few --commits): its numbers mean nothing",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        data, name = load_dataset("mnist", args.root, download=False), "mnist"
    except Exception:  # noqa: BLE001
        data, name = load_dataset("digits", args.root, download=False), "digits"
    if args.smoke:  # a sim run of 4 batches per worker rather than a whole epoch of MNIST
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")
        data = dataclasses.replace(
            data, train_x=data.train_x[:256], train_y=data.train_y[:256], val_x=data.val_x[:64], val_y=data.val_y[:64]
        )
    commits = record_commits(data, args.commits)
    model = build_flat_model(
        Job(
            algorithm="gem",
            hp=gem.Params(),
            model="mnist_cnn",
            data=data,
            workers=1,
            batch_size=BATCH_SIZE,
            epochs=1,
            seed=SEED,
            engine={},
            eval_every=10**9,
            eval_train_size=64,
        )
    )
    layout = list(zip(model.tensor_names, model.slices, strict=True))
    print(
        f"GEM's commit, mnist_cnn ({model.numel:,} parameters, {len(layout)} tensors), {len(commits)} real commits "
        f"of a sim run on {name}, {args.reps} replays each, 1 thread, torch {torch.__version__}"
    )
    fused_flag = gem.FUSED
    ratios: list[float] = []
    totals = {True: {}, False: {}}
    try:
        for c in commits:
            per = {}
            for fused in (True, False) * max(1, args.reps):
                gem.FUSED = fused
                parts: dict[str, float] = {}
                one_commit(c, gem.Params(), layout, parts)
                per.setdefault(fused, []).append(parts["commit"])
                for k, v in parts.items():
                    totals[fused][k] = totals[fused].get(k, 0.0) + v
            ratios.append(statistics.median(per[True]) / statistics.median(per[False]))
    finally:
        gem.FUSED = fused_flag
    runs = {f: len(commits) * max(1, args.reps) for f in (True, False)}
    print("\n| CPU per commit, ms (mean) | torch operations | fused loops |\n|---|---|---|")
    for k in ("prepare", "worker rule", "server rule", "diagnostics", "commit"):
        print(f"| {k} | {totals[False][k] / runs[False] * 1e3:.3f} | {totals[True][k] / runs[True] * 1e3:.3f} |")
    print(
        f"\nfused / torch CPU per commit: **{statistics.median(ratios):.2f}x** (median over the commits; "
        f"range {min(ratios):.2f}-{max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
