"""Small pieces every engine shares: building the model, the step budget, evaluating the central variable."""

from __future__ import annotations

import time

import torch

from gem.data import Dataset
from gem.models import FlatModel, build_model


def build_flat_model(job, device=None) -> FlatModel:
    """The job's model with the seed's initialisation, as a FlatModel: the same θ₀ in every process."""
    torch.manual_seed(job.seed)
    return FlatModel(build_model(job.model, num_classes=job.data.num_classes), device=device or job.device)


def worker_steps(job) -> int:
    """Local gradient steps per worker: `epochs` full passes over the training set (DESIGN §1)."""
    return job.epochs * (len(job.data.train_y) // job.batch_size)


def commits_per_worker(job, window: int) -> int:
    """A window cut short by the end of the budget commits nothing."""
    return worker_steps(job) // window


def finite(theta: torch.Tensor) -> bool:
    return bool(torch.isfinite(theta).all())


class Evaluator:
    """Evaluates the central variable on the validation split and on a fixed training subset.

    It has its own copy of the model, so evaluating never disturbs a worker's parameters, and it draws no random
    numbers (eval mode), so it never disturbs a worker's random streams either.
    """

    def __init__(self, job, data: Dataset):
        self.model = build_flat_model(job)
        self.data = data
        k = min(job.eval_train_size, len(data.train_y))
        idx = torch.randperm(len(data.train_y), generator=torch.Generator().manual_seed(job.seed))[:k]
        self.train_x, self.train_y = data.train_x[idx], data.train_y[idx]

    def __call__(self, theta: torch.Tensor, step: int, t0: float, **extra) -> dict:
        self.model.load(theta)
        val_loss, val_acc = self.model.evaluate(self.data.val_x, self.data.val_y)
        train_loss, train_acc = self.model.evaluate(self.train_x, self.train_y)
        return {"step": step, "time_s": time.perf_counter() - t0, "val_loss": val_loss,
                "val_accuracy": val_acc, "train_loss": train_loss, "train_accuracy": train_acc, **extra}
