"""A composed config checked into a `Spec`: the one typed, checked description of a job that every later step
reads (experiments.job builds the Job from it, experiments.rundir checks the run directory against it, the runner
runs it). Nothing after `validate` checks the config again.

Bad input gets one clear line that names the key and what is allowed (docs/contract.md), before any data is loaded or
any process starts. This module also composes configs with Hydra's compose API (`compose`, `check_job`) and
expands a command's sweep into its jobs' overrides (`expand`), so that a command can be checked before Hydra
launches anything (experiments.command).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments import instantiate, schema
from experiments.instantiate import ConfigError
from experiments.schema import CONF_DIR, GROUPS, TOP_LEVEL_PARAMS, WANDB_MODES, Config, DataConfig, options
from gem import algorithms, engines, models
from gem import data as gdata
from gem.engines.options import EngineOptions, SimOptions, options_class, without_others
from gem.engines.sim import TraceError, read_trace


@dataclass(frozen=True)
class Spec:
    """One job's config, checked (`validate`). The groups are their schemas' dataclasses with every default
    filled in; `cfg` is the config as composed, kept for what is saved with the run (`.hydra/config.yaml`)."""

    cfg: DictConfig
    hp: Any  # the algorithm's Params: cfg.lr, cfg.momentum, cfg.workers (where it has that field), cfg.algorithm.*
    engine: EngineOptions  # the engine's options (gem.engines.options)
    checkpoint_every: int  # engine.checkpoint_every: commits between checkpoints; 0: none
    data: DataConfig
    logger: schema.LoggerConfig
    model: Any  # the model's structure on the meta device: parameter count, input shape, output kind
    loss: str  # the loss resolved for the model (cfg.loss, or the model's own when null)
    workers: int  # the workers that run (1 for a sequential algorithm, whatever cfg.workers asks)

    @property
    def algorithm(self) -> str:
        return str(self.cfg.algorithm.name)


def _merge_checked(schema, node, prefix: str, what: str):
    """Merge a group's node into its dataclass schema; unknown keys and wrong types become ConfigError."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as e:
        key = f"{prefix}.{e.full_key}" if getattr(e, "full_key", None) else prefix
        # a key inside a nested record (logger.wandb.foo): that record's keys, not the group's
        inner, path = schema, []
        for part in str(getattr(e, "full_key", None) or "").split(".")[:-1]:
            field = typing.get_type_hints(inner).get(part) if dataclasses.is_dataclass(inner) else None
            if not dataclasses.is_dataclass(field):
                break
            inner, path = field, [*path, part]
        allowed = ", ".join(f.name for f in dataclasses.fields(inner))
        what = ".".join([prefix, *path]) if path else what
        msg = str(e).splitlines()[0]
        if "not in struct" in msg or "Key '" in msg and "not" in msg:
            raise ConfigError(f"{key} is not a key of {what}; its keys are: {allowed}") from None
        raise ConfigError(f"{key}: {msg}") from None
    except ValueError as e:  # the record's __post_init__ (OmegaConf's own errors are ValueErrors too: above)
        raise ConfigError(str(e)) from None


# Params fields filled from top-level keys rather than from algorithm.*


def algorithm_params(cfg: DictConfig):
    """The algorithm's Params dataclass filled from cfg.lr, cfg.momentum (cfg.workers if it has that field)
    and cfg.algorithm.*"""
    name = cfg.algorithm.name
    module = algorithms.get(name)
    node = {k: v for k, v in OmegaConf.to_container(cfg.algorithm, resolve=True).items() if k != "name"}
    fields = {f.name for f in dataclasses.fields(module.Params)}
    for k in node:
        if k not in fields or k in TOP_LEVEL_PARAMS:
            allowed = ", ".join(sorted(fields - set(TOP_LEVEL_PARAMS))) or "none"
            raise ConfigError(
                f"algorithm.{k} is not a parameter of algorithm={name}; its parameters are: "
                f"{allowed} (lr, momentum and workers are top-level keys)"
            )
    top = {k: cfg[k] for k in TOP_LEVEL_PARAMS if k in fields}
    try:
        return _merge_checked(module.Params, {**node, **top}, "algorithm", f"algorithm={name}")
    except ValueError as e:  # Params.__post_init__ (gem.algorithms.require): already one line
        raise ConfigError(str(e).splitlines()[0]) from None


