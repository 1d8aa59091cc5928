"""The config's schema: the top-level keys, the groups' keys with their types and defaults, and the `per_worker`
resolver (docs/contract.md). Types are enforced by Hydra when a config is composed; values are checked by
experiments.config.validate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any  # noqa: UP035 - OmegaConf reads Optional[...], not X | None, on Python 3.10

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from experiments.instantiate import ConfigError
from gem import algorithms

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algorithm", "engine", "model", "data", "logger", "experiment")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class BudgetConfig:
    """How long a run lasts besides `epochs` (docs/contract.md, "Budgets"); null: not set. The defaults live in
    conf/config.yaml."""

    worker_steps: int | None = None  # each worker's local gradient steps, in place of epochs
    commits: int | None = None  # the run ends once the server's clock has reached this
    seconds: float | None = None  # ... or this many seconds after it started (process, distributed: AlgoPerf's
    # max_runtime)
    sim_time: float | None = None  # ... or (sim) once the simulated clock has passed this, in mean cycles of one
    # local step


@dataclass
class Config:
    """Top-level keys (docs/contract.md). Types here are enforced by Hydra when the config is composed."""

    algorithm: Any = MISSING
    engine: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    logger: Any = MISSING
    # values live in conf/config.yaml (one source of defaults); the schema only fixes the types
    workers: int = MISSING
    lr: float = MISSING
    momentum: float = MISSING
    batch_size: int = MISSING
    epochs: float = MISSING  # passes over the training split, per worker (0.25: a quarter of one)
    budget: BudgetConfig = MISSING  # worker_steps, commits, seconds, sim_time: BudgetConfig
    seed: int = MISSING
    device: str = MISSING
    loss: Any = MISSING  # nll | cross_entropy | null (the model's own: nll if it outputs log-probabilities)
    precision: str = MISSING  # fp32 | bf16 (the workers' forward and backward passes)
    resume: bool = MISSING
    plan: bool = MISSING  # list the jobs of the command and their estimated cost, run nothing (experiments.plan)


# Group schemas, checked by `validate` (the algorithm's own keys come from its module's Params dataclass, the
# engine's from its options' record in gem.engines.options).
@dataclass
class SyntheticConfig:
    num_classes: int = 10
    train_size: int = 5000
    val_size: int = 1000
    test_size: int = 1000
    seed: int = 0
    task: str = "teacher"  # teacher (a random linear teacher's labels) | prototypes (class templates plus noise)
    snr: float = 0.5  # prototypes: the templates' scale against unit noise


@dataclass
class DataConfig:
    _target_: Any = None  # null: the built-in loader `name`; else a torchvision-style dataset (experiments.instantiate)
    name: str = "digits"
    root: str = "data"
    download: bool = False
    augment: bool = True
    num_classes: int = 10
    # training-file examples held out for validation (a tenth where the file holds fewer than 10x): gem.data.hold_out
    val_size: int = 5000
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "gem"
    entity: Any = None
    group: Any = None
    log_every: int = 10  # commits between W&B rows, and TensorBoard's (every evaluation row is logged)


@dataclass
class LoggerConfig:
    flush_every: int = 1000  # commit rows buffered before a parquet part is written
    flush_seconds: float = 30.0  # ... or seconds, whichever comes first
    eval_every: int = 100  # commits between evaluations of the central variable
    eval_train_size: int = 2048
    progress: bool = True
    tensorboard: bool = False  # TensorBoard event files in <run_dir>/tensorboard/ (experiments.tensorboard_logger)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)


# engine: its options' record, gem.engines.options.OPTIONS[name] (experiments.config.engine_options); model: any
# _target_
GROUP_SCHEMAS = {"data": DataConfig, "logger": LoggerConfig}


def per_worker(total: int, *, _root_: DictConfig) -> int:
    """`${per_worker:256}`: split a total evenly over the workers that will run (1 for a sequential algorithm).

    Experiments use it for a fixed effective batch (fig4: b = B/n with B = 256) and for the same data budget
    at every n (fig4, fig5: epochs per worker = total epochs / n)."""
    n = algorithms.workers_that_run(str(_root_.algorithm.get("name")), _root_.workers)
    if n < 1:
        raise ConfigError(f"workers={n} is not allowed; workers must be an integer >= 1")
    if int(total) % n:
        raise ConfigError(
            f"per_worker:{total} does not split evenly over workers={n}; pick workers that divide {total}"
        )
    return int(total) // n


def every_worker_steps(steps: int, *, _root_: DictConfig) -> int:
    """`${every_worker_steps:20}`: the commits in which every worker takes about `steps` local gradient steps,
    n·steps/λ (λ: the algorithm's `window` where it has one), at least 1. For `logger.eval_every`, so that a sweep
    over n and algorithms evaluates each run as often per worker step: the paper's figures and the time to a target
    are read against worker steps."""
    n = algorithms.workers_that_run(str(_root_.algorithm.get("name")), _root_.workers)
    window = _root_.algorithm.get("window", 1) or 1
    return max(1, round(int(steps) * max(1, n) / int(window)))


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
    OmegaConf.register_new_resolver("per_worker", per_worker, replace=True)
    OmegaConf.register_new_resolver("every_worker_steps", every_worker_steps, replace=True)


register()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# Params fields filled from top-level keys rather than from algorithm.*
TOP_LEVEL_PARAMS = ("lr", "momentum", "workers")
