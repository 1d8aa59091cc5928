"""Asynchronous optimisers as two small pure functions each (DESIGN §2).

An algorithm is a module with:

- ``Params``: a frozen dataclass of its hyperparameters. It always has ``lr`` and ``momentum``, filled from the
  top-level config keys, and the keys of its ``conf/algorithm/<name>.yaml``.
- ``init_state(theta, hp, layout) -> dict``: a worker's private state (momentum, accumulators, ...).
  ``layout`` lists the model's parameter tensors as ``(name, slice)`` pairs into the flat vectors, for
  per-tensor diagnostics (GEM's π heatmaps).
- ``worker_rule(state, x, grad, theta, hp) -> Commit | None``: called after each local gradient ``grad`` of
  the loss at the worker's local parameters ``x``. It may update ``x`` in place (local steps). It returns a
  ``Commit`` when the worker communicates, else None. ``theta`` is the live central variable (read it, never
  keep a reference). The engine calls ``worker_rule`` before the server applies this worker's commit, so
  ``theta`` here does not yet hold it: a copy taken now is θ as it was just before the worker's own commit,
  which is the reference GEM needs for θ − s (DESIGN §1).
- ``server_rule(theta, delta, staleness, hp)``: applies a commit to the central variable in place. The
  parameter server measures ``staleness`` (τ) under its own lock.

After a commit has been applied the engine pulls, copying θ into ``x``, unless the commit says
``pull=False`` (EASGD's workers keep their own variable). Engines know nothing else about algorithms, so
adding one takes a module here, its name in ``ALGORITHMS``, a YAML file in conf/algorithm/ and a test.
A module may set ``SEQUENTIAL = True`` (sgd): it then always runs with one worker.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

import torch

# name -> module; every entry must have a conf/algorithm/<name>.yaml
ALGORITHMS = ("sgd",)


@dataclass
class Commit:
    delta: torch.Tensor  # flat update; the engine must apply it before the worker's next worker_rule call
    metrics: dict[str, float] = field(default_factory=dict)  # extra per-commit columns for metrics.parquet
    tensors: dict[str, list[float]] = field(default_factory=dict)  # per-parameter-tensor diagnostics
    pull: bool = True  # copy θ into the worker's x once the commit is applied


def get(name: str) -> ModuleType:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name} is not an algorithm; choose one of: {', '.join(ALGORITHMS)}")
    return importlib.import_module(f"gem.algorithms.{name}")
