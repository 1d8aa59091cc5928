"""engine=distributed across a shaped link: the parameter server's commits per second against the link's limit.

Two hosts are network namespaces of this machine (tests/helpers/netns.py) joined by one veth pair, shaped by tbf to a
known rate R on both ends. Host 0 runs rank 0 alone (the parameter server, `--nproc_per_node=1`); host 1 runs the n
workers (`--nproc_per_node=n`), so that every commit crosses the link: θ from the server to the worker, Δ back, 2 × θ
bytes in all (the bytes counted on the link are printed beside it). A link carries R each way at once (full duplex;
tbf shapes each end's sending), so its limit is R / θ commits per second: both directions full. DOWNPOUR's worker
rule reads no θ, so rank 0 serves it in full duplex (docs/design.md, "Full duplex over the wire"): θ goes back to
one worker while the next worker's Δ comes in. R / (2 θ), the two messages one after the other at R, what the
half-duplex exchange of the rules that read the live θ (GEM) reaches, is printed too. The ratio is the run's
commits per second (rows of rank 0's run directory, between the first and the last commit: start-up and the final
evaluation left out) over R / θ. The link is the bottleneck only where the workers' own steps (n of them in
parallel on host 1) are shorter than a commit's transfer: `a worker's step` (the median of its cycle less its wait
for the server, θ's way to it included) is printed next to the transfer time, so each row says whether it measures
the link or the workers.

    python benchmarks/multihost.py [--rates 1000 10000] [--models mnist_cnn alexnet_cifar] [--workers 3] [--commits N]
        [--device cuda]

Needs root and iproute2 (`ip`, `tc`); says so and exits 0 without them. Each run: a few seconds to a minute.
`--smoke` runs one tiny configuration, to check that the script runs (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the namespaces helper, shared with tests/test_multihost.py

from helpers.netns import Hosts, Unavailable  # noqa: E402

from gem.metrics import read_table  # noqa: E402
from gem.models import build_model_meta  # noqa: E402

SECRET = "b7d1e0c94f2a3865a1c0de5f7e9b2c41"
PORT = 29510
# per model: (batch size, commits per worker, overrides): small batches, so that a worker's step is short against a
# commit's transfer and the link, not the workers, sets the pace (AlexNet at η = 0.005: it diverges at 0.05)
SETTINGS = {
    "mnist_cnn": (8, 150, ["data=synthetic", "data.synthetic.train_size=1200", "data.synthetic.val_size=64"]),
    "alexnet_cifar": (
        8,
        12,
        ["data=synthetic", "data.synthetic.train_size=96", "data.synthetic.val_size=16", "lr=0.005"],
    ),
}


def theta_bytes(model: str) -> int:
    return 4 * sum(p.numel() for p in build_model_meta(model).parameters())


def run_once(
    hosts: Hosts,
    model: str,
    workers: int,
    batch: int,
    commits: int,
    data: list[str],
    out: Path,
    timeout_s: float = 600,
    device: str = "cpu",
) -> dict:
    """One run across the link; returns its measured rates."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    run_dir = out / f"{model}-{time.time_ns()}"
    train = int(next(o for o in data if o.startswith("data.synthetic.train_size=")).split("=")[1])
    epochs = max(1, round(commits * batch / train))
    procs, before = [], sum(hosts.link_bytes(1))
    for i, nproc in enumerate((1, workers)):
        argv = [
            torchrun,
            "--nnodes=2",
            f"--nproc_per_node={nproc}",
            f"--node_rank={i}",
            "--rdzv_backend=static",
            f"--master_addr={hosts.hosts[0].addr}",
            f"--master_port={PORT}",
            "run.py",
            "engine=distributed",
            f"workers={workers}",
            "engine.allow_remote=true",
            "logger.wandb.mode=disabled",
            "logger.progress=false",
            f"model={model}",
            f"batch_size={batch}",
            f"epochs={epochs}",
            "logger.eval_every=100000",
            "algorithm=downpour",
            f"device={device}",
            *data,
            f"hydra.run.dir={run_dir}",
        ]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": hosts.hosts[i].ifname, "GEM_RUN_SECRET": SECRET}
        log = open(out / f"node{i}.log", "w")  # noqa: SIM115 - closed by the process's end
        procs.append(hosts.popen(i, argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    for i, p in enumerate(procs):
        try:
            code = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"host {i} still runs after {timeout_s:.0f} s") from None
        if code:
            raise RuntimeError(f"host {i} exited {code}: {(out / f'node{i}.log').read_text()[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    m = read_table(run_dir)
    span = m["time_s"].iloc[-1] - m["time_s"].iloc[0]
    cycle = m.groupby("worker")["time_s"].diff()  # a worker's time between two of its commits
    compute = float((cycle - m["wait_s"]).median()) if "wait_s" in m else float("nan")
    moved = (sum(hosts.link_bytes(1)) - before) / len(m)  # both directions, start-up and evaluation included
    return {
        "commits_per_s": (len(m) - 1) / span,
        "compute_s": compute,
        "server_busy": summary.get("server_busy"),
        "bytes_per_commit": moved,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[1000, 10000], help="link rates, Mbit/s")
    ap.add_argument("--models", nargs="+", default=list(SETTINGS))
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--commits", type=int, help="commits per worker (default: the model's, in SETTINGS)")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the workers compute: cpu, or cuda (GPU workers are fast "
        "enough for a 10 Gbit/s link to set the pace; each host's rank uses the one GPU)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny run at 1 Gbit/s, to check that the script runs "
        "(tests/test_benchmarks.py): its numbers mean nothing",
    )
    args = ap.parse_args()
    if args.smoke:
        args.rates, args.models, args.workers = [1000], ["mnist_cnn"], 1
        print("--smoke: one tiny run, to check that the script runs; its numbers mean nothing")
    print(
        f"engine=distributed, DOWNPOUR, server alone on host 0, {args.workers} worker(s) on host 1 "
        f"(device={args.device}), {os.cpu_count()} cores in all"
    )
    print(
        "\n| model | θ | link R | on the link a commit | limit R / θ | R / (2 θ) | measured commits/s | / limit "
        "| a worker's step | θ at R | server busy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        with Hosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
            for model in args.models:
                batch, commits, data = SETTINGS[model]
                commits = 10 if args.smoke else args.commits or commits
                size = theta_bytes(model)
                for rate in args.rates:
                    hosts.shape(rate)
                    limit = rate * 1e6 / 8 / size
                    r = run_once(hosts, model, args.workers, batch, commits, data, Path(tmp), device=args.device)
                    print(
                        f"| {model} | {size / 1e6:.2f} MB | {rate / 1000:g} Gbit/s | "
                        f"{r['bytes_per_commit'] / 1e6:.2f} MB | {limit:.1f} | {limit / 2:.1f} | "
                        f"{r['commits_per_s']:.1f} | **{r['commits_per_s'] / limit:.2f}** | "
                        f"{r['compute_s'] * 1e3:.0f} ms | {1e3 / limit:.1f} ms | {r['server_busy']} |",
                        flush=True,
                    )
    except Unavailable as e:
        print(f"skipped: no network namespaces here ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
