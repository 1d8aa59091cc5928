"""Asynchronous optimisers as two small pure functions each (DESIGN §2).

An algorithm is a module with:

- ``Params``: a frozen dataclass of its hyperparameters. It always has ``lr`` and ``momentum``, filled from the
  top-level config keys, and the keys of its ``conf/algorithm/<name>.yaml``.
- ``init_state(theta, hp) -> dict``: a worker's private state (momentum, accumulators, ...).
- ``worker_rule(state, x, grad, theta, hp) -> Commit | None``: called after each local gradient ``grad`` of
  the loss at the worker's local parameters ``x``. It may update ``x`` in place (local steps). It returns a
  ``Commit`` when the worker communicates, else None. ``theta`` is the central variable as the worker sees it
  now (read-only); GEM needs it for θ − s.
- ``server_rule(theta, delta, staleness, hp)``: applies a commit to the central variable in place. The
  parameter server measures ``staleness`` (τ) under its own lock.

After a commit has been applied, the engine pulls: it copies θ into ``x``. Engines know nothing else about
algorithms, so adding one takes a module here, a YAML file in conf/algorithm/ and a test.
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


def get(name: str) -> ModuleType:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name} is not an algorithm; choose one of: {', '.join(ALGORITHMS)}")
    return importlib.import_module(f"gem.algorithms.{name}")
