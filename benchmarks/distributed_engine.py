"""The `distributed` engine against the `process` engine, ratios measured side by side in one run.

1. Throughput: aggregate worker steps per second of `engine=distributed` (rank 0 the recorder, workers spawned by
   the local launch, which pass the server's turn among themselves and commit to θ in shared memory: only their
   rows travel, over loopback TCP) over that of
   `engine=process` (θ in shared memory), same algorithm, n, model (`mnist_cnn`), batch (64) and budget, run
   one after the other; also `engine.shared_memory=false` (rank 0 serves every commit, θ and Δ over loopback TCP,
   as for a worker on another host); each also over plain sequential 1-thread SGD timed around it
   (benchmarks/process_engine.py's yardstick). Timed from the first to the last commit row, and "while all run",
   as in the process benchmark.
2. Parameter-server capacity for `alexnet_cifar` (7.5M parameters, 30 MB per message): rank 0's time per
   exchange (GO, θ out, commit in, server rule; `server_commit_s` in summary.json), from a real run with 4
   workers over the wire (with shared memory, a local launch's workers commit themselves and rank 0 serves no
   exchange), turned into commits per second and divided by the steps per second
   of one plain SGD step of AlexNet at batch 64 on 1 thread: how many workers' worth of commits one server can
   absorb.

    python benchmarks/distributed_engine.py --root ../shared/data [--rounds 3] [--workers 4]

`--smoke` runs every part at tiny sizes (512 digits, 10 reference steps, 2 AlexNet workers), to check that the script
runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from process_engine import ALEXNET_LR, engine_run, sequential_steps_per_s, throughput  # noqa: E402
from transport import sgd_step_seconds  # noqa: E402

from gem.data import load_dataset, make_synthetic  # noqa: E402
from gem.engines import distributed, process  # noqa: E402
from gem.engines.worker import threads_per_process  # noqa: E402

# (label, engine, options): `distributed` as a user runs it (θ in shared memory for its local workers), and over
# the wire (engine.shared_memory=false), as every worker on another host
ENGINES = [
    ("process", process, None),
    ("distributed", distributed, {"timeout_s": 120}),
    ("wire", distributed, {"timeout_s": 120, "shared_memory": False}),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="../shared/data")
    ap.add_argument("--workers", type=int, nargs="+", default=[4])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a few steps of every part, to check that the script runs "
        "(tests/test_benchmarks.py): its numbers mean nothing",
    )
    args = ap.parse_args()
    steps = 10 if args.smoke else 150
    name = "digits" if args.smoke else "mnist"  # --smoke: the embedded digits, a short epoch
    try:
        data = load_dataset(name, args.root, download=False)
    except Exception:  # noqa: BLE001
        data, name = load_dataset("digits", args.root, download=False), "digits"
    if args.smoke:  # 8 batches per worker and epoch
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")
        data = dataclasses.replace(
            data, train_x=data.train_x[:512], train_y=data.train_y[:512], val_x=data.val_x[:64], val_y=data.val_y[:64]
        )
    print(
        f"data={name} ({len(data.train_y)} train), mnist_cnn, b=64, torch {torch.__version__}, "
        f"{threads_per_process(1)} cores",
        flush=True,
    )

    # 1. throughput, distributed against process
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for algo in ("gem", "downpour"):
            for n in args.workers:
                got = rows.setdefault((algo, n), {})
                rates = {}
                for label, eng, options in ENGINES:
                    before = sequential_steps_per_s(data, steps)
                    whole, full = throughput(data, algo, n, args.epochs, engine=eng, options=options)
                    ref = (before + sequential_steps_per_s(data, steps)) / 2
                    rates[label] = (whole, full)
                    got.setdefault(f"{label} / sequential", []).append(whole / ref)
                for label in ("distributed", "wire"):
                    got.setdefault(f"{label} / process", []).append(rates[label][0] / rates["process"][0])
                got.setdefault("distributed / process, while all run", []).append(
                    rates["distributed"][1] / rates["process"][1]
                )
                print(
                    f"round {r + 1}: {algo} n={n}: process {rates['process'][0]:.1f}, distributed "
                    f"{rates['distributed'][0]:.1f} ({rates['wire'][0]:.1f} over the wire) worker steps/s: "
                    f"{rates['distributed'][0] / rates['process'][0]:.2f}x "
                    f"({rates['wire'][0] / rates['process'][0]:.2f}x)",
                    flush=True,
                )
    print(
        f"\n| n | algorithm | distributed / process | while all run | shared_memory=false / process | "
        f"process / sequential | distributed / sequential |  (median [range] over {args.rounds} rounds)"
    )
    print("|---|---|---|---|---|---|---|")

    def cell(v):
        return f"**{statistics.median(v):.2f}x** [{min(v):.2f}-{max(v):.2f}]"

    for (algo, n), got in rows.items():
        print(
            f"| {n} | {algo} | {cell(got['distributed / process'])} | "
            f"{cell(got['distributed / process, while all run'])} | {cell(got['wire / process'])} | "
            f"{cell(got['process / sequential'])} | {cell(got['distributed / sequential'])} |"
        )

    # 2. parameter-server capacity, alexnet_cifar
    syn = make_synthetic((3, 32, 32), num_classes=10, train_size=64, val_size=16, seed=0)
    for r in range(args.rounds):
        step = sgd_step_seconds("alexnet_cifar", reps=1 if args.smoke else 5, warmup=1 if args.smoke else 3)
        for shared in (False,):
            m, result = engine_run(
                syn,
                "downpour",
                2 if args.smoke else 4,
                epochs=1 if args.smoke else 4,
                model="alexnet_cifar",
                batch_size=16,
                engine=distributed,
                options={"timeout_s": 300, "shared_memory": shared},
                with_result=True,
                lr=ALEXNET_LR,
            )
            commit_s = result.extra["server_commit_s"]
            print(
                f"alexnet_cifar round {r + 1}, shared_memory={str(shared).lower()}: server {commit_s * 1e3:.1f} ms "
                f"per commit ({1 / commit_s:.1f} commits/s, busy {result.extra['server_busy']:.2f}), one SGD step "
                f"at b=64 on 1 thread {step * 1e3:.0f} ms: **{step / commit_s:.1f} commits per SGD step**",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
