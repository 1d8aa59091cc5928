"""GPU workers of the `process` engine, ratios measured side by side in one run.

1. One worker: AlexNet-CIFAR worker steps per second of `engine=process` with one worker on the device
   (`downpour`, b = 64: a commit after every gradient), divided by the steps per second of a plain training loop
   on the same device (`torch.optim.SGD` with momentum, same model, batch and in-memory batches). Target: at
   least 0.9. Twice: (a) θ on the workers' GPU, shared by CUDA IPC (`engine.theta_on_gpu=true`, the default on
   one GPU), and (b) θ in shared host memory, staged on the GPU at each commit (`theta_on_gpu=false`), which the
   worker page-locks where it lies (gem/engines/pinned.py).
2. Sharing: aggregate worker steps per second of 4 `process` workers on one device over 1 worker, θ on the GPU.
3. bf16: the plain loop under `torch.autocast(bfloat16)` over the plain loop in float32.
4. The physical limit of θ in host memory, as it was before workers page-locked it: a `downpour` commit of a GPU
   worker moves θ host to device (the staged view), its commit device to host, and θ host to device again (the
   pull), 3 × 4 bytes per parameter, over the copy speed measured here between pageable shared host memory and
   the device. The limit is the plain loop's step time over that step time plus the copies: what a worker could
   reach if the server's step and the turn cost nothing.
5. The `distributed` engine's GPU workers: aggregate steps per second of a local launch with 4 workers on the device
   over 4 `process` workers, both with θ on the GPU (rank 0 hands it to its workers by CUDA IPC, as `process`
   does: `engine.theta_on_gpu`), and both with θ in host memory (`theta_on_gpu=false`: rank 0's shared-memory
   window, and `process`'s shared host memory).
6. The physical limit of 1b.: the copies of 4. from shared host memory registered with CUDA (`cudaHostRegister`,
   page-locked) as a worker now registers θ, over the same copies from pageable memory, and 4.'s limit with them.

The engine is timed between its first and last commit rows (`time_s`), so start-up and CUDA initialisation are
left out. Runs on the CPU as well (`--device cpu`), which only checks that the script works: the numbers that
matter need a GPU.

    python benchmarks/gpu.py --device cuda [--steps 300]

`--smoke` uses 16 synthetic images in batches of 4, to check that the script runs (on the CPU as well).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from process_engine import BATCH_SIZE, MOMENTUM, SEED, engine_run  # noqa: E402

from gem.data import WorkerStream, make_synthetic  # noqa: E402
from gem.engines import distributed, process  # noqa: E402
from gem.engines.pinned import Pinned  # noqa: E402
from gem.models import build_model  # noqa: E402

LR = 0.01  # Fig. 7's η: 4 AlexNet workers diverge at the MNIST benchmarks' 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_steps_per_s(data, device: torch.device, steps: int, bf16: bool = False, batch: int = BATCH_SIZE) -> float:
    torch.manual_seed(SEED)
    model = build_model("alexnet_cifar", num_classes=data.num_classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    stream = WorkerStream(len(data.train_y), batch, seed=SEED, worker=0)
    warm = min(10, steps)
    t0 = None
    for i in range(steps + warm):
        if i == warm:  # after warm-up (cuDNN autotuning, allocator)
            _sync(device)
            t0 = time.perf_counter()
        x, y = data.batch(stream.next_indices(), stream.generator)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        F.nll_loss(out.float(), y).backward()
        opt.step()
    _sync(device)
    return steps / (time.perf_counter() - t0)


def copy_seconds(numel: int, device: torch.device, repeats: int = 20, pinned: bool = False) -> tuple[float, float]:
    """Seconds of one host-to-device and one device-to-host copy of `numel` float32, from shared host memory as θ
    is: pageable, or (`pinned`) page-locked where it lies as a GPU worker page-locks θ (gem.engines.pinned)."""
    host, dev = torch.randn(numel).share_memory_(), torch.empty(numel, device=device)
    locked = Pinned(device, "benchmarks/gpu.py") if pinned else None  # held, and so registered, while timed
    if locked is not None:
        locked.host({"θ": host})
        if locked.failed:
            raise RuntimeError("θ's shared memory could not be page-locked (said above)")
    times = []
    for copy in (lambda: dev.copy_(host), lambda: host.copy_(dev)):
        copy()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            copy()
        _sync(device)
        times.append((time.perf_counter() - t0) / repeats)
    return times[0], times[1]


def engine_steps_per_s(
    data, device: str, workers: int, steps: int, batch: int = BATCH_SIZE, theta_on_gpu: bool = True, engine=process
) -> float:
    epochs = max(1, -(-steps * batch // len(data.train_y)))
    options = {"theta_on_gpu": theta_on_gpu, **({} if engine is process else {"timeout_s": 120})}
    m, result = engine_run(
        data,
        "downpour",
        workers,
        epochs,
        model="alexnet_cifar",
        device=device,
        lr=LR,
        batch_size=batch,
        options=options,
        with_result=True,
        engine=engine,
    )
    m = m[m["step"] > min(10 * workers, len(m) // 2)]  # warm-up
    rate = (len(m) - 1) / (m["time_s"].iloc[-1] - m["time_s"].iloc[0])
    # apply_s times the server step as queued: on a GPU it is the kernels' launch, not their run
    where = result.extra.get("central_device", "cpu")
    name = engine.__name__.rsplit(".", 1)[-1]
    print(
        f"   {name}, {workers} worker(s), θ on {where}: {rate:.1f} steps/s; the server's step "
        f"(apply_s) {1e3 * m['apply_s'].mean():.2f} ms a commit, {100 * m['apply_s'].sum() * rate / len(m):.0f}% "
        "of the time"
    )
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny dataset and batch, to check that the script runs "
        "(tests/test_benchmarks.py, on CPU): its numbers mean nothing",
    )
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    if args.smoke:
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")
    data = make_synthetic(shape=(3, 32, 32), train_size=16 if args.smoke else 4096, val_size=8 if args.smoke else 64)
    batch = 4 if args.smoke else BATCH_SIZE
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"alexnet_cifar, b={batch}"
    )
    plain = plain_steps_per_s(data, device, args.steps, batch=batch)
    one = engine_steps_per_s(data, str(device), 1, args.steps, batch)
    # on the CPU θ lies in host memory either way: the θ-in-host-memory runs below would repeat the runs above
    cpu = device.type != "cuda"
    if cpu:
        print("   (on the CPU, θ is in host memory either way: each run with theta_on_gpu=false is its run with true)")
    one_host = one if cpu else engine_steps_per_s(data, str(device), 1, args.steps, batch, theta_on_gpu=False)
    plain_after = plain_steps_per_s(data, device, args.steps, batch=batch)
    reference = (plain + plain_after) / 2
    print(
        f"1a. one process worker, θ on the worker's device / plain loop: {one / reference:.3f}  "
        f"(plain {plain:.1f} and {plain_after:.1f} steps/s before and after)"
    )
    print(f"1b. one process worker, θ in shared host memory, page-locked / plain loop: {one_host / reference:.3f}")
    sharing = 2 if args.smoke else 4  # --smoke: two are enough to run the part
    four = engine_steps_per_s(data, str(device), sharing, args.steps, batch)
    print(f"2. {sharing} process workers on one device / 1 worker: {four / one:.3f}")
    bf16 = plain_steps_per_s(data, device, args.steps, bf16=True, batch=batch)
    print(f"3. plain loop bf16 / fp32: {bf16 / plain_after:.3f}")
    numel = sum(p.numel() for p in build_model("alexnet_cifar", num_classes=data.num_classes).parameters())
    down, up = copy_seconds(numel, device)
    moved = 2 * down + up
    step = 1 / reference
    print(
        f"4. physical limit of θ in pageable host memory (plain step / (plain step + copies of a commit)): "
        f"{step / (step + moved):.3f}  "
        f"({3 * 4 * numel / 1e6:.0f} MB a commit; host to device {4 * numel / down / 1e9:.1f} GB/s, device to "
        f"host {4 * numel / up / 1e9:.1f} GB/s; plain step {1e3 * step:.2f} ms, copies {1e3 * moved:.2f} ms)"
    )
    four_host = four if cpu else engine_steps_per_s(data, str(device), sharing, args.steps, batch, theta_on_gpu=False)
    four_distributed = engine_steps_per_s(data, str(device), sharing, args.steps, batch, engine=distributed)
    four_distributed_host = (
        four_distributed
        if cpu
        else engine_steps_per_s(data, str(device), sharing, args.steps, batch, theta_on_gpu=False, engine=distributed)
    )
    print(
        f"5. distributed / process, {sharing} workers on one device, θ on the device for both: "
        f"{four_distributed / four:.3f}; θ in host memory for both: {four_distributed_host / four_host:.3f}"
    )
    if device.type == "cuda":
        pinned_down, pinned_up = copy_seconds(numel, device, pinned=True)
        pinned = 2 * pinned_down + pinned_up
        print(
            f"6. physical limit of 1b. (θ page-locked): {step / (step + pinned):.3f}  (its copies take "
            f"{pinned / moved:.3f} of the pageable ones' time: host to device {4 * numel / pinned_down / 1e9:.1f} "
            f"GB/s, device to host {4 * numel / pinned_up / 1e9:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()
