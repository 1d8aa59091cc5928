"""Which transport for the `distributed` engine? Commit round trips on loopback TCP, side by side.

A worker sends a commit (a model-sized tensor) to the parameter server (rank 0) and gets θ back; the server
applies commits one at a time, in arrival order. Two candidates from torch.distributed:

- `gloo`: point-to-point send/recv. The server takes a small header from *any* source (`recv(src=None)`, first
  come first served), then that worker's payload, applies it, and sends θ back.
- `rpc`: `rpc_sync` to a function on rank 0 that applies the commit under a lock and returns θ (TensorPipe).

Workers do no computation, so this is the transport's ceiling. Reported as ratios measured in the same run:
the time of one round trip (per worker, with n workers committing at once) over the time of one plain SGD
step of the same model at batch 64 on 1 thread, and each worker's share of the commits (fairness: 1/n).

    python benchmarks/transport.py --workers 4 --model mnist_cnn --seconds 5
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from gem import models  # noqa: E402

STOP = -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_size(name: str) -> int:
    return sum(p.numel() for p in models.build_model(name).parameters())


def sgd_step_seconds(name: str, reps: int = 20, warmup: int = 3) -> float:
    """One plain SGD step (forward, backward, update) of `name` at batch 64 on 1 thread, after `warmup` steps: the
    yardstick."""
    torch.set_num_threads(1)
    model = models.build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, *models.input_shape(name))
    y = torch.randint(0, 10, (64,))
    for i in range(reps + warmup):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / reps


# ------------------------------------------------------------------------------------------ gloo


def gloo_main(rank: int, world: int, port: int, size: int, seconds: float, out) -> None:
    import warnings

    # recv(src=None) goes through a deprecated internal path and warns on every call
    warnings.filterwarnings("ignore", message="You are using a Backend")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    theta = torch.zeros(size)
    header = torch.zeros(2, dtype=torch.int64)
    if rank == 0:
        delta = torch.empty(size)
        counts = [0] * world
        live = world - 1
        t0 = time.perf_counter()
        while live:
            src = dist.recv(header, src=None)  # first come, first served
            if header[1].item() == STOP:
                live -= 1
                continue
            dist.recv(delta, src=src)
            theta.add_(delta)
            dist.send(theta, dst=src)
            counts[src] += 1
        out.put(("server", counts, time.perf_counter() - t0))
    else:
        delta = torch.full((size,), 1e-6)
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            header[0], header[1] = rank, n
            dist.send(header, dst=0)
            dist.send(delta, dst=0)
            dist.recv(theta, src=0)
            n += 1
        out.put(("worker", rank, n, time.perf_counter() - t0))
        header[1] = STOP
        dist.send(header, dst=0)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ rpc

_server = {}


def _apply(rank: int, delta: torch.Tensor) -> torch.Tensor:
    with _server["lock"]:
        _server["theta"].add_(delta)
        _server["counts"][rank] += 1
        return _server["theta"].clone()


def rpc_main(rank: int, world: int, port: int, size: int, seconds: float, out) -> None:
    from torch.distributed import rpc

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=world + 2, _transports=["uv"]
    )
    if rank == 0:
        _server.update(theta=torch.zeros(size), lock=threading.Lock(), counts=[0] * world)
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank != 0:
        delta = torch.full((size,), 1e-6)
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            rpc.rpc_sync("r0", _apply, args=(rank, delta))
            n += 1
        out.put(("worker", rank, n, time.perf_counter() - t0))
    rpc.shutdown()  # a barrier: rank 0 waits for every worker
    if rank == 0:
        out.put(("server", _server["counts"], 0.0))


def measure(kind: str, workers: int, size: int, seconds: float) -> dict:
    # forked from a forkserver that imports torch once, rather than spawned: each spawned process spent 2.4 s of
    # CPU importing torch, which the round trips measured after start-up do not depend on
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    out = ctx.Queue()
    port = free_port()
    target = gloo_main if kind == "gloo" else rpc_main
    procs = [ctx.Process(target=target, args=(r, workers + 1, port, size, seconds, out)) for r in range(workers + 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    done = [r for r in results if r[0] == "worker"]
    counts = next(r[1] for r in results if r[0] == "server")[1:]
    per_worker = [n / t for _, _, n, t in done]
    return {
        "round_trip_s": 1.0 / (sum(per_worker) / len(per_worker)),
        "commits_per_s": sum(per_worker),
        "shares": [c / sum(counts) for c in counts],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="mnist_cnn", choices=list(models.MODELS))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    size = model_size(args.model)
    print(
        f"model {args.model}: {size:,} parameters ({size * 4 / 1e6:.1f} MB per commit and per reply); "
        f"n = {args.workers} workers + 1 server on loopback, {os.cpu_count()} cores"
    )
    for r in range(args.rounds):
        step = sgd_step_seconds(args.model)
        for kind in ("gloo", "rpc"):
            m = measure(kind, args.workers, size, args.seconds)
            shares = " ".join(f"{s:.3f}" for s in m["shares"])
            print(
                f"round {r}  {kind:4s}  round trip / SGD step = {m['round_trip_s'] / step:6.3f}   "
                f"server commits per SGD step = {m['commits_per_s'] * step:6.2f}   shares {shares}"
            )


if __name__ == "__main__":
    main()
