"""Small pieces every engine shares: building the model, devices, the step budget, evaluating the central
variable."""

from __future__ import annotations

import os
import sys
import time

import torch

from gem.data import Dataset
from gem.models import FlatModel, build_model


def build_flat_model(job, device=None) -> FlatModel:
    """The job's model with the seed's initialisation, as a FlatModel: the same θ₀ in every process (the model
    is initialised on the CPU, whose random stream does not depend on the device, and then moved)."""
    torch.manual_seed(job.seed)
    module = build_model(job.model, num_classes=job.data.num_classes)
    return FlatModel(module, device=device or resolve_device(job.device), loss=job.loss, precision=job.precision)


def resolve_device(device: str, index: int = 0) -> torch.device:
    """`cpu`, `cuda:N` as given; `cuda`: the visible GPUs in turn (the index-th modulo their number)."""
    if device == "cuda":
        return torch.device("cuda", index % max(1, torch.cuda.device_count()))
    return torch.device(device)


def device_of(job, worker: int) -> torch.device:
    """The device worker `worker` computes on: the one place that decides it. `device=cuda` spreads the workers
    over the visible GPUs (worker w on GPU w mod count; a torchrun rank by its local rank, which is where the
    launcher placed it); `cuda:N` pins every worker to GPU N. The sim engine's workers share one model: GPU 0."""
    if job.device == "cuda" and job.engine.name != "sim":
        local = os.environ.get("LOCAL_RANK")
        index = int(local) - 1 if local is not None and int(local) > 0 else worker
        return resolve_device("cuda", index)
    return resolve_device(job.device)


def cuda_ipc() -> bool:
    """Whether this platform shares GPU memory between processes (CUDA IPC): Linux, but not WSL2 and not a Jetson
    (NVIDIA's documentation for both); not Windows or macOS."""
    if not sys.platform.startswith("linux") or os.path.exists("/etc/nv_tegra_release"):
        return False
    try:
        with open("/proc/sys/kernel/osrelease") as f:
            return "microsoft" not in f.read().lower()
    except OSError:
        return True


def central_device(job) -> torch.device:
    """Where the `process` engine (and a local launch of `distributed`) keeps θ and the server's tensors. On the
    workers' GPU when every worker computes on one and the same GPU (and `engine.theta_on_gpu`, the default): the
    worker processes share them by CUDA IPC, so a commit moves nothing between host and GPU, and the turn's holder
    runs the server step there. Else in shared host memory, which every worker process maps, a GPU worker staging
    them on its device at its commits (Worker.staged): workers spread over several GPUs, on the CPU, or a platform
    without CUDA IPC (`cuda_ipc`)."""
    devices = {device_of(job, w) for w in range(job.workers)}
    if job.engine.theta_on_gpu and len(devices) == 1 and cuda_ipc():
        (device,) = devices
        if device.type == "cuda":
            return device
    return torch.device("cpu")


def worker_steps(job) -> int:
    """Local gradient steps per worker: `budget.worker_steps` where it is set, else `epochs` passes over the training
    split (the paper: one), rounded down to whole mini-batches: epochs=0.25 of full MNIST at b = 64 is 214 steps."""
    given = (getattr(job, "budget", None) or {}).get("worker_steps")
    if given:
        return int(given)
    return int(job.epochs * (len(job.data.train_y) // job.batch_size) + 1e-9)


def capped(job, t: int, now: float) -> bool:
    """Whether a cap of the job's budget has been reached, so that a worker takes no new gradient: the server's
    clock t has reached `budget.commits`, or `now` (seconds since the run started) `budget.seconds`. On `sim` the
    clock is exact (one cycle at a time); on the real engines the gradients in progress still commit, so a run ends
    a few commits past the cap (at most one per other worker; a window cut short by the cap commits nothing).
    `budget.sim_time` is the sim engine's own (gem.engines.sim)."""
    budget = getattr(job, "budget", None) or {}
    commits, seconds = budget.get("commits"), budget.get("seconds")
    return bool((commits and t >= commits) or (seconds and now >= seconds))


def stopped_by(job, t: int, now: float, sim_capped: bool = False, full: bool = False) -> str:
    """Which limit ended a completed run: the workers' own length (`budget.worker_steps` or `epochs`) when they
    all made every commit of it (`full`: a run that ends just before a cap was not stopped by it), else
    `budget.commits`, `budget.sim_time` or `budget.seconds`, whichever was reached."""
    budget = getattr(job, "budget", None) or {}
    own = "budget.worker_steps" if budget.get("worker_steps") else "epochs"
    if full:
        return own
    if budget.get("commits") and t >= budget["commits"]:
        return "budget.commits"
    if sim_capped:
        return "budget.sim_time"
    if budget.get("seconds") and now >= budget["seconds"]:
        return "budget.seconds"
    return own


def commits_per_worker(job, window: int) -> int:
    """A window cut short by the end of the budget commits nothing."""
    return worker_steps(job) // window


def finite(theta: torch.Tensor) -> bool:
    return bool(torch.isfinite(theta).all())


class Evaluator:
    """Evaluates the central variable on the validation split and on a fixed training subset.

    It has its own copy of the model, so evaluating never disturbs a worker's parameters, and it draws no random
    numbers (eval mode), so it never disturbs a worker's random streams either.

    A model with BatchNorm has its running statistics measured for θ on the same fixed training subset before
    every evaluation (FlatModel.recalibrate; gem.models says why buffers are not shared).
    """

    def __init__(self, job, data: Dataset):
        self.model = build_flat_model(job, device=device_of(job, 0))
        self.data = data
        self.batch_size = job.batch_size
        k = min(job.eval_train_size, len(data.train_y))
        idx = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(job.seed))[:k]
        idx = idx.to(data.train_x.device)  # the sim engine's data may be on a GPU
        self.train_x, self.train_y = data.train_x[idx], data.train_y[idx]

    def __call__(self, theta: torch.Tensor, step: int, t0: float, **extra) -> dict:
        # time_s is when θ was taken, not when its evaluation ended: on the real engines the workers go on committing
        # while it runs, and a time to a target read from this row must not include the evaluation's seconds
        stamp = time.perf_counter() - t0
        self.model.load(theta)
        self.model.recalibrate(self.train_x, self.batch_size)
        val_loss, val_acc = self.model.evaluate(self.data.val_x, self.data.val_y)
        train_loss, train_acc = self.model.evaluate(self.train_x, self.train_y)
        return {
            "step": step,
            "time_s": stamp,
            "val_loss": val_loss,
            "val_accuracy": val_acc,
            "train_loss": train_loss,
            "train_accuracy": train_acc,
            **extra,
        }

    def test(self, theta: torch.Tensor) -> dict:
        """The final central variable on the test split (`test_loss`, `test_accuracy`), once, at the end of a
        completed run: nothing during the run, nor any choice made from it, looks at the test split. {} where the
        data has none."""
        if not self.data.has_test:
            return {}
        self.model.load(theta)
        self.model.recalibrate(self.train_x, self.batch_size)
        loss, acc = self.model.evaluate(self.data.test_x, self.data.test_y)
        return {"test_loss": loss, "test_accuracy": acc}