def validate(cfg: DictConfig, here: bool = True) -> Spec:
    """The job's Spec; ConfigError with one clear line on the first bad value. Cheap: loads no data. `here=False`:
    the job runs on another machine (a SLURM launcher), whose GPUs and memory this one cannot see: those are
    checked by the job itself, where it runs."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # `???` in a config (data=tensors: data.path, data.num_classes)
        raise ConfigError(f"{missing[0]} must be given: add {missing[0]}=<value> to the command")
    known = [f.name for f in dataclasses.fields(Config)]
    for key in cfg:
        if key not in known:  # `+foo=1` adds a key that nothing reads: refuse it rather than ignore it
            raise ConfigError(f"{key} is not a config key; top-level keys are: {', '.join(known)}")
    budget_keys = [f.name for f in dataclasses.fields(schema.BudgetConfig)]
    for key in cfg.get("budget") or {}:
        if key not in budget_keys:  # `+budget.foo=1`: refused as `budget.foo=1` is, not ignored
            raise ConfigError(
                f"budget.{key} is not a config key; the keys of budget are: "
                + ", ".join(f"budget.{k}" for k in budget_keys)
            )
    name = cfg.algorithm.get("name")
    if name not in algorithms.ALGORITHMS:
        raise ConfigError(f"algorithm={name} is not an algorithm; choose one of: {', '.join(algorithms.ALGORITHMS)}")
    for key, cond, allowed in (
        ("workers", cfg.workers >= 1, "an integer >= 1"),
        ("lr", 0 < cfg.lr < math.inf, "a finite number > 0"),
        ("momentum", 0 <= cfg.momentum < 1, "a number in [0, 1)"),
        ("batch_size", cfg.batch_size >= 1, "an integer >= 1"),
        ("epochs", 0 < cfg.epochs < math.inf, "a finite number > 0 (0.25: a quarter of an epoch per worker)"),
        # torch's generators take 64-bit seeds, and gem derives each worker's streams from the seed
        ("seed", 0 <= cfg.seed < 2**32, "an integer from 0 to 4294967295 (2^32 - 1)"),
    ):
        if not cond:
            raise ConfigError(f"{key}={cfg[key]} is not allowed; {key} must be {allowed}")
    _check_budget(cfg)
    if here:
        _check_device(cfg.device)
    if cfg.precision not in models.PRECISIONS:
        raise ConfigError(
            f"precision={cfg.precision} is not allowed; choose one of: {', '.join(models.PRECISIONS)} "
            "(bf16: the workers' forward and backward passes; θ and the algorithms stay float32)"
        )
    hp = algorithm_params(cfg)
    # resolved in place, so that an interpolation there sees the whole config (${every_worker_steps:20})
    checked = {g: _merge_checked(s, _resolved(cfg[g], g), g, g) for g, s in schema.GROUP_SCHEMAS.items() if g != "data"}
    checked["data"] = _check_data(cfg.data)
    eng, checkpoint_every = engine_options(_resolved(cfg.engine, "engine"))
    dat, log = checked["data"], checked["logger"]
    module = checked["model"] = instantiate.build_meta(cfg)
    checked["loss"] = instantiate.resolve_loss(cfg, module)
    fixed = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32), "fashion_mnist": (1, 28, 28), "cifar100": (3, 32, 32)}
    want = models.input_shape(module)
    if want is not None and dat.name in fixed and fixed[dat.name] != want:
        name = instantiate.display_name("model", cfg.model)
        gives = "x".join(map(str, fixed[dat.name]))
        fits = [f"model={m}" for m in sorted(models.MODELS) if models.input_shape(m) == fixed[dat.name]]
        raise ConfigError(
            f"model={name} expects {'x'.join(map(str, want))} inputs but data={dat.name} gives {gives}; pick a "
            + (f"model that takes {gives} ({', '.join(fits)})" if fits else "matching model")
        )
    if log.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={log.wandb.mode} is not allowed; choose one of: {', '.join(WANDB_MODES)}")
    if log.tensorboard and importlib.util.find_spec("tensorboard") is None:  # refused before anything is written
        raise ConfigError(
            "logger.tensorboard=true needs the tensorboard package, which is not installed; pip install tensorboard"
        )
    for key, value, cond, allowed in (
        ("logger.flush_every", log.flush_every, log.flush_every >= 1, "an integer >= 1"),
        ("logger.flush_seconds", log.flush_seconds, log.flush_seconds > 0, "a number > 0"),
        ("logger.eval_every", log.eval_every, log.eval_every >= 1, "an integer >= 1"),
        ("logger.eval_train_size", log.eval_train_size, log.eval_train_size >= 1, "an integer >= 1"),
        ("logger.wandb.log_every", log.wandb.log_every, log.wandb.log_every >= 1, "an integer >= 1"),
        ("data.synthetic.train_size", dat.synthetic.train_size, dat.synthetic.train_size >= 1, "an integer >= 1"),
        ("data.synthetic.val_size", dat.synthetic.val_size, dat.synthetic.val_size >= 1, "an integer >= 1"),
        (
            "data.synthetic.test_size",
            dat.synthetic.test_size,
            dat.synthetic.test_size >= 0,
            "an integer >= 0 (0: no test split)",
        ),
        ("data.val_size", dat.val_size, dat.val_size >= 1, "an integer >= 1"),
        ("data.synthetic.num_classes", dat.synthetic.num_classes, dat.synthetic.num_classes >= 2, "an integer >= 2"),
    ):
        if not cond:
            raise ConfigError(f"{key}={value} is not allowed; it must be {allowed}")
    check_launch(cfg, eng.name)
    if eng.name == "distributed":  # the address a local launch listens on: refused before any run directory exists
        try:
            engines.get(eng.name).check_address(eng.host, eng.port, eng.allow_remote)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        from gem.engines.distributed.shards import refusal  # (distributed only: its package imports torch.distributed)

        why = refusal(cfg.algorithm.name, hp, eng)
        if why:
            raise ConfigError(why)
    workers = algorithms.workers_that_run(cfg.algorithm.name, cfg.workers)
    if here:
        _check_memory(cfg, hp, workers, eng.name, dat, module)
    return Spec(
        cfg=cfg,
        hp=hp,
        engine=eng,
        checkpoint_every=checkpoint_every,
        data=dat,
        logger=log,
        model=module,
        loss=checked["loss"],
        workers=workers,
    )


def engine_options(node: dict) -> tuple[EngineOptions, int]:
    """The engine group: its engine's options (their keys, types, defaults and ranges are gem.engines.options's)
    and the run's checkpoint schedule, `engine.checkpoint_every`. ConfigError in one line on a bad value; a trace
    to replay is read now, and recorded by its absolute path, whatever directory later resumes the run."""
    node = dict(node)
    name = node.get("name")
    if name not in engines.ENGINES:
        raise ConfigError(f"engine={name} is not an engine; choose one of: {', '.join(engines.ENGINES)}")
    every = node.pop("checkpoint_every", 0)
    if type(every) is not int or every < 0:
        raise ConfigError(f"engine.checkpoint_every={every} is not allowed; it must be an integer >= 0 (0: none)")
    # an experiment's settings for another engine (fig1's engine.staleness with engine=process) do not apply here
    cls = options_class(name)
    eng = _merge_checked(cls, without_others(cls, node), "engine", f"engine={name}")
    if isinstance(eng, SimOptions) and eng.staleness == "trace":
        try:
            read_trace(eng.trace)
        except TraceError as e:
            raise ConfigError(str(e)) from None
        eng = dataclasses.replace(eng, trace=str(Path(eng.trace).resolve()))
    return eng, every


def _resolved(node: DictConfig, prefix: str):
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from None


def budget_of(cfg: DictConfig) -> dict:
    """The budget's keys that are set (docs/contract.md, "Budgets")."""
    node = cfg.get("budget") or {}
    return {k: node.get(k) for k in engines.BUDGET_KEYS if node.get(k) is not None}


