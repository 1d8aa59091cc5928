"""Engines decide who runs the workers and in which order (docs/design.md). Algorithms do not know about them.

Every engine has `run(job, recorder) -> Result`, where `job` is a plain, picklable `Job` (no Hydra objects),
so that child processes never need Hydra's resolvers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from gem.engines import options as _options
from gem.engines.options import EngineOptions

ENGINES = tuple(_options.OPTIONS)  # sim, process, distributed


@dataclass
class Job:
    """Everything an engine needs, resolved in the parent process."""

    algorithm: str
    hp: Any  # the algorithm's Params dataclass
    model: Any  # a built-in model's name (gem.models.MODELS) or a gem.models.ModelSpec
    data: Any  # gem.data.Dataset, already in memory
    workers: int
    batch_size: int
    epochs: float  # passes over the training split per worker (budget["worker_steps"] replaces it when set)
    seed: int
    device: str = "cpu"  # cpu, cuda (workers spread over the visible GPUs) or cuda:N (gem.engines.core.device_of)
    loss: str = "nll"  # nll (log-probabilities) or cross_entropy (logits)
    precision: str = "fp32"  # fp32, or bf16 for the workers' forward and backward passes
    # the engine and its options (gem.engines.options); a dict of some of them is made into its record
    engine: EngineOptions = field(default_factory=_options.SimOptions)
    eval_every: int = 100  # commits between evaluations of the central variable
    eval_train_size: int = 2048  # training examples used for the periodic train-loss estimate
    run_dir: str | None = None  # where checkpoints go (<run_dir>/checkpoint/)
    checkpoint_every: int = 0  # commits between checkpoints; 0: none
    resume: dict | None = None  # the manifest of the checkpoint to continue from (gem.engines.checkpoint)
    # gem.data.load_dataset's arguments for `data`: lets a worker on another machine load it itself
    data_source: dict | None = None
    # how long the run lasts besides `epochs` (BUDGET_KEYS, each None unless set): `worker_steps` replaces epochs;
    # `commits`, `seconds` (process, distributed) and `sim_time` (sim) end it sooner (gem.engines.core.capped)
    budget: dict = field(default_factory=dict)

    def __post_init__(self):
        self.engine = _options.of(self.engine)


BUDGET_KEYS = ("worker_steps", "commits", "seconds", "sim_time")


@dataclass
class Result:
    status: str  # completed | diverged | failed
    steps: int  # commits applied by the parameter server
    reason: str = ""
    extra: dict = field(default_factory=dict)  # summary fields: lost workers, the distributed server's load


def get(name: str) -> ModuleType:
    if name not in ENGINES:
        raise ValueError(f"engine={name} is not an engine; choose one of: {', '.join(ENGINES)}")
    return importlib.import_module(f"gem.engines.{name}")
