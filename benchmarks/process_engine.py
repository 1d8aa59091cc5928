"""The `process` engine, ratios measured side by side in one run.

1. Throughput: aggregate worker steps per second of `engine=process` with n workers (`gem` and `downpour`,
   `mnist_cnn`, b = 64), divided by the steps per second of plain sequential single-thread SGD
   (`torch.optim.SGD`, 1 torch thread, same model, batch and in-memory batches). The engine is timed between its
   first and last commit rows (`time_s`), so start-up and the evaluations of the central variable are left
   out; each worker runs floor(cores / n) torch threads. The reference is timed before and after each engine
   run, and their mean is used. The ideal: n independent sequential 1-thread processes started together behind
   a barrier, no communication at all. Windowed algorithms: `agn` (λ = 10) and `easgd` (λ = 4) worker steps per
   second over `downpour`'s at the same n, run one after the other in each round.
2. Parameter-server apply: the server rule θ ← θ + Δ for `alexnet_cifar` (7.5M parameters) as the engine runs
   it, θ in shared memory under the server's turn (`apply_s` of each commit), divided by a plain in-memory
   `θ.add_(Δ)` of the same size in this process. Also the whole turn (`wait_s` excluded): see BENCHMARKS.md.
3. Start-up: wall time from launching `python run.py` (GEM, 4 workers, digits) until its first commit is on
   disk, divided by the wall time of `python -c "import torch"`, the floor any PyTorch command pays.

    python benchmarks/process_engine.py --root ../shared/data [--rounds 3] [--workers 2 4]

`--smoke` runs every part at tiny sizes (digits, 10 reference steps, downpour and agn only, one start-up), to check
that the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gem import algorithms
from gem.data import WorkerStream, load_dataset, make_synthetic
from gem.engines import Job, process
from gem.engines.worker import threads_per_process
from gem.metrics import Recorder, read_table
from gem.models import build_model

ROOT = Path(__file__).resolve().parent.parent
BATCH_SIZE, LR, MOMENTUM, SEED = 64, 0.05, 0.9, 0
ALEXNET_LR = 0.005


def sequential_steps_per_s(data, steps: int = 150) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        model = build_model("mnist_cnn", num_classes=data.num_classes)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        stream = WorkerStream(len(data.train_y), BATCH_SIZE, seed=SEED, worker=0)
        t0 = None
        for i in range(steps + 1):
            if i == 1:
                t0 = time.perf_counter()
            x, y = data.batch(stream.next_indices(), stream.generator)
            opt.zero_grad(set_to_none=False)
            F.nll_loss(model(x), y).backward()
            opt.step()
        return steps / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def _independent(root: str, barrier, q, steps: int, name: str = "mnist") -> None:
    torch.set_num_threads(1)
    try:
        data = load_dataset(name, root, download=False)
    except Exception:  # noqa: BLE001
        data = load_dataset("digits", root, download=False)
    sequential_steps_per_s(data, 5)  # warm up
    barrier.wait()
    t0 = time.perf_counter()
    sequential_steps_per_s(data, steps)
    q.put((t0, time.perf_counter()))


def ideal(root: str, k: int, steps: int = 300, name: str = "mnist") -> float:
    """Aggregate steps/s of k independent sequential 1-thread processes started together: what the cores
    allow with no communication at all, timed from the first start to the last end, as an engine run is."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(k)
    procs = [ctx.Process(target=_independent, args=(root, barrier, q, steps, name)) for _ in range(k)]
    for p in procs:
        p.start()
    spans = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    return k * steps / (max(e for _, e in spans) - min(s for s, _ in spans))


def engine_run(
    data,
    name: str,
    workers: int,
    epochs: int,
    model: str = "mnist_cnn",
    batch_size: int = BATCH_SIZE,
    engine=process,
    options: dict | None = None,
    with_result=False,
    device: str = "cpu",
    lr: float = LR,
):
    params = algorithms.get(name).Params
    hp = params(
        lr=lr, momentum=MOMENTUM, **({"workers": workers} if "workers" in params.__dataclass_fields__ else {})
    )  # agn's and easgd's own default windows: 10 and 4
    job = Job(
        algorithm=name,
        hp=hp,
        model=model,
        data=data,
        workers=workers,
        batch_size=batch_size,
        epochs=epochs,
        seed=SEED,
        eval_every=10**9,
        eval_train_size=64,
        engine={"name": engine.__name__.rsplit(".", 1)[-1], **(options or {})},  # the module's own options
        device=device,
    )
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d)
        result = engine.run(job, rec)
        rec.close()
        m = read_table(d)
    assert result.status == "completed", result
    return (m, result) if with_result else m


def throughput(data, name, workers, epochs, engine=process, options=None) -> tuple[float, float]:
    """(whole run, while all workers run) aggregate worker steps per second, from the first to the last commit
    row. Each worker has the same budget, but the OS does not share the cores exactly evenly, so the last
    workers finish alone: the second figure leaves that tail out."""
    m = engine_run(data, name, workers, epochs, engine=engine, options=options)
    t = m["time_s"]
    span = m["worker_step"] - m.groupby("worker")["worker_step"].shift().fillna(0)  # λ steps per windowed commit
    whole = span.iloc[1:].sum() / (t.iloc[-1] - t.iloc[0])
    full = m.index[t <= m.groupby("worker")["time_s"].max().min()]
    return whole, span[full[1:]].sum() / (t[full[-1]] - t[full[0]])


