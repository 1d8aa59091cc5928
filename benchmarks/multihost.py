"""engine=distributed across shaped links: the parameter server's commits per second against the links' limit, half
and full duplex, and which of the link, the server's CPU or the workers' steps sets the pace.

Hosts are network namespaces of this machine (tests/helpers/netns.py), each link shaped by tbf at a known rate R on
both ends. Host 0 runs rank 0 alone (the coordinator and the parameter server, `--nproc_per_node=1`); host 1 runs
the n workers (`--nproc_per_node=n`), so that every commit crosses a link: θ from the server to the worker, Δ back,
2 × θ bytes in all (the bytes counted on the workers' link are printed beside it). DOWNPOUR is the algorithm
(`--algorithm`: another, as GEM, whose part of the rule that reads θ runs where θ lives in full duplex: at rank 0, or
at each server on its slice).

Duplex (`--duplex full half`, both by default, run one after the other for each model and rate):
- full (`engine.full_duplex=true`): DOWNPOUR's worker rule reads no θ, so rank 0 sends θ back to one worker while
  the next worker's Δ comes in (docs/design.md, "Full duplex over the wire"). A link carries R each way at once
  (tbf shapes each end's sending), so the link's limit is R / θ commits per second, both directions full;
- half (`engine.full_duplex=false`): each commit's exchange is served whole, θ out then Δ back, as for the rules
  that read the live θ (GEM): each direction idles half the time, and the link's limit is R / (2 θ). tbf's bucket
  (B bytes, 500 KB at 1 Gbit/s: tests/helpers/netns.py) fills while a direction idles and lets that much of the
  next message go at the veth's own speed, so the limit taken is R / (2 (θ − B)), at most R / θ, which no direction
  can pass on average: an upper bound (the bucket may not be full again), so that a rate close to it is surely the
  link's. For AlexNet it is R / (2 θ) within 2%; for mnist_cnn (0.66 MB) it is R / θ.

Sharded servers (`--servers 1 2 3`, `engine.servers=S`; docs/design.md, "Sharded servers"): θ in S shards, each
served by its own rank on a host of its own behind its own link at R; each commit moves θ / S each way across each
server's link, so the links add up and the limit is S × R / θ. The hosts are laid out as the engine's ranks need
them: rank 0 (coordinator and shard 0) on host 0, ranks 1..n (the workers) on host 1, ranks n + 1 .. n + S − 1
(shards 1..S − 1) on hosts 2..S, one each: torchrun's static rendezvous with `--nnodes=S+1`, the nodes in that
order, a world of n + S ranks. Two hosts share one veth pair; more are joined through a hub (tests/helpers/netns.py),
where the workers' host's link is shaped at S × R, so that the servers' links, not the workers', are the limit.
Several servers run in full duplex only: a half-duplex row with S > 1 is skipped, with the engine's reason.

Each row: the limit `S × R / θ` (`limit_per_s` in `--json`, whatever the duplex), the mode's own link limit
(S × R / θ in full duplex, the half-duplex limit above in half; `mode_limit_per_s`), the measured commits per
second (rows of rank 0's run directory, between the first and the last commit: start-up and the final evaluation
left out) and its ratio to S × R / θ, and what sets the pace, decided from three measured shares, in this order:

1. `link` if the measured rate is at least 0.8 of the mode's own link limit (the rest is TCP's framing, 0.956 of
   the rate, and the small messages around each transfer);
2. else `server CPU` if rank 0's exchanges filled at least 0.8 of the span (`server_commit_s` of summary.json, its
   seconds per exchange, times the measured rate; summary.json's own `server_busy` divides by rank 0's whole run,
   start-up and final evaluation included, so it reads lower and is printed beside) and the workers did not (3.):
   its serial loop is full while the link is not, so each exchange's time beyond its transfer at R sets the pace:
   rank 0 receiving, applying and copying, the small messages around the transfer, and, since all hosts here share
   this machine's cores, the wait for a core (the worker rule's few passes over θ, between GO and Δ, count too).
   With S > 1, the busiest server's share counts (summary.json's `shards` times each other shard's exchanges as
   `server_commit_s` does rank 0's; `shards_busy_span` in `--json`);
3. else `worker steps` if the workers stepped at least 0.8 of the time (n workers, each stepping for the median
   `a worker's step`: its cycle between two commits less its row's `wait_s`, which is the gradient, its rule and
   Δ's way up; stepping share = measured rate × step / n) and rank 0's exchanges did not fill the span;
4. else `unclear`: both were full (on a machine whose cores they share, neither alone sets the pace) or neither
   was (the pace is set by something not measured here: latency, the scheduler). No guess.

    python benchmarks/multihost.py [--rates 1000 10000] [--models mnist_cnn alexnet_cifar] [--workers 3]
        [--duplex full half] [--servers 1 2 3] [--algorithm gem] [--commits N] [--device cuda] [--json FILE]

Needs root and iproute2 (`ip`, `tc`); says so and exits 0 without them (writing no rows to `--json`). Each run: a
few seconds to a minute. A run that fails is reported on its row's line and the others go on; the exit code is then
1. `--smoke` runs one tiny configuration, two servers in full duplex (the refused half-duplex one said), to check
that the script runs (tests/test_benchmarks.py).
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

from helpers.netns import Hosts, Unavailable, bucket_bytes  # noqa: E402

from gem import algorithms  # noqa: E402
from gem.engines.distributed.shards import refusal  # noqa: E402
from gem.engines.options import DistributedOptions  # noqa: E402
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
DUPLEX = {"full": "true", "half": "false"}  # --duplex: engine.full_duplex
# a share of the span at or above which a part is taken to set the pace (the module's rule); below 1 because a
# link never carries its whole rate (TCP's framing: 0.956) and a loop that is never idle still has gaps
FULL = 0.8
ALGORITHM = "downpour"  # the default: its worker rule reads no θ, so it runs in full duplex and on several servers


def theta_bytes(model: str) -> int:
    return 4 * sum(p.numel() for p in build_model_meta(model).parameters())


def nodes(workers: int, servers: int) -> list[int]:
    """Processes per host, in torchrun's node order: rank 0 alone, the n workers, then one host per further shard
    (ranks n + 1 .. n + S − 1: static rendezvous numbers ranks node after node)."""
    return [1, workers, *[1] * (servers - 1)]


def shape(hosts: Hosts, rate_mbit: float, servers: int) -> None:
    """Each server's host behind its own link at R; the workers' host at S × R, so that it is not the limit (with
    one server, both hosts share one link, at R)."""
    hosts.shape(rate_mbit)
    if servers > 1:
        hosts.shape(servers * rate_mbit, hosts=[1])


def link_limit(rate_mbit: float, theta: int, servers: int, duplex: str) -> float:
    """Commits per second the servers' links allow in this duplex (the module says why): each commit moves its
    shard, θ / S, each way across each server's link."""
    rate, shard = rate_mbit * 1e6 / 8, theta / servers
    if duplex == "full":
        return rate / shard
    return min(rate / shard, rate / (2 * max(shard - bucket_bytes(rate_mbit), 1)))


