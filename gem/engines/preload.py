"""What every worker process needs, imported once by the forkserver that worker processes are forked from.

Only the forkserver imports this module (gem.engines.worker.worker_context names it as the forkserver's preload).
A worker forked from a process that has imported torch shares torch's pages with it and with every other worker,
copy on write: its own memory is what it computes with, about 27 MB for `mnist_cnn` instead of about 340 MB for a
process that imports torch itself (BENCHMARKS.md, "Lean worker processes"); and it starts in a fraction of a
second.

A process must not fork while it runs other threads: the child gets a copy of every lock those threads held, and
no thread to release them. So nothing imported here may start a thread:

- numpy's OpenBLAS starts a pool of threads when it is loaded, unless told to use one: the workers do their
  linear algebra in torch, with the threads `setup_process` gives them, and use numpy and GEM's numba loops
  (which start no threads: they are not `parallel`) only for GEM's commit and π's statistics;
- nothing here imports pyarrow, whose allocator starts a background thread (run-directory files are the
  coordinator's business, gem.metrics);
- nothing here computes with torch beyond a few numbers (GEM's `warm`), below the size at which its thread pools
  start.

The forkserver checks its own threads once its imports are done, and says so on stderr if any were started (a
worker forked from it could then hang), rather than failing every run.
"""

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy is loaded, by torch or by gem

import gc  # noqa: E402
import sys  # noqa: E402

import numpy  # noqa: E402, F401
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401

import gem.engines.distributed  # noqa: E402, F401
import gem.engines.process  # noqa: E402, F401
from gem import algorithms  # noqa: E402

for _name in algorithms.ALGORITHMS:
    algorithms.get(_name)
from gem.algorithms import gem as _gem  # noqa: E402

_gem.warm()  # GEM's fused loops, compiled (or loaded from numba's cache) once, here, rather than in every worker
# torchvision (1.5 s to import, most of a run's start-up) is preloaded as a module of its own, only for a job whose
# model needs it (gem.engines.worker.worker_context)


def threads() -> int:
    """This process's threads, as the OS counts them (1 where it cannot say)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


if threads() > 1:
    print(
        f"gem: warning: the forkserver that starts worker processes runs {threads()} threads after its imports; "
        "a worker forked from it may hang (report this with your platform)",
        file=sys.stderr,
        flush=True,
    )

# Every object imported so far lives as long as the forkserver: keep the collector from ever visiting them in a
# worker, where touching their headers would copy the pages they live on into the worker's own memory.
gc.freeze()