def _check_budget(cfg: DictConfig) -> None:
    budget, engine, name = budget_of(cfg), cfg.engine.get("name"), cfg.algorithm.get("name")
    for key, low, allowed in (
        ("worker_steps", 1, "an integer >= 1"),
        ("commits", 1, "an integer >= 1"),
        ("seconds", 0, "a number of seconds > 0"),
        ("sim_time", 0, "a number > 0"),
    ):
        v = budget.get(key)
        if v is not None and not (v >= low and (low or v > 0) and math.isfinite(v)):
            raise ConfigError(f"budget.{key}={v} is not allowed; it must be {allowed}, or null")
    if "seconds" in budget and engine == "sim":
        raise ConfigError(
            f"budget.seconds={budget['seconds']} is not allowed on engine=sim: its seconds are this "
            "machine's, which the simulation does not model; use budget.sim_time (simulated time, in "
            "mean cycles of one local step) or budget.commits"
        )
    if "sim_time" in budget and engine != "sim":
        raise ConfigError(
            f"budget.sim_time={budget['sim_time']} is not allowed on engine={engine}: it is the sim "
            "engine's clock; use budget.seconds (wall-clock) or budget.commits"
        )
    capped = sorted(k for k in ("commits", "seconds", "sim_time") if k in budget)
    if capped and name == "ssgd":
        raise ConfigError(
            f"budget.{capped[0]} is not allowed with algorithm=ssgd: its workers wait for whole rounds, "
            "which a cap could stop halfway; give its length in epochs or budget.worker_steps"
        )


