"""A Spec into the `gem.engines.Job` an engine runs: the data loaded, the model met with it once.

Everything the engine needs is resolved here, in the parent process: no Hydra object crosses into an engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from experiments import instantiate
from experiments.config import Spec, check_batch_size, data_root
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
        source = {"name": d.name, "root": data_root(d.root), "download": d.download,
                  "synthetic": dataclasses.asdict(d.synthetic), "shape": shape, "augment": d.augment}
        dataset = gdata.load_dataset(**source)
    model = instantiate.model_spec(cfg)
    # the loaded data meets the model: inputs, number of classes, loss; and the loaded size (cifar10, _target_)
    instantiate.check_pairing(model, spec.loss, dataset, cfg.seed)
    check_batch_size(cfg.batch_size, d.name, len(dataset.train_y))
    engine = {k: v for k, v in dataclasses.asdict(spec.engine).items() if k != "checkpoint_every"}
    return Job(algorithm=spec.algorithm, hp=spec.hp, model=model, data=dataset, workers=spec.workers,
               batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed, device=cfg.device, loss=spec.loss,
               precision=cfg.precision, engine=engine, eval_every=spec.logger.eval_every,
               eval_train_size=spec.logger.eval_train_size, run_dir=str(run_dir) if run_dir is not None else None,
               checkpoint_every=spec.engine.checkpoint_every, resume=resume, data_source=source)
