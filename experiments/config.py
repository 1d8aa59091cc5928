"""Config schema, validation, and the preflight check that runs before Hydra launches anything.

Bad input gets one clear line that names the key and what is allowed (DESIGN §4), before any data is loaded
or any process starts. The same `validate()` runs in the preflight (for every job of a sweep) and in each job.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments import instantiate
from experiments.instantiate import ConfigError
from gem import algorithms, engines, models
from gem import data as gdata
from gem.engines.sim import STALENESS_MODELS, TraceError, read_trace

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algorithm", "engine", "model", "data", "logger", "experiment")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class Config:
    """Top-level keys (DESIGN §4). Types here are enforced by Hydra when the config is composed."""

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
    epochs: int = MISSING  # full passes over the training set, per worker
    seed: int = MISSING
    device: str = MISSING
    loss: Any = MISSING  # nll | cross_entropy | null (the model's own: nll if it outputs log-probabilities)
    precision: str = MISSING  # fp32 | bf16 (the workers' forward and backward passes)
    resume: bool = MISSING
    plan: bool = MISSING  # list the jobs of the command and their estimated cost, run nothing (experiments.plan)


# Group schemas, checked by `validate` (the algorithm's own keys come from its module's Params dataclass).
@dataclass
class EngineConfig:
    name: str = "sim"
    staleness: str = "round_robin"
    straggler_fraction: float = 0.25
    straggler_slowdown: float = 4.0
    cycle_cv: float = 0.0  # gamma: coefficient of variation of a worker's cycle time (0: round robin, 1: exponential)
    trace: str = ""  # trace: the run directory of a process or distributed run whose cycle times are replayed
    checkpoint_every: int = 500  # commits between checkpoints; 0: none
    host: str = "127.0.0.1"  # engine=distributed, local launch: the address rank 0 listens on
    allow_remote: bool = False  # ... an address other than loopback needs this opt-in
    port: int = 0  # ... and its port; 0: a free one
    # process, distributed: a worker that has not committed for silent_cycles x the median time between commits
    # of a worker, and for at least timeout_s, is lost (killed, recorded; the run goes on with the others)
    timeout_s: float = 60.0
    silent_cycles: float = 10.0


@dataclass
class SyntheticConfig:
    num_classes: int = 10
    train_size: int = 5000
    val_size: int = 1000
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
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "gem"
    entity: Any = None
    group: Any = None
    log_every: int = 10  # commits between W&B rows (every evaluation row is logged)


@dataclass
class LoggerConfig:
    flush_every: int = 1000  # commit rows buffered before a parquet part is written
    flush_seconds: float = 30.0  # ... or seconds, whichever comes first
    eval_every: int = 100  # commits between evaluations of the central variable
    eval_train_size: int = 2048
    progress: bool = True
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)


GROUP_SCHEMAS = {"engine": EngineConfig, "data": DataConfig, "logger": LoggerConfig}  # model: any _target_


def per_worker(total: int, *, _root_: DictConfig) -> int:
    """`${per_worker:256}`: split a total evenly over the workers that will run (1 for a sequential algorithm).

    Experiments use it for a fixed effective batch (fig4: b = B/n with B = 256) and for the same data budget
    at every n (fig4, fig5: epochs per worker = total epochs / n)."""
    n = algorithms.workers_that_run(str(_root_.algorithm.get("name")), _root_.workers)
    if n < 1:
        raise ConfigError(f"workers={n} is not allowed; workers must be an integer >= 1")
    if int(total) % n:
        raise ConfigError(f"per_worker:{total} does not split evenly over workers={n}; "
                          f"pick workers that divide {total}")
    return int(total) // n


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
    OmegaConf.register_new_resolver("per_worker", per_worker, replace=True)


register()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _merge_checked(schema, node, prefix: str, what: str):
    """Merge a group's node into its dataclass schema; unknown keys and wrong types become ConfigError."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except OmegaConfBaseException as e:
        key = f"{prefix}.{e.full_key}" if getattr(e, "full_key", None) else prefix
        allowed = ", ".join(f.name for f in dataclasses.fields(schema))
        msg = str(e).splitlines()[0]
        if "not in struct" in msg or "Key '" in msg and "not" in msg:
            raise ConfigError(f"{key} is not a key of {what}; its keys are: {allowed}") from None
        raise ConfigError(f"{key}: {msg}") from None