def pace(link_share: float, server_busy: float | None, workers_stepping: float) -> str:
    """Which part sets the pace, from the shares the module's rule names."""
    if link_share >= FULL:
        return "link"
    server = server_busy is not None and server_busy >= FULL
    workers = workers_stepping >= FULL
    if server and not workers:
        return "server CPU"
    if workers and not server:
        return "worker steps"
    return "unclear"


def run_once(
    hosts: Hosts,
    model: str,
    workers: int,
    servers: int,
    duplex: str,
    batch: int,
    commits: int,
    data: list[str],
    out: Path,
    timeout_s: float = 600,
    device: str = "cpu",
    algorithm: str = ALGORITHM,
) -> dict:
    """One run across the links; returns what it measured."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    run_dir = out / f"{model}-{time.time_ns()}"
    train = int(next(o for o in data if o.startswith("data.synthetic.train_size=")).split("=")[1])
    epochs = max(1, round(commits * batch / train))
    layout = nodes(workers, servers)
    procs, before = [], sum(hosts.link_bytes(1))
    for i, nproc in enumerate(layout):
        argv = [
            torchrun,
            f"--nnodes={len(layout)}",
            f"--nproc_per_node={nproc}",
            f"--node_rank={i}",
            "--rdzv_backend=static",
            f"--master_addr={hosts.hosts[0].addr}",
            f"--master_port={PORT}",
            "run.py",
            "engine=distributed",
            f"workers={workers}",
            "engine.allow_remote=true",
            f"engine.full_duplex={DUPLEX[duplex]}",
            f"engine.servers={servers}",
            "logger.wandb.mode=disabled",
            "logger.progress=false",
            f"model={model}",
            f"batch_size={batch}",
            f"epochs={epochs}",
            "logger.eval_every=100000",
            f"algorithm={algorithm}",
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
    if summary["status"] != "completed":
        raise RuntimeError(f"the run ended {summary['status']}: {summary.get('reason')}")
    # the row must measure the duplex it names: placement says which ran (placement.Placement.describe)
    ran = "full" if "in full duplex" in (summary.get("placement") or "") else "half"
    if ran != duplex:
        raise RuntimeError(f"engine.full_duplex={DUPLEX[duplex]} ran {ran} duplex: {summary.get('placement')}")
    m = read_table(run_dir)
    span = m["time_s"].iloc[-1] - m["time_s"].iloc[0]
    cycle = m.groupby("worker")["time_s"].diff()  # a worker's time between two of its commits
    compute = float((cycle - m["wait_s"]).median())
    moved = (sum(hosts.link_bytes(1)) - before) / len(m)  # both directions, start-up and evaluation included
    rate = (len(m) - 1) / span
    per_commit = summary.get("server_commit_s")
    # the other shards' servers, timed as rank 0's is; the busiest server is the one that may set the pace
    shards = [x["server_commit_s"] * rate for x in summary.get("shards") or [] if x.get("server_commit_s")]
    if per_commit is not None and shards:
        per_commit = max(per_commit, max(shards) / rate)
    return {
        "commits": len(m),
        "commits_per_s": rate,
        "compute_s": compute,
        "workers_stepping": rate * compute / workers,
        "server_commit_s": per_commit,
        "server_busy": summary.get("server_busy"),
        "server_busy_span": per_commit * rate if per_commit is not None else None,
        "shards_busy_span": shards,
        "bytes_per_commit": moved,
    }


def share(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[1000, 10000], help="link rates, Mbit/s")
    ap.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument(
        "--algorithm",
        default=ALGORITHM,
        choices=list(algorithms.ALGORITHMS),
        help="the rule (gem: its part that reads θ runs where θ lives in full duplex, on each server's slice)",
    )
    ap.add_argument("--duplex", nargs="+", default=list(DUPLEX), choices=list(DUPLEX), help="engine.full_duplex")
    ap.add_argument("--servers", type=int, nargs="+", default=[1], help="shard counts S (engine.servers)")
    ap.add_argument("--commits", type=int, help="commits per worker (default: the model's, in SETTINGS)")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the workers compute: cpu, or cuda (GPU workers are fast "
        "enough for a 10 Gbit/s link to set the pace; each host's rank uses the one GPU)",
    )
    ap.add_argument("--json", type=Path, help="write the rows to this file, as a list of records")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run at 1 Gbit/s (two servers in full duplex), to check that the script runs "
        "(tests/test_benchmarks.py): its numbers mean nothing",
    )
    args = ap.parse_args()
    for servers in args.servers:  # the engine's own range for engine.servers
        try:
            DistributedOptions(servers=servers)
        except ValueError as e:
            ap.error(f"--servers {servers}: {e}")
    if args.workers < 1:
        ap.error(f"--workers {args.workers} is not allowed; it must be an integer >= 1")
    if args.smoke:
        args.rates, args.models, args.workers, args.duplex = [1000], ["mnist_cnn"], 1, list(DUPLEX)
        # two servers: the hub's layout, the shards' statistics, and half duplex's refusal, in one run (each host
        # starts torchrun and run.py, which import torch: most of the suite's time for this script)
        args.servers = [2]
        print("--smoke: a tiny run, to check that the script runs; its numbers mean nothing")
    print(
        f"engine=distributed, algorithm={args.algorithm}, rank 0 alone on host 0, {args.workers} worker(s) on host 1 "
        f"(device={args.device}), shards 1..S-1 on hosts 2..S; {os.cpu_count()} cores in all"
    )
    rows: list[dict] = []
    failed = 0
    try:
        print(
            "\n| model | S | duplex | θ | link R | on the link a commit | limit S R / θ | the mode's link limit "
            "| measured commits/s | / limit | a worker's step | θ / S at R "
            "| server busy (busiest, span; rank 0, whole run) | workers stepping | sets the pace |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for servers in args.servers:
            # the configurations the engine refuses (several servers in half duplex), said once, with its reason
            runs = []
            for duplex in args.duplex:
                options = DistributedOptions(servers=servers, full_duplex=duplex == "full")
                if why := refusal(args.algorithm, algorithms.get(args.algorithm).Params(), options):
                    print(f"S = {servers}, {duplex} duplex: skipped, the engine refuses it: {why}")
                else:
                    runs.append(duplex)
            if not runs:
                continue
            with Hosts(servers + 1) as hosts, tempfile.TemporaryDirectory() as tmp:
                for model in args.models:
                    batch, commits, data = SETTINGS[model]
                    commits = 10 if args.smoke else args.commits or commits
                    size = theta_bytes(model)
                    for rate in args.rates:
                        shape(hosts, rate, servers)
                        limit = servers * rate * 1e6 / 8 / size  # S × R / θ
                        for duplex in runs:
                            own = link_limit(rate, size, servers, duplex)
                            head = f"| {model} | {servers} | {duplex} | {size / 1e6:.2f} MB | {rate / 1000:g} Gbit/s |"
                            try:
                                r = run_once(
                                    hosts,
                                    model,
                                    args.workers,
                                    servers,
                                    duplex,
                                    batch,
                                    commits,
                                    data,
                                    Path(tmp),
                                    device=args.device,
                                    algorithm=args.algorithm,
                                )
                            except RuntimeError as e:
                                failed += 1
                                print(f"{head} failed: {' '.join(str(e).split())[-600:]} |", flush=True)
                                continue
                            pace_by = pace(r["commits_per_s"] / own, r["server_busy_span"], r["workers_stepping"])
                            rows.append(
                                {
                                    "model": model,
                                    "algorithm": args.algorithm,
                                    "servers": servers,
                                    "duplex": duplex,
                                    "rate_mbit": rate,
                                    "theta_bytes": size,
                                    "commits_per_s": r["commits_per_s"],
                                    "limit_per_s": limit,
                                    "mode_limit_per_s": own,
                                    "ratio": r["commits_per_s"] / limit,
                                    "pace": pace_by,
                                    "workers": args.workers,
                                    "device": args.device,
                                    "theta_at_rate_s": size / servers / (rate * 1e6 / 8),
                                    **{k: v for k, v in r.items() if k != "commits_per_s"},
                                }
                            )
                            print(
                                f"{head} {r['bytes_per_commit'] / 1e6:.2f} MB | {limit:.1f} | {own:.1f} | "
                                f"{r['commits_per_s']:.1f} | **{r['commits_per_s'] / limit:.2f}** | "
                                f"{r['compute_s'] * 1e3:.0f} ms | {rows[-1]['theta_at_rate_s'] * 1e3:.1f} ms | "
                                f"{share(r['server_busy_span'])}; {share(r['server_busy'])} | "
                                f"{r['workers_stepping']:.2f} | {pace_by} |",
                                flush=True,
                            )
    except Unavailable as e:
        print(f"skipped: no network namespaces here ({e})")
    finally:
        if args.json:  # the rows measured, also when a later one failed
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if failed:
        print(f"{failed} run(s) failed: see their rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
