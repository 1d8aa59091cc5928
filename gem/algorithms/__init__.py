"""Asynchronous optimisers as two small pure functions each (DESIGN §2).

An algorithm is a module with:

- ``Params``: a frozen dataclass of its hyperparameters. It always has ``lr`` and ``momentum``, filled from the
  top-level config keys (and ``workers``, if it declares that field), and the keys of its
  ``conf/algorithm/<name>.yaml``. ``__post_init__`` rejects bad values with one line (see ``require``).
- ``init_state(theta, hp, layout) -> dict``: a worker's private state (momentum, accumulators, ...).
  ``layout`` lists the model's parameter tensors as ``(name, slice)`` pairs into the flat vectors, for
  per-tensor diagnostics (GEM's π heatmaps).
- ``worker_rule(state, x, grad, theta, hp, server) -> Commit | None``: called after each local gradient
  ``grad`` of the loss at the worker's local parameters ``x``. It may update ``x`` in place (local steps). It
  returns a ``Commit`` when the worker communicates, else None. ``theta`` is the live central variable (read
  it, never keep a reference). The engine calls ``worker_rule`` before the server applies this worker's commit,
  so ``theta`` here does not yet hold it: a copy taken now is θ as it was just before the worker's own commit,
  which is the reference GEM needs for θ − s (DESIGN §1).
- ``server_rule(theta, commit, staleness, hp, server)``: applies a commit to the central variable in place.
  The parameter server measures ``staleness`` (τ) under its own lock.
- optional ``init_server(theta, hp) -> dict``: tensors the parameter server keeps next to θ (GEM's global
  proxy). Only ``server_rule`` writes them; ``worker_rule`` receives them read-only as ``server``. Without
  it, ``server`` is an empty dict.

After a commit has been applied the engine pulls, copying θ into ``x``, unless the commit says
``pull=False`` (EASGD's workers keep their own variable). Engines know nothing else about algorithms, so
adding one takes a module here, its name in ``ALGORITHMS``, a YAML file in conf/algorithm/ and a test.
A module may set ``SEQUENTIAL = True`` (sgd): it then always runs with one worker.
An algorithm whose ``Params`` has ``window`` (λ) returns a Commit on every λ-th ``worker_rule`` call only, and
reads ``theta`` and ``server`` on those calls only: the distributed engine fetches the live θ for them alone.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from types import ModuleType

import torch

# name -> module; every entry must have a conf/algorithm/<name>.yaml
ALGORITHMS = ("sgd", "gem", "downpour", "adaptive", "agn", "easgd", "eamsgd")


@dataclass
class Commit:
    delta: torch.Tensor  # flat update; the engine must apply it before the worker's next worker_rule call
    metrics: dict[str, float] = field(default_factory=dict)  # extra per-commit columns for metrics.parquet
    tensors: dict[str, list[float]] = field(default_factory=dict)  # per-parameter-tensor diagnostics
    pull: bool = True  # copy θ into the worker's x once the commit is applied
    payload: dict[str, torch.Tensor] = field(default_factory=dict)  # extra tensors for server_rule only


def get(name: str) -> ModuleType:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name} is not an algorithm; choose one of: {', '.join(ALGORITHMS)}")
    return importlib.import_module(f"gem.algorithms.{name}")


def init_server(module: ModuleType, theta: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    """The server-side state of an algorithm: its ``init_server`` if it has one, else nothing."""
    fn = getattr(module, "init_server", None)
    return fn(theta, hp) if fn is not None else {}


def require(ok: bool, key: str, value, allowed: str) -> None:
    """For Params.__post_init__: one line naming the key and what is allowed."""
    if not ok:
        raise ValueError(f"algorithm.{key}={value} is not allowed; {key} must be {allowed}")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and 0 < x < math.inf


# Scratch buffers, one set per process and shape. A commit's delta may live in one: engines apply a commit
# before any worker_rule runs again in that process (sim: one commit at a time; process and distributed:
# one worker per process), so a buffer is never overwritten while still needed. Sharing them keeps the sim
# engine's memory at the workers' own state plus a constant, instead of a few model copies per worker.
_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(like: torch.Tensor, name: str) -> torch.Tensor:
    key = (name, like.shape, like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty_like(like)
    return buf