# Params fields filled from top-level keys rather than from algorithm.*
TOP_LEVEL_PARAMS = ("lr", "momentum", "workers")


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
            raise ConfigError(f"algorithm.{k} is not a parameter of algorithm={name}; its parameters are: "
                              f"{allowed} (lr, momentum and workers are top-level keys)")
    top = {k: cfg[k] for k in TOP_LEVEL_PARAMS if k in fields}
    try:
        return _merge_checked(module.Params, {**node, **top}, "algorithm", f"algorithm={name}")
    except ValueError as e:  # Params.__post_init__ (gem.algorithms.require): already one line
        raise ConfigError(str(e).splitlines()[0]) from None


def validate(cfg: DictConfig) -> dict:
    """Raise ConfigError with one clear line on the first bad value. Cheap: loads no data.

    Returns the groups checked against their schemas (dataclass instances with every default filled in).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # `???` in a config (data=tensors: data.path, data.num_classes)
        raise ConfigError(f"{missing[0]} must be given: add {missing[0]}=<value> to the command")
    known = [f.name for f in dataclasses.fields(Config)]
    for key in cfg:
        if key not in known:  # `+foo=1` adds a key that nothing reads: refuse it rather than ignore it
            raise ConfigError(f"{key} is not a config key; top-level keys are: {', '.join(known)}")
    name = cfg.algorithm.get("name")
    if name not in algorithms.ALGORITHMS:
        raise ConfigError(f"algorithm={name} is not an algorithm; choose one of: {', '.join(algorithms.ALGORITHMS)}")
    for key, cond, allowed in (
        ("workers", cfg.workers >= 1, "an integer >= 1"),
        ("lr", 0 < cfg.lr < math.inf, "a finite number > 0"),
        ("momentum", 0 <= cfg.momentum < 1, "a number in [0, 1)"),
        ("batch_size", cfg.batch_size >= 1, "an integer >= 1"),
        ("epochs", cfg.epochs >= 1, "an integer >= 1"),
    ):
        if not cond:
            raise ConfigError(f"{key}={cfg[key]} is not allowed; {key} must be {allowed}")
    _check_device(cfg.device)
    if cfg.precision not in models.PRECISIONS:
        raise ConfigError(f"precision={cfg.precision} is not allowed; choose one of: {', '.join(models.PRECISIONS)} "
                          "(bf16: the workers' forward and backward passes; θ and the algorithms stay float32)")
    algorithm_params(cfg)
    checked = {g: _merge_checked(s, cfg[g], g, g) for g, s in GROUP_SCHEMAS.items() if g != "data"}
    checked["data"] = _check_data(cfg.data)
    eng, dat, log = checked["engine"], checked["data"], checked["logger"]
    if eng.name not in engines.ENGINES:
        raise ConfigError(f"engine={eng.name} is not an engine; choose one of: {', '.join(engines.ENGINES)}")
    if eng.staleness not in STALENESS_MODELS:
        raise ConfigError(f"engine.staleness={eng.staleness} is not allowed; choose one of: "
                          f"{', '.join(STALENESS_MODELS)}")
    if eng.name == "sim" and eng.staleness == "trace":
        if not eng.trace:
            raise ConfigError("engine.staleness=trace needs engine.trace=<the run directory of a process or "
                              "distributed run>")
        try:
            read_trace(eng.trace)
        except TraceError as e:
            raise ConfigError(str(e)) from None
        eng.trace = str(Path(eng.trace).resolve())  # the run records where it is, whatever directory resumes it
    elif eng.trace and eng.name == "sim":
        raise ConfigError(f"engine.trace is set but engine.staleness={eng.staleness}; add engine.staleness=trace to "
                          f"replay it")
    module = checked["model"] = instantiate.build_meta(cfg)
    checked["loss"] = instantiate.resolve_loss(cfg, module)
    fixed = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32), "fashion_mnist": (1, 28, 28), "cifar100": (3, 32, 32)}
    want = models.input_shape(module)
    if want is not None and dat.name in fixed and fixed[dat.name] != want:
        name = instantiate.display_name("model", cfg.model)
        raise ConfigError(f"model={name} expects {'x'.join(map(str, want))} inputs but data={dat.name} gives "
                          f"{'x'.join(map(str, fixed[dat.name]))}; pick a matching model")
    if log.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={log.wandb.mode} is not allowed; choose one of: {', '.join(WANDB_MODES)}")
    for key, value, cond, allowed in (
        ("logger.flush_every", log.flush_every, log.flush_every >= 1, "an integer >= 1"),
        ("logger.flush_seconds", log.flush_seconds, log.flush_seconds > 0, "a number > 0"),
        ("logger.eval_every", log.eval_every, log.eval_every >= 1, "an integer >= 1"),
        ("logger.eval_train_size", log.eval_train_size, log.eval_train_size >= 1, "an integer >= 1"),
        ("logger.wandb.log_every", log.wandb.log_every, log.wandb.log_every >= 1, "an integer >= 1"),
        ("engine.straggler_fraction", eng.straggler_fraction, 0 < eng.straggler_fraction <= 1, "a number in (0, 1]"),
        ("engine.straggler_slowdown", eng.straggler_slowdown, eng.straggler_slowdown >= 1, "a number >= 1"),
        ("engine.cycle_cv", eng.cycle_cv, 0 <= eng.cycle_cv <= 10, "a number in [0, 10] (0: round robin)"),
        ("engine.checkpoint_every", eng.checkpoint_every, eng.checkpoint_every >= 0, "an integer >= 0 (0: none)"),
        ("engine.port", eng.port, 0 <= eng.port <= 65535, "an integer in [0, 65535] (0: a free port)"),
        ("engine.timeout_s", eng.timeout_s, eng.timeout_s > 0, "a number of seconds > 0"),
        ("engine.silent_cycles", eng.silent_cycles, eng.silent_cycles > 0, "a number > 0"),
        ("data.synthetic.train_size", dat.synthetic.train_size, dat.synthetic.train_size >= 1, "an integer >= 1"),
        ("data.synthetic.val_size", dat.synthetic.val_size, dat.synthetic.val_size >= 1, "an integer >= 1"),
        ("data.synthetic.num_classes", dat.synthetic.num_classes, dat.synthetic.num_classes >= 2, "an integer >= 2"),
    ):
        if not cond:
            raise ConfigError(f"{key}={value} is not allowed; it must be {allowed}")
    _check_launch(cfg, eng.name)
    if eng.name == "distributed":  # the address a local launch listens on: refused before any run directory exists
        try:
            engines.get(eng.name).check_address(eng.host, eng.port, eng.allow_remote)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check_memory(cfg, eng.name, dat, module)
    return checked


def _check_device(device: str) -> None:
    """cpu, cuda (the workers spread over the visible GPUs) or cuda:N (all on GPU N), which must be visible."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device={device} is not allowed; use cpu, cuda (workers spread over the visible GPUs) "
                          "or cuda:N (all workers on GPU N)")
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"device={device}: no CUDA device is visible on this machine (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use device=cpu")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise ConfigError(f"device={device}: this machine has {count} visible CUDA device(s), cuda:0 to "
                          f"cuda:{count - 1}; use one of them, or device=cuda to spread the workers over all")


