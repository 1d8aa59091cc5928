"""How much memory a run needs at least, checked against what the machine has before anything starts.

A `process` (or locally launched `distributed`) worker is a Python process forked from a forkserver that has
imported torch and gem (gem.engines.preload): it shares their pages, and its own memory (USS: pages no other
process shares) is what it computes with. Both were measured by `python -m benchmarks.worker_memory`, which reads
/proc/<pid>/smaps_rollup of every process of a real run (BENCHMARKS.md). A worker's measured base is
`WORKER_PROCESS_BYTES`, to which it adds its model's parameters, their gradient and the algorithm's per-worker
tensors (activations come on top, so this is a lower bound: a refusal never stops a run that would fit); the
forkserver's own memory, `FORKSERVER_BYTES`, is paid once.

A `sim` virtual worker is its local copy of θ plus the algorithm's per-worker tensors plus its data stream's
permutation of the training set (measured: 1.90 MB per GEM worker on mnist_cnn, 1.88 MB predicted).
"""

from __future__ import annotations

import os

# USS of a worker process before its model: 24 MB measured on mnist_cnn/digits (torch 2.14, Linux x86-64; 26.8 MB
# less its 2.6 MB of model tensors); a worker started by spawn, which imports torch itself, held 340 MB. The
# forkserver, which holds torch, gem and GEM's compiled loops once for all workers: 123 MB. See BENCHMARKS.md
# "Memory per worker" and "100 worker processes on 2 cores"
WORKER_PROCESS_BYTES = 24 * 2**20
FORKSERVER_BYTES = 120 * 2**20
SIM_WORKER_BYTES = 16 * 2**10  # a virtual worker's Python objects and random generator
FLOAT = 4


def per_worker(engine: str, params: int, state_tensors: int, train_size: int) -> int:
    """Bytes one worker needs at least on `engine`."""
    if engine == "sim":
        return (1 + state_tensors) * params * FLOAT + 8 * train_size + SIM_WORKER_BYTES
    return WORKER_PROCESS_BYTES + (2 + state_tensors) * params * FLOAT  # θ's local copy, ∇, the rule's state


def once(engine: str) -> int:
    """Bytes a run on `engine` needs once, whatever its workers: the forkserver of an engine with real processes."""
    return 0 if engine == "sim" else FORKSERVER_BYTES


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
