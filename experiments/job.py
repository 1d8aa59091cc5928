"""A Spec into the `gem.engines.Job` an engine runs: the data loaded, the model met with it once.

Everything the engine needs is resolved here, in the parent process: no Hydra object crosses into an engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from experiments import instantiate
from experiments.config import ConfigError, Spec, budget_of, check_batch_size, data_root
from gem import data as gdata
from gem import models
from gem.engines import Job


def build_job(spec: Spec, log=print, run_dir: Path | None = None, resume: dict | None = None) -> Job:
    """The job of `spec`, its data in memory. ConfigError (one line) when the data does not meet the model or the
    batch size; gem.data.DatasetMissing when the data cannot be had."""
    cfg, d = spec.cfg, spec.data
    if spec.workers != cfg.workers:
        log(f"gem: algorithm={spec.algorithm} is sequential: running 1 worker (workers={cfg.workers} ignored)")
    shape = models.input_shape(spec.model)  # digits and synthetic take the model's input shape
    if instantiate.is_instantiated(cfg.data):  # a torchvision-style class: its tensors travel with the job
        source = None
        dataset = instantiate.load_data(cfg)
    else:  # a built-in loader: a distributed worker on another machine loads it itself
        source = {
            "name": d.name,
            "root": data_root(d.root),
            "download": d.download,
            "synthetic": dataclasses.asdict(d.synthetic),
            "shape": shape,
            "augment": d.augment,
            "val_size": d.val_size,
        }
        dataset = gdata.load_dataset(**source)
    model = instantiate.model_spec(cfg)
    # the loaded data meets the model: inputs, number of classes, loss; and the loaded size (cifar10, _target_)
    instantiate.check_pairing(model, spec.loss, dataset, cfg.seed)
    check_batch_size(cfg.batch_size, d.name, len(dataset.train_y))
    budget = budget_of(cfg)
    check_length(cfg, spec, len(dataset.train_y), budget)
    return Job(
        algorithm=spec.algorithm,
        hp=spec.hp,
        model=model,
        data=dataset,
        workers=spec.workers,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        seed=cfg.seed,
        device=cfg.device,
        loss=spec.loss,
        precision=cfg.precision,
        engine=spec.engine,
        eval_every=spec.logger.eval_every,
        eval_train_size=spec.logger.eval_train_size,
        run_dir=str(run_dir) if run_dir is not None else None,
        checkpoint_every=spec.checkpoint_every,
        resume=resume,
        data_source=source,
        budget=budget,
    )


def check_length(cfg, spec: Spec, train: int, budget: dict) -> None:
    """A run whose workers would take no gradient, or commit nothing, is refused in one line: epochs too small
    for one mini-batch, or fewer worker steps than the algorithm's window."""
    from gem import algorithms

    batches = train // cfg.batch_size
    steps = budget.get("worker_steps") or int(cfg.epochs * batches + 1e-9)
    window = algorithms.get(spec.algorithm).commit_every(spec.hp)
    if steps < max(1, window):
        given = (
            f"budget.worker_steps={steps}"
            if budget.get("worker_steps")
            else f"epochs={cfg.epochs:g} "
            f"({batches} mini-batches of {cfg.batch_size} per epoch of data={spec.data.name})"
        )
        need = (
            f"at least {window} (algorithm.window: a worker commits once per window)" if window > 1 else "at least one"
        )
        raise ConfigError(f"{given} gives each worker {steps} gradient step(s); it needs {need}")