def _check_data(node: DictConfig) -> DataConfig:
    """A built-in dataset's keys against DataConfig; a `_target_` dataset's own keys go to its class unchecked,
    gem's (experiments.instantiate.DATA_KEYS) are checked here."""
    if not instantiate.is_instantiated(node):
        dat = _merge_checked(DataConfig, OmegaConf.to_container(node, resolve=True), "data", "data")
        if dat.name not in gdata.DATASETS:
            raise ConfigError(f"data={dat.name} is not a dataset; choose one of: {', '.join(gdata.DATASETS)}, or "
                              "data._target_=<a torchvision-style dataset class>")
        if dat.synthetic.task not in gdata.SYNTHETIC_TASKS:
            raise ConfigError(f"data.synthetic.task={dat.synthetic.task} is not allowed; choose one of: "
                              f"{', '.join(gdata.SYNTHETIC_TASKS)}")
        if not 0 <= dat.synthetic.snr < math.inf:
            raise ConfigError(f"data.synthetic.snr={dat.synthetic.snr} is not allowed; it must be a number >= 0")
        if dat.name == "synthetic" and dat.num_classes != dat.synthetic.num_classes:
            raise ConfigError(f"data.num_classes={dat.num_classes} but data.synthetic.num_classes="
                              f"{dat.synthetic.num_classes}; set data.synthetic.num_classes")
        return dat
    target = node.get("_target_")
    try:
        models.locate(str(target))
    except ValueError as e:
        raise ConfigError(f"data._target_={target}: {e}") from None
    num_classes, augment = node.get("num_classes", 10), node.get("augment", False)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
        raise ConfigError(f"data.num_classes={num_classes} is not allowed; it must be an integer >= 2")
    if not isinstance(augment, bool):
        raise ConfigError(f"data.augment={augment} is not allowed; it must be true or false")
    for key in ("train_kwargs", "val_kwargs"):
        if node.get(key) is not None and not isinstance(node.get(key), DictConfig):
            raise ConfigError(f"data.{key} must be a mapping of keyword arguments, such as {{train: true}}")
    root = node.get("root")
    return DataConfig(name=instantiate.display_name("data", node), root=root if isinstance(root, str) else "data",
                      download=bool(node.get("download", False)), augment=augment, num_classes=num_classes)


