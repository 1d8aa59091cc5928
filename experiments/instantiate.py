"""Models and datasets from the config, by Hydra instantiation (`_target_`), as plain objects for gem.

- A model config is `_target_: <import path of a torch.nn.Module, or of a function returning one>` plus its
  keyword arguments. Built-in configs (conf/model/) pass `num_classes: ${data.num_classes}`. It becomes a
  `gem.models.ModelSpec` that any process can rebuild (spawned workers, distributed ranks).
- A data config is either a built-in loader (`name:` digits, mnist, cifar10, synthetic: gem.data) or
  `_target_: <a torchvision-style dataset class>`: it is built for each split, with `train_kwargs` (default
  `{train: true}`), `val_kwargs` (default null: a fixed `val_size` of the training split is held out) and
  `test_kwargs` (default `{train: false}`, the class's own test split; null: none), and read into memory once
  (gem.data.from_datasets).
  The keys gem reads itself (DATA_KEYS) are not passed to the class; every other key is.

Refusals are one line naming the key (ConfigError), raised before anything is written.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from gem import data as gdata
from gem import models

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# keys of a `_target_` data config that gem reads and does not pass to the dataset class. `name` and
# `synthetic` come from a built-in config under a `data._target_=...` override: ignored there.
DATA_KEYS = ("num_classes", "augment", "train_kwargs", "val_kwargs", "test_kwargs", "val_size", "name", "synthetic")
SPLIT_KWARGS = (("train_kwargs", {"train": True}), ("val_kwargs", None), ("test_kwargs", {"train": False}))


class ConfigError(ValueError):
    """One line for the user: which key is wrong and what is allowed (experiments.config re-exports it)."""


@functools.cache
def _targets(group: str) -> dict[str, str]:
    """`_target_` → the config option (conf/<group>/<option>.yaml) that names it."""
    out = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        if isinstance(target, str) and not target.startswith("???"):
            out.setdefault(target, path.stem)
    return out


def display_name(group: str, node: DictConfig) -> str:
    """What the run directory calls a model or dataset: the config option whose `_target_` it is, else the
    `_target_` itself (a user's class), else (built-in data loaders) its `name`."""
    target = node.get("_target_")
    if target is None:
        return str(node.get("name"))
    return _targets(group).get(str(target), str(target))


def is_instantiated(node: DictConfig) -> bool:
    return node.get("_target_") is not None


# --------------------------------------------------------------------------------------------- models


def model_spec(cfg: DictConfig) -> models.ModelSpec:
    """The model config as a spec gem can build anywhere: Hydra's `instantiate` on the resolved config, or, where
    that is the same call (a `_target_` gem can import, and keyword arguments that are plain values), the call
    itself: each worker process then builds its model without importing Hydra (a quarter of a second apiece)."""
    node = cfg.model
    if not is_instantiated(node):
        raise ConfigError(
            "model has no _target_; give model=<one of the configs in conf/model> or "
            "model._target_=<import path of a torch.nn.Module>"
        )
    config = OmegaConf.to_container(node, resolve=True)
    if (
        "num_classes" in config
        and _given_by_default(node, "num_classes")
        and not _takes(config["_target_"], "num_classes")
    ):
        del config["num_classes"]  # the group's default for gem's own models; this constructor has no such argument
    name = display_name("model", node)
    kwargs = {k: v for k, v in config.items() if k != "_target_"}
    plain = all(
        not k.startswith("_") and (v is None or isinstance(v, (str, int, float, bool))) for k, v in kwargs.items()
    )
    if plain:
        try:
            models.locate(config["_target_"])
        except ValueError:  # Hydra finds more than gem's locate does (a class's method, say): let it
            plain = False
    if plain:
        return models.ModelSpec(name, config["_target_"], kwargs)
    return models.ModelSpec(name, "hydra.utils.instantiate", {"config": config})


def worker_imports(cfg: DictConfig | None, argv: list[str]) -> set[str]:
    """The import paths an engine=distributed worker rank may take from its job (gem.engines.distributed.job):
    those its own command names. Under SLURM a worker has composed the command (`cfg`): its algorithm and its
    model's. Under torchrun it composes nothing, and every rank has the same command line (`argv`): the paths it
    gives a model (`model._target_=`, nested ones too) or an algorithm (`algorithm.name=`), and the `_target_`s of
    this machine's model configs (conf/model)."""
    from gem.engines.distributed.job import named_imports

    if cfg is not None:
        try:
            return named_imports(str(cfg.algorithm.name), model_spec(cfg))
        except ConfigError:
            return set()
    out = {t for path in (CONF_DIR / "model").glob("*.yaml") for t in _all_targets(OmegaConf.load(path))}
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        value = value.strip("'\"")
        if eq and ((key.startswith("model.") and key.endswith("._target_")) or key == "algorithm.name"):
            out.add(value)
    return out


def _all_targets(node) -> set[str]:
    """Every `_target_` of a config, nested ones included."""
    from gem.engines.distributed.job import import_targets

    return import_targets(OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node)


def _given_by_default(node: DictConfig, key: str) -> bool:
    """The key holds the model group's default, `${data.num_classes}`, rather than a value the user set."""
    return OmegaConf.to_container(node, resolve=False).get(key) == "${data.num_classes}"


def _takes(target: str, argument: str) -> bool:
    """Whether the callable at `target` accepts `argument` (by name, or through **kwargs); True where it cannot
    be told (the constructor then says so itself)."""
    import inspect

    try:
        params = inspect.signature(models.locate(target)).parameters.values()
    except (ValueError, TypeError):
        return True
    return any(p.name == argument or p.kind is p.VAR_KEYWORD for p in params)


def build_meta(cfg: DictConfig) -> torch.nn.Module:
    """The model's structure, nothing allocated: its parameter count, input shape and output kind. A model that
    cannot be built is one line naming model._target_."""
    spec = model_spec(cfg)
    try:
        module = models.build_model_meta(spec)
    except Exception as e:  # noqa: BLE001 - whatever the user's constructor raises
        raise ConfigError(_build_failed(cfg.model, e)) from None
    # θ is one flat vector whose size every process must know before training; a lazy layer (nn.LazyLinear, ...)
    # has no size until its first forward pass, so each process would find it on its own
    lazy = [name for name, p in module.named_parameters() if isinstance(p, torch.nn.parameter.UninitializedParameter)]
    if lazy:
        raise ConfigError(
            f"model._target_={cfg.model.get('_target_')} has lazy parameters ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): gem needs θ's size when the model is built; give "
            "those layers their input sizes (nn.Linear(in_features, ...) instead of nn.LazyLinear)"
        )
    return module


def _build_failed(node: DictConfig, e: Exception) -> str:
    cause = e
    while cause.__cause__ is not None:  # Hydra wraps the constructor's own error
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    args = ", ".join(k for k in node if k != "_target_")
    hint = f" (it is given {args}; remove a key with ~model.<key>, add one with +model.<key>=...)" if args else ""
    if isinstance(cause, ImportError):  # the module, not the keys: where Python looks for it
        hint = (
            " (Python cannot import it from here: put the folder that holds the module on PYTHONPATH, "
            "PYTHONPATH=<that folder> python run.py ..., or pip install its package)"
        )
    return (
        f"model._target_={node.get('_target_')} could not be built: {type(cause).__name__}: "
        f"{text[0] if text else ''}{hint}"
    )


def resolve_loss(cfg: DictConfig, module: torch.nn.Module) -> str:
    """`loss` as given, or (null) nll for a model that says it outputs log-probabilities, else cross_entropy."""
    loss = cfg.get("loss")
    if loss is None:
        return models.default_loss(module)
    if loss not in models.LOSSES:
        raise ConfigError(
            f"loss={loss} is not allowed; choose one of: {', '.join(models.LOSSES)} "
            "(nll: the model outputs log-probabilities; cross_entropy: logits)"
        )
    return str(loss)


@torch.no_grad()
def check_pairing(spec: models.ModelSpec, loss: str, dataset: gdata.Dataset, seed: int) -> None:
    """One forward pass on two training examples: the model must take the data's inputs, give one output per
    class, and, under loss=nll, give log-probabilities. Refused in one line otherwise."""
    torch.manual_seed(seed)
    module = models.build_model(spec).eval()
    x = dataset.train_x[:2].cpu()
    shape = "x".join(map(str, dataset.shape))
    try:
        out = module(x)
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"model={spec.name} cannot take data={dataset.name}'s {shape} inputs "
            f"({type(e).__name__}: {first}); pick a model and data that match"
        ) from None
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(x):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model={spec.name} gives outputs of shape {got} for a batch of {len(x)}; gem trains "
            "classifiers: the model must return (batch, classes) scores"
        )
    if out.shape[1] != dataset.num_classes:
        takes = "num_classes" in spec.kwargs or "num_classes" in spec.kwargs.get("config", {})
        fix = (
            f"set model.num_classes={dataset.num_classes}"
            if takes
            else f"give the model {dataset.num_classes} outputs (its constructor takes no num_classes)"
        )
        raise ConfigError(
            f"model={spec.name} has {out.shape[1]} outputs but data={dataset.name} has "
            f"{dataset.num_classes} classes; {fix}, or set data.num_classes if the data has "
            f"{out.shape[1]} classes"
        )
    if loss == "nll":
        lse = torch.logsumexp(out.float(), dim=1).abs().max().item()
        if lse > 1e-3:
            raise ConfigError(
                f"loss=nll needs log-probabilities, but model={spec.name}'s outputs are not (their "
                f"logsumexp is {lse:.3g} from 0): use loss=cross_entropy for a model that outputs "
                "logits"
            )


