"""Runs and sweeps from Python (a notebook, a script), with the command line's overrides.

    from experiments.api import run, sweep

    r = run("algorithm=gem", "epochs=2")            # = python run.py algorithm=gem epochs=2, in this process
    r.summary["val_loss"], r.status                 # the run's summary.json
    r.metrics, r.evals                              # its commits and evaluations, as pandas frames
    runs = sweep("algorithm=gem,downpour", "seed=0,1")   # = python run.py -m ..., one row a job (analysis.load.runs)

Keyword arguments are overrides too: `run(algorithm="gem", workers=8)`; a class passed as `model=` or `data=`
becomes that group's `_target_`. Bad input raises `Refused` carrying the one line the command line prints, before
anything is written. A run goes through the same checks and the same runner (experiments.runner) as `python
run.py`; a sweep runs `python run.py -m` in a subprocess, so that it has the command's sweeper, launchers and
resume, and its output is shown as it comes.

Worker processes (engine=process, distributed) import the model and dataset classes by name: a class defined in a
notebook cell or a script's `__main__` cannot reach them, and is refused in one line that names the fix (a module
file). In a script, call these under `if __name__ == "__main__":` (worker processes are started from a fresh
interpreter that imports the script's main module).

This module sits above both experiments/ and analysis/: it is the one place in experiments/ that reads analysis/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd

from experiments import command, runner
from experiments.config import compose, composed, expand
from experiments.rundir import Refused
from experiments.runs import runs as runs_of
from experiments.schema import CONF_DIR
from gem.metrics import read_table

__all__ = ["Refused", "Run", "run", "sweep"]

RUN_PY = CONF_DIR.parent / "run.py"


@dataclass
class Run:
    """One run's directory, read back: its summary and its tables."""

    run_dir: Path
    summary: dict

    @property
    def status(self) -> str:
        return self.summary["status"]

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per commit: step (the clock t), worker, staleness, loss, time_s, and the algorithm's metrics."""
        return read_table(self.run_dir, "metrics")

    @property
    def evals(self) -> pd.DataFrame:
        """One row per evaluation: step, val_loss, val_accuracy, train_loss, train_accuracy."""
        return read_table(self.run_dir, "eval")

    @property
    def tensors(self) -> pd.DataFrame:
        """GEM's per-tensor π statistics, one row per commit and tensor (empty for other algorithms)."""
        return read_table(self.run_dir, "tensors")

    def __repr__(self) -> str:
        s = self.summary
        return (
            f"Run({s.get('status')}, {s.get('algorithm')} {s.get('engine')} n={s.get('workers')}, "
            f"val_loss={s.get('val_loss')}, run_dir='{self.run_dir}')"
        )


def _override(key: str, value) -> str:
    if isinstance(value, type):  # a class: the group's _target_
        return f"{key}._target_={value.__module__}.{value.__qualname__}"
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"{key}={value}"


def _argv(overrides: tuple[str, ...], values: dict) -> list[str]:
    for o in overrides:
        if not isinstance(o, str):
            raise Refused(f"{o!r} is not an override: pass strings such as 'workers=8', or keywords (workers=8)")
    return [*overrides, *(_override(k, v) for k, v in values.items())]


def _refusing(fn, *args):
    """fn(*args), or Refused with the line `python run.py` prints (experiments.command.refusal)."""
    try:
        return fn(*args)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - every error of a check is one line for the user
        raise Refused(command.refusal(e)) from None


def _importable_by_workers(cfg) -> None:
    """A worker process imports the model's and dataset's classes by name; one defined in `__main__` (a notebook
    cell, a script) is not there. Checked on the composed command, before its run directory is taken."""
    if cfg.engine.name == "sim":
        return
    for group in ("model", "data"):
        target = str(cfg[group].get("_target_") or "")
        if target.startswith("__main__."):
            raise Refused(
                f"{group}._target_={target}: a class defined in a notebook cell or a script's __main__ "
                f"cannot reach engine={cfg.engine.name}'s worker processes, which import it by name; put "
                f"the class in a module file (my{group}.py beside the notebook) and pass "
                f"{group}._target_=my{group}.{target.split('.', 1)[1]}, or use engine=sim"
            )


def run(*overrides: str, **values) -> Run | None:
    """One run, as `python run.py <overrides>` makes it, in this process. Returns the Run (also when it failed or
    diverged: see `status`); None for plan=true, which prints the plan. Raises Refused (one line) on bad input,
    before anything is written; KeyboardInterrupt (the kernel interrupted) closes the run directory first."""
    argv = _argv(overrides, values)
    _refusing(composed, command.base(argv))
    _refusing(expand, argv, False)  # a sweep's values: sweep()
    config = _refusing(compose, command.base(argv), True)
    if not config.plan:
        _importable_by_workers(config)
    spec = _refusing(command.check_run, config, False)
    if spec.cfg.plan:
        return None
    run_dir = Path(os.path.abspath(str(config.hydra.run.dir)))
    experiment = config.hydra.runtime.choices.get("experiment")
    # Refused (one line) where the directory or the data refuse; .hydra/ written as Hydra writes it
    summary = runner.run(spec, run_dir, experiment=experiment, hydra=config.hydra)
    print(runner.format_summary(summary), flush=True)
    return Run(run_dir, summary)


def sweep(*overrides: str, **values) -> pd.DataFrame:
    """A sweep, as `python run.py -m <overrides>` makes it (the command runs in a subprocess; its output is shown
    as it comes). Returns its runs, one row a job (experiments.runs.runs, which analysis.load re-exports: config and
    summary columns, `run_dir`). Raises Refused (one line) when the command refuses; a failed job is a row with its
    status, as on the command line. `hydra.sweep.dir=<folder>` names the sweep's folder (default:
    multirun/<date>/<time> here)."""
    argv = _argv(overrides, values)
    if not any(a.split("=", 1)[0] == "hydra.sweep.dir" for a in argv):
        argv.append(f"hydra.sweep.dir=multirun/{datetime.now():%Y-%m-%d/%H-%M-%S-%f}")
    sweep_dir = Path(os.path.abspath(next(a for a in argv if a.startswith("hydra.sweep.dir=")).split("=", 1)[1]))
    p = subprocess.Popen(
        [sys.executable, str(RUN_PY), "-m", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    errors = []
    try:
        for line in p.stdout:
            print(line, end="", flush=True)
            if line.startswith("error: "):
                errors.append(line[len("error: ") :].strip())
        code = p.wait()
    except KeyboardInterrupt:  # the command closes each run it has started (status failed) on SIGTERM
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
        raise
    if code == 2 and errors:
        raise Refused(errors[0])
    if code != 0 and not sweep_dir.exists():
        raise Refused(errors[0] if errors else f"python run.py -m exited with code {code}")
    if "plan=true" in argv:
        return runs_of([])
    return runs_of(sweep_dir)