def _check_memory(cfg: DictConfig, engine: str, dat, module) -> None:
    """Refuse a run that cannot fit in this machine's memory (gem.engines.memory says how it is estimated)."""
    import torch

    from gem.engines import distributed, memory

    if distributed.launched():
        return  # the launcher placed the ranks, possibly on other machines
    algo = algorithms.get(cfg.algorithm.name)
    n = algorithms.workers_that_run(cfg.algorithm.name, cfg.workers)
    params = sum(p.numel() for p in module.parameters())  # `module` is on the meta device: shapes only
    hp = algorithm_params(cfg)
    with torch.device("meta"):
        state = len(algo.init_state(torch.empty(params), hp))
        # the server's own tensors (DC-ASGD: a backup of θ per worker), held once; on distributed every worker's
        # replica of the server holds them too
        server = sum(v.numel() for v in algo.server_state(torch.empty(params), hp, n).values()) * memory.FLOAT
    server_each = server if engine == "distributed" else 0
    train = gdata.train_size(dat.name, data_root(dat.root), dat.synthetic.train_size) or 0
    each = memory.per_worker(engine, params, state, train) + server_each
    once = server + memory.once(engine)
    have = memory.available()
    if have is None or n * each + once <= have:
        return
    what = "virtual workers" if engine == "sim" else "worker processes"
    server_part = f" and the server's {memory.gib(server)}" if server > params * memory.FLOAT else ""
    raise ConfigError(f"workers={n} is too many for this machine: engine={engine} needs at least "
                      f"{memory.gib(n * each + once)} ({n} {what} of {memory.gib(each)} each{server_part}) but "
                      f"{memory.gib(have)} is available; use at most workers={max(1, (have - once) // each)}")