def _check_device(device: str) -> None:
    """cpu, cuda (the workers spread over the visible GPUs) or cuda:N (all on GPU N), which must be visible."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(
            f"device={device} is not allowed; use cpu, cuda (workers spread over the visible GPUs) "
            "or cuda:N (all workers on GPU N)"
        )
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            f"device={device}: no CUDA device is visible on this machine (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use device=cpu"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise ConfigError(
            f"device={device}: this machine has {count} visible CUDA device(s), cuda:0 to "
            f"cuda:{count - 1}; use one of them, or device=cuda to spread the workers over all"
        )


def _check_data(node: DictConfig) -> DataConfig:
    """A built-in dataset's keys against DataConfig; a `_target_` dataset's own keys go to its class unchecked,
    gem's (experiments.instantiate.DATA_KEYS) are checked here, and data=tensors's own (its file is looked for
    with the other datasets' files, experiments.command)."""
    if not instantiate.is_instantiated(node):
        dat = _merge_checked(DataConfig, OmegaConf.to_container(node, resolve=True), "data", "data")
        if dat.name not in gdata.DATASETS:
            raise ConfigError(
                f"data={dat.name} is not a dataset; choose one of: {', '.join(gdata.DATASETS)}, or "
                "data._target_=<a torchvision-style dataset class>"
            )
        if dat.synthetic.task not in gdata.SYNTHETIC_TASKS:
            raise ConfigError(
                f"data.synthetic.task={dat.synthetic.task} is not allowed; choose one of: "
                f"{', '.join(gdata.SYNTHETIC_TASKS)}"
            )
        if not 0 <= dat.synthetic.snr < math.inf:
            raise ConfigError(f"data.synthetic.snr={dat.synthetic.snr} is not allowed; it must be a number >= 0")
        if dat.name == "synthetic" and dat.num_classes != dat.synthetic.num_classes:
            raise ConfigError(
                f"data.num_classes={dat.num_classes} but data.synthetic.num_classes="
                f"{dat.synthetic.num_classes}; data=synthetic draws its classes by data.synthetic.num_classes: set "
                f"data.synthetic.num_classes={dat.num_classes} instead (data.num_classes follows it)"
            )
        return dat
    target = node.get("_target_")
    try:
        models.locate(str(target))
    except ValueError as e:
        raise ConfigError(f"data._target_={target}: {e}") from None
    if instantiate.display_name("data", node) == "tensors":
        _check_tensor_file(node)
    num_classes, augment = node.get("num_classes", 10), node.get("augment", False)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
        raise ConfigError(f"data.num_classes={num_classes} is not allowed; it must be an integer >= 2")
    if not isinstance(augment, bool):
        raise ConfigError(f"data.augment={augment} is not allowed; it must be true or false")
    for key in ("train_kwargs", "val_kwargs", "test_kwargs"):
        if node.get(key) is not None and not isinstance(node.get(key), DictConfig):
            raise ConfigError(f"data.{key} must be a mapping of keyword arguments, such as {{train: true}}")
    splits = {
        key: OmegaConf.to_container(node[key], resolve=True) if key in node else default
        for key, default in instantiate.SPLIT_KWARGS
    }
    for other in ("train_kwargs", "test_kwargs"):  # validation must be its own data: choices are made on it
        if splits["val_kwargs"] is not None and splits["val_kwargs"] == splits[other]:
            raise ConfigError(
                f"data.val_kwargs={splits['val_kwargs']} is not allowed; it loads the same split as "
                f"data.{other}, and validation must be data no other split holds: set it to null "
                f"(hold out data.val_size examples of the training split) or to another split's "
                f"arguments"
            )
    val_size = node.get("val_size", gdata.VAL_SIZE)
    if not isinstance(val_size, int) or isinstance(val_size, bool) or val_size < 1:
        raise ConfigError(f"data.val_size={val_size} is not allowed; it must be an integer >= 1")
    root = node.get("root")
    return DataConfig(
        name=instantiate.display_name("data", node),
        root=root if isinstance(root, str) else "data",
        download=bool(node.get("download", False)),
        augment=augment,
        num_classes=num_classes,
        val_size=val_size,
    )


def _check_tensor_file(node: DictConfig) -> None:
    """data=tensors: its file's kind and the share held out, named by their keys (the class would say
    `val_fraction=2` under `data._target_=gem.data.TensorFile ... could not be loaded`, a key the command did not
    name)."""
    fraction, path = node.get("val_fraction", 0.1), str(node.get("path"))
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(
            f"data.val_fraction={fraction} is not allowed; it must be a number in (0, 1): the share of the "
            "training arrays held out for validation when the file has none"
        )
    if not path.endswith((".npz", ".pt")):
        raise ConfigError(f"data.path={path} is not allowed; data=tensors reads a .npz or .pt file")


def _check_memory(cfg: DictConfig, hp, n: int, engine: str, dat, module) -> None:
    """Refuse a run that cannot fit in this machine's memory (gem.engines.memory says how it is estimated)."""
    import torch

    from gem.engines import distributed, memory

    if distributed.launched():
        return  # the launcher placed the ranks, possibly on other machines
    algo = algorithms.get(cfg.algorithm.name)
    params = sum(p.numel() for p in module.parameters())  # `module` is on the meta device: shapes only
    # The state's tensors are counted on a θ of one and of two elements, and the server's extrapolated to θ's
    # size (a tensor is θ-sized or of a fixed size): tensors on the meta device would do it at any size, but the
    # first one costs torch a 0.4 s import (sympy), in every run.
    state = len(algo.init_state(torch.zeros(1), hp))

    def server_elements(size: int) -> int:  # the server's own tensors (DC-ASGD: a backup of θ per worker)
        return sum(v.numel() for v in algo.server_state(torch.zeros(size), hp, n).values())

    one = server_elements(1)
    # held once; on distributed every worker's replica of the server holds them too
    server = (one + (server_elements(2) - one) * (params - 1)) * memory.FLOAT
    server_each = server if engine == "distributed" else 0
    train = gdata.train_size(dat.name, data_root(dat.root), dat.synthetic.train_size, dat.val_size) or 0
    each = memory.per_worker(engine, params, state, train) + server_each
    # (a local launch's workers have no Δ slot in shared memory: they apply their commits to θ in rank 0's window,
    # which is the server's θ, counted once)
    once = server + memory.once(engine)
    have = memory.available()
    if have is None or n * each + once <= have:
        return
    what = "virtual workers" if engine == "sim" else "worker processes"
    server_part = f" and the server's {memory.gib(server)}" if server > params * memory.FLOAT else ""
    raise ConfigError(
        f"workers={n} is too many for this machine: engine={engine} needs at least "
        f"{memory.gib(n * each + once)} ({n} {what} of {memory.gib(each)} each{server_part}) but "
        f"{memory.gib(have)} is available; use at most workers={max(1, (have - once) // each)}"
    )


def check_launch(cfg: DictConfig, engine: str | None = None) -> None:
    """Under torchrun (or a submitit job of several tasks: hydra/launcher=distributed_*) the launcher fixes the
    number of processes: rank 0 is the parameter server and every other rank a worker. Rank 0 checks it with the
    rest of the config; a worker rank before it joins (experiments.command.main), so that it does not wait for a
    rank 0 that refused."""
    from gem.engines import distributed

    engine = engine or str(cfg.engine.name)
    if not distributed.launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return
    world = int(os.environ["WORLD_SIZE"])
    submitit = "SUBMITIT_EXECUTOR" in os.environ  # a job of several tasks (hydra/launcher=distributed_*)
    if engine != "distributed":
        raise ConfigError(
            f"engine={engine}: this process is one of {world} started by a launcher "
            + ("(hydra.launcher.nodes x hydra.launcher.tasks_per_node); " if submitit else "(torchrun); ")
            + "only engine=distributed runs that way; pass engine=distributed, or "
            + ("hydra.launcher.tasks_per_node=1" if submitit else "use python run.py")
        )
    workers = algorithms.workers_that_run(cfg.algorithm.name, cfg.workers)
    servers = int(cfg.engine.get("servers", 1))
    if workers + servers != world:
        need = "workers + 1 (rank 0 is the parameter server)" if servers == 1 else f"workers + engine.servers={servers}"
        raise ConfigError(
            f"workers={workers} does not match the {world} processes the launcher started: "
            f"engine=distributed needs {need}; pass "
            f"workers={world - servers} or start {workers + servers} processes "
            + ("(hydra.launcher.nodes x hydra.launcher.tasks_per_node)" if submitit else "(--nproc_per_node)")
        )


def check_batch_size(batch_size: int, data: str, train: int | None) -> None:
    """batch_size must fit in a worker's shard: every worker draws from all `train` examples. The command's checks
    make it once the data is on disk (where the size is cheap to read); experiments.job again after loading."""
    if train is not None and batch_size > train:
        raise ConfigError(
            f"batch_size={batch_size} is larger than a worker's shard: data={data} has "
            f"{train} training examples, and every worker draws from all of them"
        )


def data_root(root: str) -> str:
    return os.path.abspath(os.path.expanduser(root))


# ------------------------------------------------------------------------------- composing a command


def one_line(exc: Exception) -> str:
    """Reduce a Hydra/OmegaConf composition error to its first meaningful line, naming the key."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    missing = re.search(r"Missing mandatory value: ([\w.]+)", str(cause))
    if missing:  # `???` in a config (data=tensors: data.path, data.num_classes)
        return f"{missing.group(1)} must be given: add {missing.group(1)}=<value> to the command"
    inner = re.search(r"ConfigError raised while resolving interpolation: (.*)", str(cause))
    if inner:  # our own resolver (per_worker) already wrote the line
        return inner.group(1).splitlines()[0]
    text = str(cause).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    key = getattr(cause, "full_key", None)
    field = {f.name: f for f in dataclasses.fields(Config)}.get(key or "")
    if field is not None and "could not be converted" in str(cause):
        value = re.search(r"Value '([^']*)'", str(cause))
        got = value.group(1) if value else "?"
        return f"{key}={got} is not allowed; {key} must be of type {getattr(field.type, '__name__', field.type)}"
    m = re.search(r"Key '([^']+)' (is )?not in", str(exc) + str(cause))
    if m:
        bad = key or m.group(1)
        top = bad.split(".", 1)[0]
        parent = typing.get_type_hints(Config).get(top)
        if "." in bad and dataclasses.is_dataclass(parent):  # budget.foo: the keys of budget, not the top level's
            have = ", ".join(f"{top}.{f.name}" for f in dataclasses.fields(parent))
            return f"{bad} is not a config key; the keys of {top} are: {have}"
        return f"{bad} is not a config key; top-level keys are: {', '.join(f.name for f in dataclasses.fields(Config))}"
    return f"{key}: {first}" if key and key not in first else first


def expand(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of every job a command would launch, including an experiment's sweeper params and
    grids."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not multirun:
        for o in OverridesParser.create().parse_overrides(overrides):
            if o.is_sweep_override():
                raise ConfigError(f"{o.input_line} is a sweep; add -m (--multirun) to run one job per value")
        return [overrides]
    base = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    sweeper = OmegaConf.select(compose(base, return_hydra_config=True), "hydra.sweeper") or {}
    return jobs_of(dict(sweeper.get("params") or {}), overrides, sweeper.get("grids"))


def jobs_of(params: dict, overrides: list[str], grids: list | None = None) -> list[list[str]]:
    """A sweep's jobs: every combination of the values of `params` (an experiment's `hydra.sweeper.params`) and
    of the command's `overrides`, in the order Hydra's basic sweeper launches them (the last key varies
    fastest). Written with Hydra's public override parser: the command is checked before Hydra starts, and the
    gem sweeper (hydra_plugins/gem_sweeper) launches exactly the jobs that were checked.

    `grids` (`hydra.sweeper.grids`, gem's sweeper only): a list of grids, each a dict of keys and values swept
    like `params`. The jobs are those of each grid in turn, each combined with `params` and the command (its keys
    first, so `params` vary fastest), as scikit-learn's ParameterGrid takes a list of grids: settings that only
    some jobs have (GEM's κ, AGN's window) in one sweep. A job that two grids both make runs once."""
    if not grids:
        return _product(params, overrides)
    jobs, seen = [], set()
    for i, grid in enumerate(grids):
        if not isinstance(grid, Mapping) or not grid:
            raise ConfigError(
                f"hydra.sweeper.grids[{i}]={grid} is not allowed; each grid must be a mapping of keys to values (a,b,c)"
            )
        for job in _product({**dict(grid), **{k: v for k, v in params.items() if k not in grid}}, overrides):
            if tuple(job) not in seen:
                seen.add(tuple(job))
                jobs.append(job)
    return jobs


def _product(params: dict, overrides: list[str]) -> list[list[str]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # a key given twice keeps its first place and takes its last value, as in Hydra's basic sweeper
    by_key = {}
    for o in OverridesParser.create().parse_overrides(
        [f"{k}={_sweep_value(v)}" for k, v in params.items()] + list(overrides)
    ):
        by_key[o.key_or_group] = o
    values = []
    for o in by_key.values():
        key = o.get_key_element()
        if not o.is_sweep_override():
            values.append([f"{key}={o.get_value_element_as_str()}"])
        elif o.is_discrete_sweep():
            values.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:  # interval(...): a continuous range needs a sweeper that samples it
            raise ConfigError(
                f"{o.input_line}: an interval cannot be swept by the basic sweeper; sweep a list "
                "(a,b,c), choice(a,b,c) or range(start,stop,step)"
            )
    return [list(job) for job in itertools.product(*values)]


def _sweep_value(value) -> str:
    """A YAML list in a grid ([0.01, 0.05]) as the override syntax's a,b; anything else as written."""
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        return ",".join(str(v) for v in value)
    return str(value)


def compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """The config of `overrides`, composed with Hydra's compose API; also inside a running Hydra app (a sweep
    explaining a job it cannot compose), whose global state is put back as it was."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    GlobalHydra.instance().clear()  # (initialize_config_dir refuses to start while another Hydra is initialized)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose("config", overrides=overrides, return_hydra_config=return_hydra_config)
    finally:
        restore_gh_from_backup(backup)


def _composed_from(bases: dict, overrides: list[str], compose_fn) -> DictConfig:
    """`compose_fn(overrides)`, from the config its group choices make (composed once per choice, kept in `bases`)
    with its values set on a copy as Hydra sets them (`OmegaConf.update(..., merge=True)`, in the command's order,
    after the defaults list is composed): a sweep's jobs differ mostly in values (η, seeds, a knob), and Hydra's
    compose reads and merges every config file again for each (0.07 s a job: half a minute before the tuning
    sweep's 324 jobs could start). A job with an override of another form (+, ++, ~, a package), or with a value
    the shortcut cannot set (a key the config lacks, a wrong type), is composed by `compose_fn` whole: its result,
    or its error."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices, values = [], []
    for text, o in zip(overrides, parsed, strict=True):
        if o.package is not None or o.is_delete() or o.is_add() or o.is_force_add():
            # Hydra applies these among the values, in the command's order (++lr after lr=...): whole, not split
            return compose_fn(overrides)
        (choices if o.key_or_group in GROUPS or "/" in o.key_or_group else values).append((text, o))
    choice = tuple(text for text, _ in choices)
    try:
        if choice not in bases:
            bases[choice] = compose_fn(list(choice))
        cfg = copy.deepcopy(bases[choice])
        for _, o in values:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
    except Exception:  # noqa: BLE001 - Hydra's own compose says what is wrong, in its words
        return compose_fn(overrides)
    return cfg


def composed(overrides: list[str], compose_fn=None, bases: dict | None = None) -> DictConfig:
    """One job's config composed (by `compose_fn`, default `compose`); ConfigError with one line on bad input: an
    option a group does not have, a key no schema has, a value of the wrong type. `bases`: the configs of a
    sweep's group choices, shared by its jobs (`_composed_from`); None composes each job whole."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    unknown = None  # the first group option conf/ does not have: the line that lists the options it has
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.key_or_group in GROUPS and not o.is_delete():
            value = o.value()
            if isinstance(value, str) and value not in options(o.key_or_group):
                have = options(o.key_or_group)
                unknown = ConfigError(
                    f"{o.key_or_group}={value} is not an option; "
                    + (f"choose one of: {', '.join(have)}" if have else f"no {o.key_or_group} configs exist yet")
                )
                break
    # Hydra's own loader (a sweep's compose_fn) also searches `--config-dir`, where analysis.tune writes a held-out
    # stage's experiment: there an option conf/ lacks may compose, and only a failure to compose refuses it
    if unknown is not None and compose_fn is None:
        raise unknown
    overrides = [o for o in overrides if not o.startswith("hydra")]
    try:
        if bases is not None:
            return _composed_from(bases, overrides, compose_fn or compose)
        return (compose_fn or compose)(overrides)
    except Exception as e:  # composition errors: wrong types, unknown keys
        if unknown is not None:
            raise unknown from None
        line = one_line(e)
        group = line.split(".", 1)[0] if " is not a config key" in line else None
        if group in GROUPS:  # an unknown key inside a group: list the keys that group has
            choice = [o for o in overrides if o.split("=", 1)[0] == group]
            node = compose(choice)[group]
            what = f"{group}={node.name}" if "name" in node else group
            bad = line.split(" ", 1)[0]
            inner = bad.split(".")[1:-1]  # a key inside a nested node (logger.wandb.foo): that node's keys
            if inner and all(isinstance(node := node.get(p), DictConfig) for p in inner):
                what = ".".join([group, *inner])
            else:
                node = compose(choice)[group]
            arg = bad.split(".", 1)[1]
            line = f"{bad} is not a key of {what}; its keys are: {', '.join(node)}" + (
                " (lr, momentum and workers are top-level keys)"
                if group == "algorithm"
                else f" (+{bad}=<value> adds it: an argument {arg} of the {group}'s own constructor)"
                if group in ("model", "data") and not inner and node.get("_target_") is not None
                else ""
            )
        raise ConfigError(line) from None


def checked(cfg: DictConfig, here: bool = True) -> Spec:
    """`validate`, with OmegaConf's own errors (an interpolation that fails) as one line too."""
    try:
        return validate(cfg, here)
    except OmegaConfBaseException as e:
        raise ConfigError(one_line(e)) from None


def check_job(overrides: list[str], bases: dict | None = None) -> tuple[DictConfig, Spec]:
    """Compose and validate one job's config; raise ConfigError with one line on bad input. `bases`: as
    `composed`'s, for the jobs of one sweep."""
    cfg = composed(overrides, bases=bases)
    return cfg, checked(cfg)
