"""Memory per worker: what the up-front check in `experiments.config` assumes, against what a
real run's workers hold, side by side; and the start-up and memory of n worker processes.

For each model, `python run.py engine=process workers=N` runs until its workers have taken steps; then every
worker process's USS (its private pages: Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup; the shared
libraries are counted once, in the coordinator) and RSS are read, and compared with `gem.engines.memory`'s
estimate for that model. The estimate is meant as a lower bound (activations are not in it): estimate / USS
at most 1. For `sim`, the growth of the process's RSS when N virtual workers are built, per worker, against the
estimate.

With `--startup N [N ...]`, for each N: `python run.py workers=N` (GEM, mnist_cnn, digits) is launched and timed
until its first commit and until every one of its N workers has committed, as seen in the run directory's
metrics parts (flushed every half second, so a figure can be late by that much), each over the wall time of
`python -c "import torch"` measured just before it; then the USS of every worker process, of the process the
workers were started from (the forkserver, which holds torch once for all of them) and of the coordinator, and
the peak over the run so far of the whole run's proportional memory (PSS summed over the command's processes:
shared pages divided among their sharers, so the sum is what the run costs the machine).

    python -m benchmarks.worker_memory [--workers 2] [--wait 25]
    python -m benchmarks.worker_memory --startup 4 16 100 200

`--smoke` measures mnist_cnn only, and sim with 10 virtual workers, to check that the script runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("mnist_cnn", "digits"), ("alexnet_cifar", "synthetic")]


def smaps(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "rss": fields["Rss"], "pss": fields["Pss"]}


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="ignore")
    except OSError:
        return ""


def processes(parent: int) -> dict[str, list[int]]:
    """The processes of a run started as `parent`: its workers (spawned children, or the children of its
    forkserver), the forkserver, and the rest (multiprocessing's resource tracker)."""
    out: dict[str, list[int]] = {"workers": [], "forkserver": [], "other": []}
    for c in _children(parent):
        cmd = _cmdline(c)
        if "spawn_main" in cmd:
            out["workers"].append(c)
        elif "forkserver" in cmd:
            out["forkserver"].append(c)
            out["workers"] += _children(c)
        else:
            out["other"].append(c)
    return out


def worker_pids(parent: int) -> list[int]:
    return processes(parent)["workers"]


def _pss(parent: int) -> float:
    """The run's memory: PSS summed over the command and every process under it."""
    total, todo = 0.0, [parent]
    while todo:
        pid = todo.pop()
        try:
            total += smaps(pid)["pss"]
        except (OSError, KeyError):
            continue
        todo += _children(pid)
    return total


def _committed(run_dir: Path) -> set[int]:
    import pyarrow.parquet as pq

    seen: set[int] = set()
    for f in sorted((run_dir / "metrics.parts").glob("part-*.parquet")):
        try:
            seen.update(pq.read_table(f, columns=["worker"]).column("worker").to_pylist())
        except Exception:  # noqa: BLE001 - a part being written: read it next time
            continue
    return seen


def startup_case(workers: int, limit_s: float = 600.0) -> dict:
    """`python run.py workers=N` until all N workers have committed: its times, then its processes' memory."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    floor = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        overrides = [
            f"workers={workers}",
            "epochs=50",
            "logger.wandb.mode=disabled",
            "logger.progress=false",
            "logger.flush_seconds=0.5",
            f"hydra.run.dir={run_dir}",
        ]
        t = time.perf_counter()
        p = subprocess.Popen(
            [sys.executable, "run.py", *overrides],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first = every = None
        peak = 0.0
        try:
            sampled = 0.0
            while every is None:
                if p.poll() is not None:
                    raise RuntimeError(f"python run.py workers={workers} ended: {p.stdout.read().strip()[-500:]}")
                now = time.perf_counter() - t
                if now > limit_s:
                    raise RuntimeError(f"workers={workers}: not every worker committed within {limit_s:.0f} s")
                if now - sampled > 1.0:
                    peak, sampled = max(peak, _pss(p.pid)), now
                if (run_dir / "metrics.parts").is_dir():
                    seen = _committed(run_dir)
                    if seen and first is None:
                        first = now
                    if len(seen) >= workers:
                        every = now
                time.sleep(0.1)
            time.sleep(3.0)  # the workers at work: their pages as they train
            procs = processes(p.pid)
            uss = [smaps(w)["uss"] for w in procs["workers"]]
            server = [smaps(f)["uss"] for f in procs["forkserver"]]
            coordinator = smaps(p.pid)["uss"]
            peak = max(peak, _pss(p.pid))
        finally:
            p.kill()
            for pid in processes(p.pid)["workers"]:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            p.wait()
    return {
        "workers": workers,
        "processes": len(uss),
        "first": first,
        "every": every,
        "floor": floor,
        "uss": statistics.median(uss),
        "uss_max": max(uss),
        "forkserver": server[0] if server else None,
        "coordinator": coordinator,
        "peak": peak,
    }


def startup(ns: list[int]) -> None:
    mb = 2**20
    print("python run.py workers=N (GEM, mnist_cnn, digits): start-up and memory of its worker processes")
    print(
        f"{'N':>5}{'first commit s':>16}{'all committed s':>17}{'/ import torch':>16}{'worker USS MB':>15}"
        f"{'max':>7}{'forkserver MB':>15}{'coordinator MB':>16}{'run PSS GB':>12}"
    )
    for n in ns:
        r = startup_case(n)
        fs = f"{r['forkserver'] / mb:.0f}" if r["forkserver"] is not None else "-"
        print(
            f"{n:>5}{r['first']:>16.1f}{r['every']:>17.1f}{r['every'] / r['floor']:>15.1f}x"
            f"{r['uss'] / mb:>15.1f}{r['uss_max'] / mb:>7.0f}{fs:>15}{r['coordinator'] / mb:>16.0f}"
            f"{r['peak'] / 2**30:>12.2f}",
            flush=True,
        )


def process_case(model: str, data: str, workers: int, wait: float) -> dict:
    from experiments.config import check_job
    from gem import algorithms, models
    from gem.engines import memory

    overrides = ["engine=process", f"workers={workers}", f"model={model}", f"data={data}", "epochs=1000"]
    cfg, _ = check_job(overrides)
    params = sum(p.numel() for p in models.build_model(model).parameters())
    algo = algorithms.get(cfg.algorithm.name)
    import torch

    from experiments.config import algorithm_params

    state = len(algo.init_state(torch.zeros(params), algorithm_params(cfg)))
    estimate = memory.per_worker("process", params, state, 0)
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.Popen(
            [sys.executable, "run.py", *overrides, "logger.wandb.mode=disabled", f"hydra.run.dir={tmp}/run"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(wait)
            deadline = time.monotonic() + 120
            while len(worker_pids(p.pid)) < workers:  # a loaded machine: not every worker has started yet
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(overrides)}: its {workers} workers did not start")
                time.sleep(0.5)
            pids = worker_pids(p.pid)
            measured = [smaps(pid) for pid in pids]
        finally:
            p.kill()
            p.wait()
    uss = statistics.median(m["uss"] for m in measured)
    rss = statistics.median(m["rss"] for m in measured)
    return {"model": model, "workers": len(measured), "uss": uss, "rss": rss, "estimate": estimate}


def sim_case(model: str, data: str, workers: int) -> dict:
    import torch

    from experiments.config import check_job
    from experiments.job import build_job
    from gem import algorithms
    from gem.engines import memory
    from gem.engines.core import build_flat_model
    from gem.engines.worker import Worker

    cfg, checked = check_job(["engine=sim", f"workers={workers}", f"model={model}", f"data={data}"])
    job = build_job(checked, log=lambda *a: None)
    algo = algorithms.get(job.algorithm)
    flat = build_flat_model(job)

    def rss() -> int:
        return smaps(int(Path("/proc/self").resolve().name))["rss"]

    before = rss()
    built = [Worker(w, job, algo, flat, x=flat.param.clone()) for w in range(workers)]
    grown = (rss() - before) / workers
    del built
    state = len(algo.init_state(torch.zeros(flat.numel), job.hp))
    return {
        "model": model,
        "measured": grown,
        "estimate": memory.per_worker("sim", flat.numel, state, len(job.data.train_y)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--wait", type=float, default=25.0, help="seconds before the workers are measured")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="mnist_cnn only, 10 virtual workers: to check that the script runs (tests/test_benchmarks.py)",
    )
    ap.add_argument(
        "--startup",
        type=int,
        nargs="+",
        metavar="N",
        help="measure the start-up and memory of runs with these numbers of workers instead",
    )
    args = ap.parse_args()
    if args.startup:
        startup(args.startup)
        return
    mb = 2**20
    if args.smoke:
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")
    print("engine=process, GEM: per worker process (median over the workers)")
    print(f"{'model':<15}{'USS MB':>9}{'RSS MB':>9}{'estimate MB':>13}{'estimate/USS':>14}")
    cases = CASES[:1] if args.smoke else CASES
    for model, data in cases:
        r = process_case(model, data, args.workers, args.wait)
        print(
            f"{r['model']:<15}{r['uss'] / mb:>9.0f}{r['rss'] / mb:>9.0f}{r['estimate'] / mb:>13.0f}"
            f"{r['estimate'] / r['uss']:>14.2f}"
        )
    virtual = 10 if args.smoke else 200
    print(f"engine=sim, GEM: per virtual worker (RSS growth over {virtual} workers)")
    print(f"{'model':<15}{'measured MB':>13}{'estimate MB':>13}{'estimate/measured':>19}")
    for model, data in cases:
        r = sim_case(model, data, virtual)
        # no growth measured: the process reused memory it had freed before (run the script in a fresh process)
        ratio = f"{r['estimate'] / r['measured']:.2f}" if r["measured"] > 0 else "not measured"
        print(f"{r['model']:<15}{r['measured'] / mb:>13.2f}{r['estimate'] / mb:>13.2f}{ratio:>19}")


if __name__ == "__main__":
    main()