def _check_launch(cfg: DictConfig, engine: str) -> None:
    """Under torchrun (or SLURM via submitit) the launcher fixes the number of processes: rank 0 is the
    parameter server and every other rank a worker."""
    from gem.engines import distributed

    if not distributed.launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return
    world = int(os.environ["WORLD_SIZE"])
    if engine != "distributed":
        raise ConfigError(f"engine={engine}: this process is one of {world} started by a launcher (torchrun); "
                          f"only engine=distributed runs that way; pass engine=distributed, or use python run.py")
    workers = algorithms.workers_that_run(cfg.algorithm.name, cfg.workers)
    if workers + 1 != world:
        raise ConfigError(f"workers={workers} does not match the {world} processes the launcher started: "
                          f"engine=distributed needs workers + 1 (rank 0 is the parameter server); pass "
                          f"workers={world - 1} or start {workers + 1} processes (--nproc_per_node)")


def check_batch_size(batch_size: int, data: str, train: int | None) -> None:
    """batch_size must fit in a worker's shard: every worker draws from all `train` examples. The preflight
    checks it once the data is on disk (where the size is cheap to read); the runner checks it after loading."""
    if train is not None and batch_size > train:
        raise ConfigError(f"batch_size={batch_size} is larger than a worker's shard: data={data} has "
                          f"{train} training examples, and every worker draws from all of them")


# ------------------------------------------------------------------------------------------ preflight


def _one_line(exc: Exception) -> str:
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
        return f"{bad} is not a config key; top-level keys are: {', '.join(f.name for f in dataclasses.fields(Config))}"
    return f"{key}: {first}" if key and key not in first else first


def expand(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of every job a command would launch, including an experiment's sweeper params."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        for o in parsed:
            if o.is_sweep_override():
                raise ConfigError(f"{o.input_line} is a sweep; add -m (--multirun) to run one job per value")
        return [overrides]
    base = [o.input_line for o in parsed if not o.is_sweep_override()]
    hcfg = compose(base, return_hydra_config=True)
    params = OmegaConf.select(hcfg, "hydra.sweeper.params") or {}
    extra = [f"{k}={v}" for k, v in params.items()]
    every = parser.parse_overrides(extra + overrides)
    # later overrides (the command line) win over the experiment's, as in Hydra's own sweeper
    by_key = {}
    for o in every:
        by_key[o.key_or_group] = o
    jobs = BasicSweeper.split_arguments(list(by_key.values()), None)
    return [job for batch in jobs for job in batch]


def single_run_note(overrides: list[str]) -> str | None:
    """`python run.py experiment=fig1` without -m runs one job, not the figure's sweep. That is legitimate (one
    run with an experiment's settings), but worth a line."""
    if not any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in overrides):
        return None
    params = OmegaConf.select(compose(overrides, return_hydra_config=True), "hydra.sweeper.params") or {}
    if not params:
        return None
    swept = " ".join(f"{k}={v}" for k, v in params.items())
    return f"gem: note: this experiment sweeps {swept}; without -m only one job runs. Add -m to run the whole sweep."


def compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=return_hydra_config)


