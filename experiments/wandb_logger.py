"""Weights & Biases, from the coordinating process only. Offline by default; it never hangs or fails a run.

- `offline`: the run is written under `<run_dir>/wandb/`; `wandb sync <run_dir>/wandb/offline-run-*` uploads it.
- `online`: only when an API key is configured (WANDB_API_KEY or ~/.netrc); otherwise it logs offline and
  says so. An online `wandb.init` that fails (no network: it gives up after 20 s) falls back to offline too,
  and later runs of the same sweep go offline at once. If even offline fails, the run goes on without W&B.
- `disabled`: nothing is imported or written.

The runner asks this module what a run is called and what it logs (`group`, `run_name`, `config` below;
docs/logging.md, "Weights and Biases"): the group is the experiment and the sweep's launch time
(`fig1 2026-11-21 13:52:44`), the name what the job's overrides set (`gem κ=2 n=10 s0`), the config every key with
its default filled in, plus the group choices and the experiment. Rows go out as `train/<column>` (every
`logger.wandb.log_every`-th commit row) and `eval/<column>` (every evaluation row, `eval/worker_step` included).
"""

from __future__ import annotations

import dataclasses
import json
import netrc
import os
import re
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gem.metrics import scalars


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger:
    def __init__(self, run):
        self.run = run
        self.last_step = -1
        # W&B drops a row whose step is below one already logged. On the process engine an evaluation is stamped
        # with the live clock, which can run ahead of the commit rows still on their way; such an evaluation waits
        # here until the commits before it are logged.
        self.waiting: list[dict] = []

    @property
    def where(self) -> str:
        url = getattr(self.run, "url", None)
        return url or str(Path(self.run.dir).parent)

    def __call__(self, kind: str, row: dict) -> None:
        step = int(row["step"])
        if kind != "commit" and step > self.last_step:
            self.waiting.append(row)
            return
        while self.waiting and int(self.waiting[0]["step"]) <= step:
            self._log("eval", self.waiting.pop(0))
        self._log(kind, row)

    def _log(self, kind: str, row: dict) -> None:
        data = scalars(kind, row)
        step = max(int(row["step"]), self.last_step)
        try:
            self.run.log(data, step=step)
            self.last_step = step
        except Exception:  # logging must never take a run down
            pass

    def finish(self, summary: dict | None = None, exit_code: int = 0) -> None:
        """Record the summary and close the run; a W&B failure here is reported, never raised."""
        for row in self.waiting:  # evaluations ahead of the last commit row logged (the final one, say)
            self._log("eval", row)
        self.waiting = []
        try:
            if summary:
                self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        except Exception as e:
            print(f"gem: W&B summary not recorded ({type(e).__name__}: {e})", file=sys.stderr)
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:
            print(f"gem: W&B finish failed ({type(e).__name__}: {e})", file=sys.stderr)


# Why W&B cannot be used as asked in this process, once that is known: later runs of a sweep then fall back at
# once instead of each paying the init timeout again.
_online_failed: str | None = None  # online init failed (no network, say): log offline from now on
_unavailable: str | None = None  # even offline init failed: no W&B in this process


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def start(
    mode: str, run_dir: Path, config: dict, project: str = "gem", entity=None, group=None, name: str | None = None
) -> WandbLogger | None:
    global _online_failed, _unavailable
    if mode == "disabled":
        return None
    if _unavailable is not None:
        print(f"gem: W&B is unavailable in this process ({_unavailable}); continuing without it", file=sys.stderr)
        return None
    if mode == "online" and not _has_api_key():
        print(
            "gem: logger.wandb.mode=online but no W&B API key is set (WANDB_API_KEY or ~/.netrc); "
            "logging offline instead",
            file=sys.stderr,
        )
        mode = "offline"
    if mode == "online" and _online_failed is not None:
        print(
            f"gem: W&B online failed earlier in this process ({_online_failed}); logging offline instead",
            file=sys.stderr,
        )
        mode = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        run = wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=config,
            reinit="create_new",
            settings=wandb.Settings(init_timeout=20, console="off", x_disable_stats=True),
        )
    except Exception as e:  # no network, bad key, W&B service failure: the run goes on regardless
        if mode == "online":
            _online_failed = _short(e)
            print(f"gem: W&B online could not start ({_online_failed}); logging offline instead", file=sys.stderr)
            return start("offline", run_dir, config, project, entity, group, name)
        _unavailable = _short(e)
        print(f"gem: W&B could not start ({_unavailable}); continuing without it", file=sys.stderr)
        return None
    return WandbLogger(run)


# ------------------------------------------- a run's group, its name and the config it logs (the runner asks)

# Hydra's default sweep and run directories end in <%Y-%m-%d>/<%H-%M-%S-%f>: the time the command was launched
_STAMPED = re.compile(r"(\d{4}-\d{2}-\d{2})/(\d{2})-(\d{2})-(\d{2})(?:-\d+)?")
_TIME = "%Y-%m-%d %H:%M:%S"
_launched: dict[str, str] = {}  # a custom sweep directory without multirun.yaml: its first job's time, per process
# Keys a run's W&B name leaves out: where things are written and how they are logged, not what is run
_UNNAMED = ("hydra", "logger", "data.root", "data.download", "experiment", "resume", "plan")
# Override keys shown under their names in the paper; other keys as written (algorithm.* without `algorithm.`)
_PAPER_TERMS = {
    "lr": "η",
    "momentum": "μ",
    "batch_size": "b",
    "algorithm.kappa": "κ",
    "algorithm.window": "λ",
    "algorithm.rho": "ρ",
    "algorithm.alpha": "α",
    "algorithm.beta": "β",
    "algorithm.pi_max": "π_max",
    "engine.cycle_cv": "cv",
}


