"""Data loading benchmark: in-memory tensors vs a torchvision DataLoader, side by side.

One MNIST epoch of `mnist_cnn` training (batch 64, SGD lr 0.05 momentum 0.9, forward + backward + step) is
fed in two ways:

  (A) ours: `gem.data.load_mnist` puts the normalised training set in memory once, and batches are drawn by
      index with `gem.data.WorkerStream` and `Dataset.batch(idx)`: one tensor gather per batch;
  (B) the conventional way: `torchvision.datasets.MNIST` with ToTensor + Normalize, read through
      `torch.utils.data.DataLoader(batch_size=64, shuffle=True, drop_last=True)`: per sample, a PIL image is
      built, converted and normalised, then the samples are collated. Run with num_workers=0, and with
      num_workers=2 when worker processes work on this machine.

Each feed is timed twice per round: the data alone (iterate one epoch of batches, no model), which isolates
the loader, and one epoch of training. Variants are interleaved and their order rotates every round, so that
drift on the machine (thermal, other processes, caches) hits all of them alike; the headline is the median
over rounds of each round's ratio (DataLoader time / tensor time), never a lone absolute time, since
absolute times say more about the machine than about the loader.

    python benchmarks/data_loading.py --root ../shared/data [--rounds 3]

`--smoke` feeds the first 640 training images only (10 batches), to check that the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# Imported up front, although only feed (B) uses them directly: importing torchvision takes seconds, and
# load_mnist would otherwise pay for it inside its setup time.
from torchvision import datasets, transforms

from gem.data import MNIST_MEAN, MNIST_STD, WorkerStream, load_mnist
from gem.models import build_model

BATCH_SIZE = 64
LR, MOMENTUM = 0.05, 0.9
SEED = 0


# ------------------------------------------------------------------------------------------------ feeds
# A feed is a zero-argument function that returns a fresh iterable over one epoch of (x, y) batches.
# Building the iterator is inside the timed region, because that is where a DataLoader with workers
# starts its processes, a cost every epoch pays with the default persistent_workers=False.


def tensor_feed(root: str, limit: int | None = None):
    """(A) The whole training set (or its first `limit` images) as one normalised tensor; batches gathered by
    index."""
    data = load_mnist(root)
    if limit is not None:
        data = dataclasses.replace(data, train_x=data.train_x[:limit], train_y=data.train_y[:limit])

    def epoch():
        stream = WorkerStream(len(data.train_y), BATCH_SIZE, seed=SEED, worker=0)
        for _ in range(stream.batches_per_epoch):
            yield data.batch(stream.next_indices(), stream.generator)

    return epoch, data


def dataloader_feed(root: str, num_workers: int, limit: int | None = None):
    """(B) torchvision's MNIST (or its first `limit` images) with PIL per-sample transforms, through a
    DataLoader."""
    dataset = datasets.MNIST(
        root,
        train=True,
        download=False,
        transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))]),
    )
    if limit is not None:
        dataset = torch.utils.data.Subset(dataset, range(limit))
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=BATCH_SIZE,
        shuffle=True,
        drop_last=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(SEED),
    )

    def epoch():
        return iter(loader)

    return epoch, dataset


# ------------------------------------------------------------------------------------------- measurements


def time_data_only(epoch) -> tuple[float, int]:
    """Seconds to iterate one epoch of batches, touching each batch so that nothing is left lazy."""
    t0 = time.perf_counter()
    n = 0
    for x, _ in epoch():
        n += x.shape[0]
    return time.perf_counter() - t0, n


def time_training(epoch, init_state: dict) -> tuple[float, int]:
    """Seconds for one epoch of training, from the same initial weights for every variant."""
    torch.manual_seed(SEED)  # dropout masks: the same random stream for every variant
    model = build_model("mnist_cnn")
    model.load_state_dict(init_state)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    t0 = time.perf_counter()
    n = 0
    for x, y in epoch():
        opt.zero_grad(set_to_none=True)
        F.nll_loss(model(x), y).backward()
        opt.step()
        n += x.shape[0]
    return time.perf_counter() - t0, n


def check_same_inputs(data, dataset) -> None:
    """Both feeds must give the model the same numbers, or the comparison would be unfair."""
    x, y = dataset[0]
    if not (torch.allclose(x, data.train_x[0], atol=1e-5) and y == int(data.train_y[0])):
        sys.exit("the two feeds disagree on training example 0; the benchmark would compare different inputs")


def dataloader_workers_ok(root: str, num_workers: int, limit: int | None = None) -> str | None:
    """None if a DataLoader with worker processes runs here, else why not (then that variant is skipped)."""
    try:
        epoch, _ = dataloader_feed(root, num_workers, limit)
        next(iter(epoch()))
        return None
    except (RuntimeError, OSError) as e:  # e.g. no /dev/shm, or no new processes allowed in a sandbox
        return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="folder holding MNIST/raw/ (torchvision layout)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in the training process, the same for every variant",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the first 640 training images only, to check that the "
        "script runs (tests/test_benchmarks.py): its numbers mean nothing",
    )
    args = p.parse_args()
    limit = 10 * BATCH_SIZE if args.smoke else None
    if args.smoke:
        print("--smoke: tiny sizes, to check that the script runs; its numbers mean nothing")

    raw = os.path.join(args.root, "MNIST", "raw")
    if not os.path.isdir(raw):
        sys.exit(
            f"MNIST not found: expected the IDX files in {os.path.abspath(raw)} "
            f"(pass --root pointing at the folder that contains MNIST/raw/)"
        )

    # One setting for every variant, and 1 by default, for two reasons. On 2 cores, DataLoader workers need
    # cores of their own: an intra-op pool as wide as the machine would be oversubscribed by them, which
    # penalises the num_workers=2 variant. And OpenMP's pool waits at a barrier for its slowest thread, so
    # whenever another process takes a core, a 2-thread step stalls (measured here on a shared machine:
    # 1 thread 0.7-1.0 s per epoch, 2 threads 2.9-10 s). DataLoader workers use 1 thread each (PyTorch
    # sets that itself).
    torch.set_num_threads(args.threads)

    # Setup (reading the files) is a one-time cost, not part of an epoch; it is shown as secondary info.
    t0 = time.perf_counter()
    tensor_epoch, data = tensor_feed(args.root, limit)
    setup_tensor = time.perf_counter() - t0
    t0 = time.perf_counter()
    dl0_epoch, dataset = dataloader_feed(args.root, num_workers=0, limit=limit)
    setup_dl = time.perf_counter() - t0
    check_same_inputs(data, dataset)

    variants = {"tensors + WorkerStream (A)": tensor_epoch, "DataLoader, num_workers=0 (B)": dl0_epoch}
    why_not = dataloader_workers_ok(args.root, 2, limit)
    if why_not is None:
        variants["DataLoader, num_workers=2 (B)"] = dataloader_feed(args.root, num_workers=2, limit=limit)[0]
    names = list(variants)
    baseline = names[0]

    torch.manual_seed(SEED)
    init_state = {k: v.clone() for k, v in build_model("mnist_cnn").state_dict().items()}

    # Warm-up, not counted: the first epoch pays one-off costs (oneDNN kernel selection, page faults,
    # first PIL import paths) that would otherwise land on whichever variant happens to run first.
    for name in names:
        time_data_only(variants[name])
        time_training(variants[name], init_state)

    times = {name: {"data": [], "train": []} for name in names}
    expected = (len(data.train_y) // BATCH_SIZE) * BATCH_SIZE
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate so no variant always goes first
        # Kind outermost: the measurements that a ratio pairs run back to back, close together in time.
        for kind in ("data", "train"):
            for name in order:
                gc.collect()
                if kind == "data":
                    s, n = time_data_only(variants[name])
                else:
                    s, n = time_training(variants[name], init_state)
                assert n == expected, f"{name} fed {n} examples, expected {expected}"
                times[name][kind].append(s)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    load_after = os.getloadavg()[0]

    def ratio(name, kind):
        # Ratio within each round (the paired, side-by-side measurement), then the median over rounds.
        rs = [a / b for a, b in zip(times[name][kind], times[baseline][kind], strict=True)]
        return statistics.median(rs), min(rs), max(rs)

    print(
        f"\nMNIST train: {len(data.train_y)} images, {expected // BATCH_SIZE} batches of {BATCH_SIZE} per "
        f"epoch; torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
        f"{args.rounds} rounds (median; ratio range in brackets)\n"
    )
    print("| feed | training ratio | data-only ratio | training s | data-only s |")
    print("|---|---|---|---|---|")
    for name in names:
        cells = []
        for kind in ("train", "data"):
            med, lo, hi = ratio(name, kind)
            cells.append(f"**{med:.2f}x** [{lo:.2f}-{hi:.2f}]" if name != baseline else "1.00x")
        abs_cells = [f"{statistics.median(times[name][k]):.3f}" for k in ("train", "data")]
        print(f"| {name} | {cells[0]} | {cells[1]} | {abs_cells[0]} | {abs_cells[1]} |")
    print(
        f"\nratio = variant time / tensor time for the same epoch (higher: the tensor path is faster). "
        f"One-time setup (not in the table): load_mnist {setup_tensor:.2f} s, "
        f"torchvision MNIST dataset {setup_dl:.2f} s."
    )
    # Other processes on the machine make every number noisier; say how busy it was.
    print(
        f"Load average (1 min) before / after the timed rounds: {load_before:.2f} / {load_after:.2f} "
        f"on {os.cpu_count()} cores."
    )
    if why_not is not None:
        print(f"DataLoader with num_workers=2 skipped: {why_not}")


if __name__ == "__main__":  # required: DataLoader worker processes may re-import this module
    main()