def check_job(overrides: list[str]) -> tuple[DictConfig, dict]:
    """Compose and validate one job's config; raise ConfigError with one line on bad input."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for o in OverridesParser.create().parse_overrides(overrides):
        if o.key_or_group in GROUPS and not o.is_delete():
            value = o.value()
            if isinstance(value, str) and value not in options(o.key_or_group):
                have = options(o.key_or_group)
                raise ConfigError(f"{o.key_or_group}={value} is not an option; " + (
                    f"choose one of: {', '.join(have)}" if have else f"no {o.key_or_group} configs exist yet"))
    overrides = [o for o in overrides if not o.startswith("hydra")]
    try:
        cfg = compose(overrides)
    except Exception as e:  # composition errors: wrong types, unknown keys
        line = _one_line(e)
        group = line.split(".", 1)[0] if " is not a config key" in line else None
        if group in GROUPS:  # an unknown key inside a group: list the keys that group has
            choice = [o for o in overrides if o.split("=", 1)[0] == group]
            node = compose(choice)[group]
            what = f"{group}={node.name}" if "name" in node else group
            line = (f"{line.split(' ', 1)[0]} is not a key of {what}; its keys are: {', '.join(node)}"
                    + (" (lr, momentum and workers are top-level keys)" if group == "algorithm" else ""))
        raise ConfigError(line) from None
    try:
        return cfg, validate(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None


def preflight(argv: list[str]) -> list[str]:
    """Validate every job of the command and its run directories before Hydra starts; on bad input print one
    line and exit 2, with nothing written. Returns the command line for Hydra: the run (or sweep) directory
    resolved here is passed on, so that Hydra uses the very directory that was checked (and, for one run,
    locked: see experiments.rundir)."""
    from hydra._internal.utils import get_args_parser

    from experiments.rundir import Refused

    try:
        args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return argv  # let Hydra report its own usage errors
    from gem.engines import distributed

    if args.multirun and distributed.launched() and int(os.environ["WORLD_SIZE"]) > 1:
        if distributed.launched_rank() == 0:
            print("error: -m under torchrun: one torchrun runs one job of engine=distributed; sweep with "
                  "hydra/launcher=submitit_slurm (one SLURM job per run), or run the sweep without torchrun "
                  "(python run.py -m engine=distributed workers=N ... launches each run's workers itself)",
                  file=sys.stderr)
        sys.exit(2)
    if args.cfg and args.multirun:
        print(f"error: --cfg with -m: Hydra prints the config of one job, not a sweep's; drop -m to print one "
              f"job's config (python run.py <overrides> --cfg {args.cfg}), or add plan=true to list every job "
              "of the sweep and its cost", file=sys.stderr)
        sys.exit(2)
    missing = _missing_launcher(args.overrides)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        sys.exit(2)
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.config_name \
            or args.config_path or args.config_dir or args.experimental_rerun:
        return argv
    try:
        available, jobs, overrides = set(), [], []
        for job in expand(args.overrides, args.multirun):
            cfg, checked = check_job(job)
            jobs.append((cfg, checked))
            overrides.append(job)
            d = checked["data"]
            key = (d.name, data_root(d.root), d.download)
            if key not in available:  # download or fail once per dataset, before any job starts
                gdata.ensure_available(*key)
                available.add(key)
            check_batch_size(cfg.batch_size, d.name, gdata.train_size(d.name, key[1], d.synthetic.train_size))
        if any(cfg.plan for cfg, _ in jobs):
            from experiments import plan

            # a sweep's folder is checked as the real command would check it (a single run's is not: checking it
            # takes it); with resume=true the plan says what happens to each job
            actions = _check_directories(args, jobs)[1] if args.multirun else None
            plan.show([(o, cfg, checked) for o, (cfg, checked) in zip(overrides, jobs, strict=True)],
                      actions=actions)
            sys.exit(0)
        argv = argv + [_check_directories(args, jobs)[0]]
        note = None if args.multirun else single_run_note(args.overrides)
        if note:
            print(note, file=sys.stderr)
        return argv
    except (ConfigError, gdata.DatasetMissing, Refused) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OmegaConfBaseException as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a malformed override, say: Hydra's first line is clear enough
        msg = str(e).strip().splitlines()
        print(f"error: {msg[0] if msg else type(e).__name__}", file=sys.stderr)
        sys.exit(2)


# hydra/launcher options and the extra that installs their plugin
LAUNCHER_EXTRAS = {"joblib": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
                   **{name: ("hydra_plugins.hydra_submitit_launcher", "slurm")
                      for name in ("submitit_local", "submitit_slurm", "distributed_local", "distributed_slurm")}}


def _missing_launcher(overrides: list[str]) -> str | None:
    """`hydra/launcher=joblib` without its plugin installed: the line that says how to install it."""
    import importlib.util

    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") != "hydra/launcher" or value not in LAUNCHER_EXTRAS:
            continue
        module, extra = LAUNCHER_EXTRAS[value]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            return (f"hydra/launcher={value} needs a Hydra launcher plugin that is not installed; install it with "
                    f"pip install -e \".[{extra}]\" (in this project's folder)")
    return None


def _check_directories(args, jobs: list) -> tuple[str, list[str] | None]:
    """One run: take its directory (the lock is held until this process exits) and check the command can run
    there. A sweep: check that no job's directory is in use or holds results (unless resume=true). Returns the
    override that fixes the directory for Hydra (its `${now:...}` would otherwise be resolved again), and, for a
    sweep resumed with resume=true, what happens to each job (experiments.rundir.sweep_action)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments import rundir

    parsed = OverridesParser.create().parse_overrides(args.overrides)
    hydra = compose([o.input_line for o in parsed if not o.is_sweep_override()], return_hydra_config=True).hydra
    if not args.multirun:
        run_dir = os.path.abspath(str(hydra.run.dir))
        rundir.check_run_dir(*jobs[0], Path(run_dir))
        return f"hydra.run.dir={_quoted(run_dir)}", None
    sweep_dir = os.path.abspath(str(hydra.sweep.dir))
    numbered = OmegaConf.to_container(hydra.sweep, resolve=False).get("subdir") == "${hydra.job.num}"
    if any(cfg.resume for cfg, _ in jobs):
        if not numbered:
            raise rundir.Refused("resume=true with -m needs the sweep's jobs in numbered folders "
                                 "(hydra.sweep.subdir=${hydra.job.num}, the default)")
        return f"hydra.sweep.dir={_quoted(sweep_dir)}", _plan_resume(Path(sweep_dir), jobs)
    if numbered:
        for num in range(len(jobs)):
            job_dir = Path(sweep_dir) / str(num)
            if rundir.in_use(job_dir):
                raise rundir.Refused(f"hydra.sweep.dir={sweep_dir}: job {num}'s directory {job_dir} is in use by "
                                     "another run that is still going; pick another sweep directory")
            st = rundir.status(job_dir)
            if st is not None:  # results are never overwritten
                raise rundir.Refused(f"hydra.sweep.dir={sweep_dir} already holds a sweep: job {num}'s directory "
                                     f"holds a run (status {st}); add resume=true to finish that sweep (the "
                                     "identical -m command), or pick a new sweep directory")
    return f"hydra.sweep.dir={_quoted(sweep_dir)}", None


