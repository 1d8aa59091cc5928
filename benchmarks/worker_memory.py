"""Memory per worker (issue 14): what the up-front check in `experiments.config` assumes, against what a real
run's workers hold, side by side.

For each model, `python run.py engine=process workers=N` runs until its workers have taken steps; then every
worker process's USS (its private pages: Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup; the shared
libraries are counted once, in the coordinator) and RSS are read, and compared with `gem.engines.memory`'s
estimate for that model. The estimate is meant as a lower bound (activations are not in it): estimate / USS
at most 1. For `sim`, the growth of the process's RSS when N virtual workers are built, per worker, against the
estimate.

    python -m benchmarks.worker_memory [--workers 2] [--wait 25]
"""

from __future__ import annotations

import argparse
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
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "rss": fields["Rss"]}


def worker_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")]


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
        p = subprocess.Popen([sys.executable, "run.py", *overrides, "logger.wandb.mode=disabled",
                              f"hydra.run.dir={tmp}/run"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        try:
            time.sleep(wait)
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
    from experiments.runner import build_job
    from gem import algorithms
    from gem.engines import memory
    from gem.engines.core import build_flat_model
    from gem.engines.worker import Worker

    cfg, checked = check_job(["engine=sim", f"workers={workers}", f"model={model}", f"data={data}"])
    job = build_job(cfg, checked, log=lambda *a: None)
    algo = algorithms.get(job.algorithm)
    flat = build_flat_model(job)

    def rss() -> int:
        return smaps(int(Path("/proc/self").resolve().name))["rss"]

    before = rss()
    built = [Worker(w, job, algo, flat, x=flat.param.clone()) for w in range(workers)]
    grown = (rss() - before) / workers
    del built
    state = len(algo.init_state(torch.zeros(flat.numel), job.hp))
    return {"model": model, "measured": grown,
            "estimate": memory.per_worker("sim", flat.numel, state, len(job.data.train_y))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--wait", type=float, default=25.0, help="seconds before the workers are measured")
    args = ap.parse_args()
    mb = 2**20
    print("engine=process, GEM: per worker process (median over the workers)")
    print(f"{'model':<15}{'USS MB':>9}{'RSS MB':>9}{'estimate MB':>13}{'estimate/USS':>14}")
    for model, data in CASES:
        r = process_case(model, data, args.workers, args.wait)
        print(f"{r['model']:<15}{r['uss'] / mb:>9.0f}{r['rss'] / mb:>9.0f}{r['estimate'] / mb:>13.0f}"
              f"{r['estimate'] / r['uss']:>14.2f}")
    print("engine=sim, GEM: per virtual worker (RSS growth over 200 workers)")
    print(f"{'model':<15}{'measured MB':>13}{'estimate MB':>13}{'estimate/measured':>19}")
    for model, data in CASES:
        r = sim_case(model, data, 200)
        print(f"{r['model']:<15}{r['measured'] / mb:>13.2f}{r['estimate'] / mb:>13.2f}"
              f"{r['estimate'] / r['measured']:>19.2f}")


if __name__ == "__main__":
    main()
