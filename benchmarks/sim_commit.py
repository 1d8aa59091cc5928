"""Simulated commit cost: one `sim` commit of gem / downpour against one step of plain SGD.

For `mnist_cnn` with batch 64, side by side in one run:

  (ref)  plain sequential SGD: `torch.optim.SGD(lr=0.05, momentum=0.9)` on an ordinary nn.Module, fed the
         same in-memory batches (`Dataset.batch`): batch, forward, backward, optimizer step;
  (sim)  the `sim` engine with n virtual workers (round_robin) running `gem` or `downpour`, recording every
         commit row (and GEM's per-tensor π rows) into parquet as a real run does.

A commit of gem or downpour (window 1) is one gradient step, so the ratio (time per commit) / (time per
reference step) is the engine's overhead: loading the worker's stale copy, the algorithm's rules, the pull,
the metrics. It is timed from the first to the last commit row (`time_s`), so the evaluations of the
central variable at the start and the end are left out; `logger.eval_every` sets how often a real run pays
for them. Variants are interleaved and their order rotates every round; the headline is the median over
rounds of each round's ratio, never a lone absolute time.

    python benchmarks/sim_commit.py --root ../shared/data --workers 30 [--rounds 5] [--threads 2]

`--smoke` runs every part at tiny sizes (256 training examples, 5 reference steps), to check that the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from gem import algorithms
from gem.data import WorkerStream, load_dataset
from gem.engines import Job, sim
from gem.metrics import Recorder, read_table
from gem.models import build_model

BATCH_SIZE, LR, MOMENTUM, SEED = 64, 0.05, 0.9, 0


def plain_sgd(data, steps: int) -> float:
    """Seconds per step of torch.optim.SGD on the same model, batch size and batches."""
    torch.manual_seed(SEED)
    model = build_model("mnist_cnn", num_classes=data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    stream = WorkerStream(len(data.train_y), BATCH_SIZE, seed=SEED, worker=0)
    model.train()
    t0 = None
    for i in range(steps + 1):
        if i == 1:  # the first step warms up allocations, as the engine's initial evaluation does
            t0 = time.perf_counter()
        x, y = data.batch(stream.next_indices(), stream.generator)
        opt.zero_grad(set_to_none=False)
        F.nll_loss(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps


def sim_commit(data, name: str, workers: int, epochs: int) -> tuple[float, int]:
    """(seconds per commit, commits) of the sim engine, first to last commit row."""
    params = algorithms.get(name).Params
    hp = params(lr=LR, momentum=MOMENTUM, **({"workers": workers} if "workers" in params.__dataclass_fields__ else {}))
    job = Job(
        algorithm=name,
        hp=hp,
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        seed=SEED,
        engine={"staleness": "round_robin"},
        eval_every=10**9,
        eval_train_size=256,
    )
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d)
        result = sim.run(job, rec)
        rec.close()
        t = read_table(d)["time_s"]
    assert result.status == "completed", result
    return (t.iloc[-1] - t.iloc[0]) / (len(t) - 1), len(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="../shared/data", help="folder with MNIST/raw; digits if absent")
    ap.add_argument("--workers", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=1, help="passes over the data per worker")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, to check that the script runs (tests/test_benchmarks.py): its numbers mean nothing",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        data, name = load_dataset("mnist", args.root, download=False), "mnist"
    except Exception as e:  # no MNIST here: the embedded digits, upsampled to 28x28
        print(f"(MNIST not found under {args.root}: {e}; using digits)", file=sys.stderr)
        data, name = load_dataset("digits", args.root, download=False), "digits"
    sgd_steps = 200
    if args.smoke:  # 4 batches per worker and epoch, a short validation set, a few reference steps
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")
        data = dataclasses.replace(
            data, train_x=data.train_x[:256], train_y=data.train_y[:256], val_x=data.val_x[:64], val_y=data.val_y[:64]
        )
        sgd_steps = 5
    print(
        f"data={name} ({len(data.train_y)} train), mnist_cnn, b={BATCH_SIZE}, n={args.workers}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    variants = ["gem", "downpour"]
    ratios = {v: [] for v in variants}
    times = {v: [] for v in ["sgd", *variants]}
    commits = {}
    for r in range(args.rounds):
        order = variants[r % 2 :] + variants[: r % 2]
        ref_before = plain_sgd(data, sgd_steps)
        measured = {}
        for v in order:
            measured[v], commits[v] = sim_commit(data, v, args.workers, args.epochs)
        ref_after = plain_sgd(data, sgd_steps)
        ref = (ref_before + ref_after) / 2  # bracket the engine runs: drift hits both sides alike
        times["sgd"].append(ref)
        for v in variants:
            ratios[v].append(measured[v] / ref)
            times[v].append(measured[v])
        print(
            f"round {r + 1}: sgd {ref * 1e3:.2f} ms/step; "
            + "; ".join(f"{v} {measured[v] * 1e3:.2f} ms/commit ({measured[v] / ref:.3f}x)" for v in variants),
            flush=True,
        )
    print(f"\n| variant | ratio to plain SGD step (median [range] over {args.rounds} rounds) | commits | ms |")
    print("|---|---|---|---|")
    print(f"| plain SGD step | 1.000x | | {statistics.median(times['sgd']) * 1e3:.2f} |")
    for v in variants:
        rs = ratios[v]
        print(
            f"| sim {v}, n={args.workers} | **{statistics.median(rs):.3f}x** [{min(rs):.3f}-{max(rs):.3f}] "
            f"| {commits[v]} | {statistics.median(times[v]) * 1e3:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