# ----------------------------------------------------------------------------------------------- data


def load_data(cfg: DictConfig) -> gdata.Dataset:
    """A torchvision-style dataset class by `data._target_`, in memory (the runner loads built-ins itself)."""
    node = cfg.data
    from hydra.utils import instantiate

    config = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in DATA_KEYS}
    name = display_name("data", node)
    splits = []
    for key, default in SPLIT_KWARGS:
        extra = node.get(key, default) if key in node else default
        extra = OmegaConf.to_container(extra, resolve=True) if isinstance(extra, DictConfig) else extra
        if extra is None:  # val: held out of the training split; test: none
            splits.append(None)
            continue
        try:
            splits.append(instantiate(config, **extra))
        except Exception as e:  # noqa: BLE001 - missing files, a wrong keyword, no internet
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            lines = [x.strip() for x in str(cause).strip().splitlines() if x.strip()] or [""]
            first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "Error downloading x:" + why
            raise gdata.DatasetMissing(
                f"data._target_={config.get('_target_')} ({key}={extra}) could not be "
                f"loaded: {type(cause).__name__}: {first}"
            ) from None
    try:
        train, val, test = splits
        return gdata.from_datasets(
            name,
            train,
            val,
            num_classes=int(node.get("num_classes", 10)),
            augment=bool(node.get("augment", False)),
            test=test,
            val_size=int(node.get("val_size", gdata.VAL_SIZE)),
        )
    except ValueError as e:
        raise ConfigError(f"data={name}: {e}") from None