def launch_time(folder: str | Path, multirun: bool) -> str:
    """When a sweep (or a single run) was launched, as '2026-11-21 13:52:44' (local time): read from the name of a
    directory that follows Hydra's default pattern (`multirun/2026-11-21/13-52-44-123456`), so that a sweep
    resumed in its directory keeps its time. A custom sweep directory: the earliest of the time Hydra wrote its
    multirun.yaml (at launch, before any job) and the times its jobs' `.hydra/` were written (Hydra rewrites
    multirun.yaml when a sweep is resumed; a finished job's `.hydra/` is left as it was, so a resumed sweep keeps
    its first launch's time), else the time of this process's first job in it. A custom single-run directory: now."""
    match = _STAMPED.fullmatch("/".join(Path(folder).parts[-2:]))
    if match:
        return f"{match[1]} {match[2]}:{match[3]}:{match[4]}"
    if not multirun:
        return datetime.now().strftime(_TIME)
    stamps = []
    for path in [Path(folder) / "multirun.yaml", *Path(folder).glob("*/.hydra/hydra.yaml")]:
        try:
            stamps.append(path.stat().st_mtime)
        except OSError:
            pass
    if stamps:
        return datetime.fromtimestamp(min(stamps)).strftime(_TIME)
    return _launched.setdefault(str(folder), datetime.now().strftime(_TIME))


def group(experiment: str | None, multirun: bool, folder: str | Path) -> str | None:
    """A sweep's W&B group: its experiment (`sweep` without one) and its launch time, `fig1 2026-11-21 13:52:44`.
    A single run is grouped only when it has an experiment (`fig1` and its time). `logger.wandb.group` wins."""
    if not multirun and not experiment:
        return None
    return f"{experiment or 'sweep'} {launch_time(folder, multirun)}"


def run_name(cfg: DictConfig, overrides: list[str]) -> str:
    """A run's W&B name: the algorithm, n (as asked), every other key its command or sweep sets, in the paper's
    terms where it has them, and the seed: `gem κ=2 n=10 s0`, `downpour n=5 η=0.01 s1`. Unique within a sweep,
    unless the sweep varies only the keys left out (`hydra.*`, `logger.*`, `data.root`...)."""
    algo, other = [], []
    for override in overrides:
        key, eq, value = override.partition("=")
        key = key.lstrip("+")
        if (
            not eq
            or key.startswith("~")
            or key in ("algorithm", "workers", "seed")
            or any(key == k or key.startswith(k + ".") for k in _UNNAMED)
        ):
            continue
        term = _PAPER_TERMS.get(key) or key.removeprefix("algorithm.")
        (algo if key.startswith("algorithm.") else other).append(f"{term}={value}")
    return " ".join([str(cfg.algorithm.name), *algo, f"n={cfg.workers}", *other, f"s{cfg.seed}"])


def config(spec, job, run_dir: Path, experiment: str | None, choices: dict | None = None) -> dict:
    """The config a W&B run logs: every key with its schema default filled in (the checked groups, the algorithm's
    full parameters under `algorithm`, less lr, momentum and workers, which are top-level keys), the group choices
    Hydra made (`choices`, without hydra/*; none for a run started from Python), the experiment and the run
    directory. `workers` is what runs (1 for
    a sequential algorithm), `workers_requested` what was asked; `loss` the one resolved for the model. Plain JSON
    values only. It never fails a run: on any error, the composed config as it is, with a line that says so."""
    try:
        return _config(spec, job, run_dir, experiment, choices or {})
    except Exception as e:  # noqa: BLE001 - W&B must never take a run down
        print(f"gem: W&B logs the composed config only ({type(e).__name__}: {e})", file=sys.stderr)
        return OmegaConf.to_container(spec.cfg, resolve=True)


def _config(spec, job, run_dir: Path, experiment: str | None, choices: dict) -> dict:
    from experiments import instantiate
    from experiments.schema import TOP_LEVEL_PARAMS, Config

    cfg = spec.cfg
    choices = {k: v for k, v in choices.items() if not k.startswith("hydra/")}
    groups = ("algorithm", "engine", "model", "data", "logger")
    config = {
        k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
        for k in (f.name for f in dataclasses.fields(Config))
        if k not in groups and k in cfg
    }
    data = {k: v for k, v in dataclasses.asdict(spec.data).items() if k != "_target_"}
    if instantiate.is_instantiated(cfg.data):  # a user's dataset class: its own keyword arguments as given
        data = {**OmegaConf.to_container(cfg.data, resolve=True), **data}
        data.pop("synthetic", None)
    model = {
        "name": job.model.name,
        **OmegaConf.to_container(cfg.model, resolve=True),
        "parameters": sum(p.numel() for p in spec.model.parameters()),
    }
    config.update(
        workers=job.workers,
        workers_requested=cfg.workers,
        loss=job.loss,
        algorithm={
            "name": job.algorithm,
            **{k: v for k, v in dataclasses.asdict(job.hp).items() if k not in TOP_LEVEL_PARAMS},
        },
        engine={**dataclasses.asdict(spec.engine), "checkpoint_every": spec.checkpoint_every},
        model=model,
        data=data,
        logger=dataclasses.asdict(spec.logger),
        experiment=experiment,
        choices=choices,
        run_dir=str(run_dir),
    )
    return json.loads(json.dumps(config, default=str))
