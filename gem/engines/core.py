"""Pieces every engine shares: building the model, evaluating the central variable, the step budget."""

from __future__ import annotations

import heapq
import json
import os
import time
from pathlib import Path

import torch

from gem.data import Dataset
from gem.metrics import tensor_rows
from gem.models import FlatModel, build_model


def build_flat_model(job, seed_offset: int = 0) -> FlatModel:
    """The job's model with the seed's initialisation, as a FlatModel on the job's device."""
    torch.manual_seed(job.seed + seed_offset)
    return FlatModel(build_model(job.model, num_classes=job.data.num_classes), device=job.device)


def worker_steps(job) -> int:
    """Local gradient steps per worker: `epochs` full passes over the training set (DESIGN §1)."""
    return job.epochs * (len(job.data.train_y) // job.batch_size)


class Evaluator:
    """Evaluates the central variable on the validation split and on a fixed training subset.

    It has its own copy of the model, so evaluating never disturbs a worker's parameters.
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


def finite(theta: torch.Tensor) -> bool:
    return bool(torch.isfinite(theta).all())


# ------------------------------------------------------------------------------------------- checkpoints
# <run_dir>/checkpoint/manifest.json names the newest complete checkpoint, <run_dir>/checkpoint/step-NNNNNNNNN/.
# It is written last, by rename, so a checkpoint is either complete and named, or ignored.

CHECKPOINT = "checkpoint"
# what must match between a checkpoint and the command that resumes it
FINGERPRINT = ("algorithm", "model", "workers", "batch_size", "epochs", "seed")


class CheckpointError(ValueError):
    """One line: the checkpoint is missing, unreadable, or from another configuration."""


def fingerprint(job) -> dict:
    return {**{k: getattr(job, k) for k in FINGERPRINT}, "data": job.data.name, "hp": repr(job.hp)}


def read_manifest(run_dir) -> dict:
    path = Path(run_dir) / CHECKPOINT / "manifest.json"
    if not path.exists():
        raise CheckpointError(f"resume=true: no checkpoint in {path.parent}; resume needs the run directory "
                              f"of a run that wrote checkpoints (hydra.run.dir=<that directory>)")
    try:
        manifest = json.loads(path.read_text())
        step, folder = int(manifest["step"]), Path(run_dir) / CHECKPOINT / manifest["dir"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"resume=true: checkpoint manifest {path} is unreadable ({e})") from None
    if not (folder / "central.pt").exists():
        raise CheckpointError(f"resume=true: checkpoint {folder} is incomplete (no central.pt)")
    return {**manifest, "step": step, "path": str(folder)}


def check_resumable(manifest: dict, job) -> None:
    ours = fingerprint(job)
    for k, v in manifest.get("fingerprint", {}).items():
        if ours.get(k) != v:
            shown = "algorithm parameters" if k == "hp" else k
            raise CheckpointError(f"resume=true: the checkpoint was made with {shown}={v}, this command has "
                                  f"{shown}={ours.get(k)}; resume with the original command's overrides")


def write_manifest(run_dir, step: int, folder: str, job, extra: dict) -> None:
    base = Path(run_dir) / CHECKPOINT
    tmp = base / "manifest.json.tmp"
    tmp.write_text(json.dumps({"step": step, "dir": folder, "fingerprint": fingerprint(job), **extra}, indent=1))
    os.replace(tmp, base / "manifest.json")


def save_atomic(obj, path) -> None:
    """torch.save to a temporary name, then rename: a file is whole or absent."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_checkpoint(path):
    """Tensors, numbers, lists and dicts only: weights_only=True never runs code from the file."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure to read is the same one line for the user
        raise CheckpointError(f"resume=true: cannot read checkpoint file {path} ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------------------- commit rows


class Ledger:
    """Records commit rows in clock order, though they arrive out of order (each worker sends its own rows,
    in batches). A commit whose worker was lost before it sent the row gets a row that says so (`lost_row`),
    so that the clock in metrics.parquet has no gap. Shared by the process and distributed engines."""

    def __init__(self, recorder, tensor_names: list[str], steps: int = 0):
        self.recorder, self.tensor_names = recorder, tensor_names
        self.rows: list = []  # heap of (step, tiebreak, row, tensors) not yet recorded
        self.steps = steps  # the last step recorded
        self.last_time = 0.0  # its time_s

    def add(self, row: dict, tensors=None) -> None:
        heapq.heappush(self.rows, (row["step"], id(row), row, tensors))

    def lost(self, step: int) -> None:
        """The commit at `step` was applied but its row will never come: its worker is gone."""
        self.add({"step": step, "worker": -1, "worker_step": -1, "staleness": -1, "loss": float("nan"),
                  "time_s": None, "lost_row": True})

    def record(self) -> None:
        """Record the rows that are next in clock order."""
        while self.rows and self.rows[0][0] == self.steps + 1:
            step, _, row, tensors = heapq.heappop(self.rows)
            if row.get("lost_row"):
                row["time_s"] = self.last_time  # no later than the rows around it
            self.recorder.commit(row, tensor_rows(row, self.tensor_names, tensors))
            self.steps, self.last_time = step, row["time_s"]

    def fill_gaps(self, upto: int) -> None:
        """Once every live worker has sent its rows, a commit up to `upto` without a row was made by a worker
        that died before sending it: record a row that says so."""
        while self.steps < upto:
            self.record()
            if self.steps < upto and not (self.rows and self.rows[0][0] == self.steps + 1):
                self.lost(self.steps + 1)


def conclude(recorder, evaluate, theta: torch.Tensor, steps: int, t0: float, *, diverged: str, finished: bool,
             lost: list[str], extra: dict):
    """The end of a run with real workers: diverged, failed (no worker finished) or completed, with a final
    evaluation of the central variable unless one was taken at this very commit."""
    from gem.engines import Result

    if diverged:
        return Result("diverged", steps, reason=diverged)
    if not finite(theta):
        return Result("diverged", steps, reason=f"non-finite central variable at commit {steps}")
    if not finished:
        return Result("failed", steps, reason="; ".join(lost) or "no worker finished")
    if recorder.last_eval is None or recorder.last_eval["step"] != steps:
        recorder.eval(evaluate(theta, steps, t0))
    return Result("completed", steps, reason="; ".join(lost), extra=extra)
