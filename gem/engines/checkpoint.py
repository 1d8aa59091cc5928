"""Checkpoints, one format for every engine.

<run_dir>/checkpoint/manifest.json names the newest complete checkpoint, <run_dir>/checkpoint/step-NNNNNNNNN/:

- `central.pt`: the parameter server (gem.engines.server: θ, the algorithm's server tensors, the clock, every
  worker's pull time), the coordinator's bookkeeping (finished and lost workers) and the engine's own schedule
  (the sim engine's event queue);
- `worker-W.pt`: worker W's state (gem.engines.worker: local copy, algorithm state, data position, random
  streams, step count), one file per worker that was still running.

Everything in them is tensors, numbers, strings, lists and dicts, read back with `weights_only=True`, which never
runs code from the file. A checkpoint is written into `pending/`, renamed to its step, and only then named by the
manifest (written last, by rename): it is either complete and named, or ignored.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch

from gem.engines.server import state_mismatch
from gem.files import WriteError, write_atomic  # noqa: F401 - WriteError: what a checkpoint write raises
from gem.models import model_name

CHECKPOINT = "checkpoint"
# what must match between a checkpoint and the command that resumes it
FINGERPRINT = ("algorithm", "workers", "batch_size", "epochs", "seed", "device", "loss", "precision")
# the sim engine's commit order (a trace's contents are read again on resume: keep its run directory as it is)
SCHEDULE_KEYS = ("staleness", "straggler_fraction", "straggler_slowdown", "cycle_cv", "trace")


class CheckpointError(ValueError):
    """One line: the checkpoint is missing, unreadable, or from another configuration."""


def fingerprint(job) -> dict:
    engine = job.engine.name
    schedule = {k: getattr(job.engine, k) for k in SCHEDULE_KEYS} if engine == "sim" else {}
    return {
        **{k: getattr(job, k) for k in FINGERPRINT},
        "model": model_name(job.model),
        "data": job.data.name,
        "hp": dataclasses.asdict(job.hp),
        "engine": engine,
        **schedule,
        # θ's shards, each with its own server state: a checkpoint of S servers resumes on S servers
        **({"engine.servers": job.engine.servers} if engine == "distributed" else {}),
    }


def read_manifest(run_dir) -> dict:
    path = Path(run_dir) / CHECKPOINT / "manifest.json"
    if not path.exists():
        raise CheckpointError(
            f"resume=true: no checkpoint in {path.parent}; resume needs the run directory "
            f"of a run that wrote checkpoints (hydra.run.dir=<that directory>)"
        )
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
    theirs = dict(manifest.get("fingerprint", {}))
    # the algorithm's parameters one by one, named as the command line names them
    hp_ours, hp_theirs = ours.pop("hp"), theirs.pop("hp", {})
    if not isinstance(hp_theirs, dict):  # a checkpoint that recorded them otherwise: compare the whole
        hp_theirs, hp_ours = {"algorithm parameters": hp_theirs}, {"algorithm parameters": repr(job.hp)}
    top = ("lr", "momentum", "workers")
    # the sim engine's schedule is set by engine.* keys: named as the command line names them
    pairs = [(f"engine.{k}" if k in SCHEDULE_KEYS else k, v, ours.get(k)) for k, v in theirs.items()]
    pairs += [(k if k in top or " " in k else f"algorithm.{k}", v, hp_ours.get(k)) for k, v in hp_theirs.items()]
    for shown, v, mine in pairs:
        if mine != v:
            raise CheckpointError(
                f"resume=true: the checkpoint was made with {shown}={v}, this command has "
                f"{shown}={mine}; resume with the original command's overrides"
            )


def save_atomic(obj, path) -> None:
    """Write to a temporary name, then rename: a file is whole or absent. Serialised in memory first and written
    with plain file I/O, so that a full disk is the OS's own error (torch's zip writer reports it as 'unexpected
    pos'), and a failed write leaves no temporary file."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomic(path, buffer.getbuffer())


def load(path):
    """Tensors, numbers, lists and dicts only: weights_only=True never runs code from the file."""
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before it refuses: one line is ours
            warnings.simplefilter("ignore")
            return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"resume=true: checkpoint file {path} is missing; the checkpoint is incomplete") from None
    except pickle.UnpicklingError:  # weights_only refused something: never say "load it with weights_only=False"
        why = "it holds objects other than tensors, numbers and strings; gem does not write such files"
    except Exception as e:  # noqa: BLE001 - any other failure to read is the same one line for the user
        why = "truncated or not a checkpoint" if isinstance(e, (RuntimeError, EOFError)) else type(e).__name__
    raise CheckpointError(f"resume=true: checkpoint file {path} cannot be read ({why}); the run cannot resume from it")


def verify(manifest: dict, workers: int, algo=None, hp=None) -> None:
    """Read every file of the checkpoint (central.pt, then the file of every worker still running at it), so
    that a damaged checkpoint is refused before anything of the run directory is cut or merged; with `algo` and
    its `hp`, also one whose server tensors are not the shapes this version of the algorithm makes."""
    central = load(Path(manifest["path"]) / "central.pt")
    if not isinstance(central, dict) or not {"theta", "clock"} <= central.keys():
        raise CheckpointError(
            f"resume=true: checkpoint file {Path(manifest['path']) / 'central.pt'} is not a parameter server's state"
        )
    if algo is not None:  # each shard's state (several servers: gem.engines.distributed.shards), or the one
        for part in central.get("shards") or [central]:
            theta = torch.empty(part["theta"].shape, device="meta")  # shapes only: nothing allocated
            mismatch = state_mismatch(part, theta, algo.server_state(theta, hp, workers))
            if mismatch:
                raise CheckpointError(f"resume=true: {mismatch}")
    past = central.get("coordinator", {})
    done = set(past.get("finished", [])) | set(past.get("lost_workers", []))
    for w in range(workers):
        if w not in done:
            load_worker(manifest, w)


def pending(run_dir) -> Path:
    """An empty folder for the checkpoint being written."""
    folder = Path(run_dir) / CHECKPOINT / "pending"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def worker_file(folder, w: int) -> Path:
    return Path(folder) / f"worker-{w}.pt"


def load_worker(manifest: dict, w: int) -> dict:
    return load(worker_file(manifest["path"], w))


def load_central(manifest: dict) -> dict:
    return load(Path(manifest["path"]) / "central.pt")


def finish(run_dir, folder: Path, step: int, central: dict, job, time_s: float) -> None:
    """Write central.pt into `folder`, name the checkpoint by its step, point the manifest at it, and drop the
    previous one. The caller has flushed the commit rows up to `step` to disk first."""
    save_atomic(central, Path(folder) / "central.pt")
    base = Path(run_dir) / CHECKPOINT
    name = f"step-{step:09d}"
    shutil.rmtree(base / name, ignore_errors=True)
    os.replace(folder, base / name)
    write_atomic(
        base / "manifest.json",
        json.dumps({"step": step, "dir": name, "fingerprint": fingerprint(job), "time_s": time_s}, indent=1),
    )
    for old in base.glob("step-*"):  # the manifest names the new one now
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
