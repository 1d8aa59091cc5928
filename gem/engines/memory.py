"""How much memory a run needs at least, checked against what the machine has before anything starts.

A `process` (or locally launched `distributed`) worker is a Python process that has imported torch: its own
memory (USS: pages no other process shares; the shared libraries are counted once, in the coordinator) was
measured by `python -m benchmarks.worker_memory`, which reads /proc/<pid>/smaps_rollup of every worker of a
real run (BENCHMARKS.md). Its measured base is `WORKER_PROCESS_BYTES`, to which each worker adds its model's
parameters, their gradient and the algorithm's per-worker tensors (activations come on top, so this is a lower
bound: a refusal never stops a run that would fit).

A `sim` virtual worker is its local copy of θ plus the algorithm's per-worker tensors plus its data stream's
permutation of the training set (measured: 1.90 MB per GEM worker on mnist_cnn, 1.88 MB predicted).
"""

from __future__ import annotations

import os

# USS of a worker process before its model: 349 MB measured on mnist_cnn/digits (torch 2.15, Linux x86-64),
# less its 2.5 MB of model tensors; see BENCHMARKS.md "Memory per worker"
WORKER_PROCESS_BYTES = 340 * 2**20
SIM_WORKER_BYTES = 16 * 2**10  # a virtual worker's Python objects and random generator
FLOAT = 4


def per_worker(engine: str, params: int, state_tensors: int, train_size: int) -> int:
    """Bytes one worker needs at least on `engine`."""
    if engine == "sim":
        return (1 + state_tensors) * params * FLOAT + 8 * train_size + SIM_WORKER_BYTES
    return WORKER_PROCESS_BYTES + (2 + state_tensors) * params * FLOAT  # θ's local copy, ∇, the rule's state


def available() -> int | None:
    """Memory that can be had now without swapping (MemAvailable), or None where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GB"
    return f"{n / 2**20:.1f} MB" if n < 10 * 2**20 else f"{n / 2**20:.0f} MB"