def startup_ratio(tmp: Path) -> tuple[float, float, float]:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    floor = time.perf_counter() - t
    d = tmp / f"run-{time.time_ns()}"
    t = time.perf_counter()
    p = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "logger.wandb.mode=disabled",
            "logger.flush_every=1",
            "logger.progress=false",
            f"hydra.run.dir={d}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not (d / "metrics.parts").exists():
            if p.poll() is not None or time.perf_counter() - t > 300:
                raise RuntimeError("python run.py did not commit")
            time.sleep(0.01)
        first = time.perf_counter() - t
    finally:
        p.kill()
        p.wait()
    return first / floor, first, floor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="../shared/data")
    ap.add_argument("--workers", type=int, nargs="+", default=[4])
    ap.add_argument(
        "--epochs",
        type=int,
        default=8,
        help="passes over the data per worker (long enough that start-up and the initial evaluation do not dominate)",
    )
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
    if args.smoke:
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")
    print(
        f"data={name} ({len(data.train_y)} train), mnist_cnn, b={BATCH_SIZE}, torch {torch.__version__}, "
        f"{threads_per_process(1)} cores"
    )

    # 1. throughput, and the windowed algorithms against downpour
    ratios: dict[tuple[str, int], list[float]] = {}
    windowed: dict[tuple[str, int], list[float]] = {}
    refs = []
    # --smoke: downpour and one windowed algorithm, enough for every table; each engine run starts its processes
    names = ("downpour", "agn") if args.smoke else ("gem", "downpour", "agn", "easgd")
    for r in range(args.rounds):
        for n in args.workers:
            rates = {}
            for name_ in names:
                before = sequential_steps_per_s(data, steps)
                rate, rate_full = rates[name_] = throughput(data, name_, n, args.epochs)
                after = sequential_steps_per_s(data, steps)
                ref = (before + after) / 2
                refs.append(ref)
                ratios.setdefault((name_, n), []).append(rate / ref)
                ratios.setdefault((name_ + ", while all workers run", n), []).append(rate_full / ref)
                print(
                    f"round {r + 1}: {name_} n={n}: {rate:.1f} worker steps/s ({rate_full:.1f} while all run), "
                    f"sequential 1 thread {ref:.1f} steps/s: {rate / ref:.2f}x ({rate_full / ref:.2f}x)",
                    flush=True,
                )
            for name_ in (x for x in names if x != "downpour"):
                windowed.setdefault((name_, n), []).append(rates[name_][0] / rates["downpour"][0])
            before = sequential_steps_per_s(data, steps)
            rate = ideal(args.root, n, 2 * steps, name)
            after = sequential_steps_per_s(data, steps)
            ratios.setdefault(("ideal: independent sequential processes", n), []).append(rate / ((before + after) / 2))
    print(
        f"\n| engine=process | aggregate worker steps/s / sequential 1-thread SGD steps/s "
        f"(median [range] over {args.rounds} rounds) |"
    )
    print("|---|---|")
    for (name_, n), rs in ratios.items():
        print(
            f"| {name_}, n={n} ({threads_per_process(n)} thread(s) each) | **{statistics.median(rs):.2f}x** "
            f"[{min(rs):.2f}-{max(rs):.2f}] |"
        )
    print(f"(sequential reference: median {statistics.median(refs):.1f} steps/s)")
    print("\n| algorithm | worker steps/s over downpour's, same n, same round |\n|---|---|")
    for (name_, n), rs in windowed.items():
        window = algorithms.get(name_).commit_every(algorithms.get(name_).Params())
        print(
            f"| {name_} ({f'window {window}' if window > 1 else 'with its statistics on every commit'}), n={n} | "
            f"**{statistics.median(rs):.2f}x** [{min(rs):.2f}-{max(rs):.2f}] |"
        )

    # 2. parameter-server apply, alexnet_cifar
    syn = make_synthetic((3, 32, 32), num_classes=10, train_size=64, val_size=16, seed=0)
    # η = 0.005: AlexNet with He initialisation diverges at the MNIST CNN's 0.05
    m = engine_run(
        syn, "downpour", 2, epochs=1 if args.smoke else 8, model="alexnet_cifar", batch_size=16, lr=ALEXNET_LR
    )
    numel = sum(p.numel() for p in build_model("alexnet_cifar").parameters())
    theta, delta = torch.zeros(numel), torch.full((numel,), 1e-3)
    for _ in range(3):
        theta.add_(delta)
    plain = []
    for _ in range(20):
        t = time.perf_counter()
        theta.add_(delta)
        plain.append(time.perf_counter() - t)
    apply_s = m["apply_s"].iloc[2:]
    print(
        f"\nalexnet_cifar ({numel:,} parameters): engine apply median {apply_s.median() * 1e3:.2f} ms over "
        f"{len(apply_s)} commits, plain theta.add_(delta) median {statistics.median(plain) * 1e3:.2f} ms: "
        f"**{apply_s.median() / statistics.median(plain):.2f}x**"
    )

    # 3. start-up
    with tempfile.TemporaryDirectory() as d:
        runs = [startup_ratio(Path(d)) for _ in range(1 if args.smoke else args.rounds)]
    rs = [r[0] for r in runs]
    print(
        f"\nstart-up: python run.py until its first commit, over python -c 'import torch': "
        f"**{statistics.median(rs):.2f}x** [{min(rs):.2f}-{max(rs):.2f}] "
        f"(median {statistics.median(r[1] for r in runs):.2f} s against "
        f"{statistics.median(r[2] for r in runs):.2f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