def _plan_resume(sweep_dir: Path, jobs: list) -> list[str]:
    """`-m ... resume=true`: say what happens to each job (experiments.rundir.sweep_action), or refuse the
    whole command before anything runs."""
    from experiments import rundir

    if not sweep_dir.is_dir():
        raise rundir.Refused(f"resume=true: hydra.sweep.dir={sweep_dir} does not exist; resuming a sweep needs "
                             "hydra.sweep.dir=<the folder of the sweep to finish> and the identical -m command")
    actions, by = [], {}
    for num, (cfg, checked) in enumerate(jobs):
        action, why = rundir.sweep_action(cfg, checked, sweep_dir / str(num), num)
        actions.append(action)
        by.setdefault(action, []).append((num, why))
    words = {"skip": "finished (skipped, left as they are)", "resume": "resume from the last checkpoint",
             "rerun": "rerun (stopped before a checkpoint; their files move to .superseded/)", "new": "start"}
    parts = []
    for a in (a for a in words if a in by):
        # the reasons of a resume or rerun say something per job; finished and new jobs are listed as ranges
        listed = (", ".join(f"{num} ({why})" for num, why in by[a]) if a in ("resume", "rerun")
                  else _ranges([num for num, _ in by[a]]))
        parts.append(f"job{'s' if len(by[a]) > 1 else ''} {listed}: {words[a]}")
    print(f"gem: resuming the sweep in {sweep_dir}: " + "; ".join(parts), file=sys.stderr)
    return actions


def _ranges(nums: list[int]) -> str:
    """[0, 1, 2, 3, 7, 9, 10] -> '0-3, 7, 9-10'."""
    out, start = [], None
    for i, n in enumerate(nums):
        start = n if start is None else start
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def _quoted(path: str) -> str:
    """A path as one Hydra override value, whatever characters it holds."""
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def data_root(root: str) -> str:
    return os.path.abspath(os.path.expanduser(root))
