"""The command line, `python run.py [-m] <overrides>`: its jobs checked before any of them runs, and Hydra's side
of a run.

A command flows one way, and each job's config is validated once, into a Spec (experiments.config):

    run.py   precheck(argv)     what Hydra cannot refuse in one line: a sweep under torchrun, --cfg with -m, a
                                launcher plugin that is not installed, a config that does not compose
    Hydra    composes the command, then
               one run:  `Checks.on_run_start` (a Hydra Callback; it runs before Hydra makes the run directory):
                         `check_run`: the Spec, its data, plan=true, the run directory taken (experiments.rundir)
               a sweep:  the gem sweeper (hydra_plugins/gem_sweeper): `check_sweep`: every job's Spec, their
                         data, plan=true, the sweep's folder taken (experiments.rundir), its jobs' folders and
                         what resume=true does with each job
             launches each job: `main(cfg)`, the task function, takes the Spec checked above (`_ready`) and hands
             it to experiments.runner, which builds the Job, runs the engine and writes the run directory.

`preflight(argv)` makes all of these checks in this process and runs nothing (what the tests call).

What is written by hand here, and why: Hydra has no public parser of its command line (`parse` reads Hydra's
documented flags with argparse), and none of its extension points runs before it composes the command, whose
errors it prints as a traceback (`precheck` composes first with Hydra's compose API).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from experiments import plan, rundir, runner, wandb_logger
from experiments.config import (
    ConfigError,
    Spec,
    budget_of,
    check_batch_size,
    check_launch,
    checked,
    compose,
    composed,
    data_root,
    expand,
    one_line,
)
from experiments.job import check_length
from experiments.rundir import Refused
from gem import data as gdata
from gem.engines.distributed.group import ranges

# The Specs checked for the jobs Hydra is about to launch in this process, by their overrides: main() takes its
# job's Spec from here. A launcher that runs jobs in other processes (joblib, submitit) finds none there, and
# main() checks its job itself.
_ready: dict[tuple[str, ...], Spec] = {}


# ------------------------------------------------------------------------------------ before Hydra starts


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # not ours to report: Hydra parses the same line and says what is wrong
        raise ValueError(message)


# Hydra's flags that take a value (`--cfg job`)
_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def parse(argv: list[str]) -> argparse.Namespace | None:
    """Hydra's command line: its flags (as `python run.py --hydra-help` lists them) and the overrides. None when
    it does not parse; Hydra then says why."""
    try:
        return _parser().parse_args(argv)
    except ValueError:
        return None


def _flags_between_overrides(argv: list[str]) -> str | None:
    """`python run.py engine=sim -m seed=0,1`: Hydra's parser takes the overrides only before and after its flags,
    not on both sides, and says `unrecognized arguments: seed=0,1`, which names the override and not the flag.
    The line that says so, with the command put in order; None for any other command."""
    try:
        _parser().parse_intermixed_args(argv)
    except (ValueError, TypeError):
        return None
    flags, overrides, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-"):
            overrides.append(token)
        elif token in _VALUE_FLAGS + ("--experimental-rerun",) and i + 1 < len(argv):
            flags += argv[i : i + 2]
            i += 1
        else:
            flags.append(token)
        i += 1
    return (
        "Hydra reads its flags (-m, --cfg, ...) before the overrides or after them, not between them; "
        f"put them first: python run.py {' '.join(flags + overrides)}"
    )


def _parser() -> _Parser:
    p = _Parser(add_help=False, allow_abbrev=False)
    p.add_argument("overrides", nargs="*")
    for flags in (
        ("--help", "-h"),
        ("--hydra-help",),
        ("--version",),
        ("--resolve",),
        ("--run", "-r"),
        ("--multirun", "-m"),
        ("--shell-completion", "-sc"),
    ):
        p.add_argument(*flags, action="store_true")
    for flags in (
        ("--cfg", "-c"),
        ("--package", "-p"),
        ("--config-path", "-cp"),
        ("--config-name", "-cn"),
        ("--config-dir", "-cd"),
        ("--experimental-rerun",),
    ):
        p.add_argument(*flags)
    p.add_argument("--info", "-i", nargs="?", const="all")
    return p


def precheck(argv: list[str]) -> argparse.Namespace | None:
    """What must be refused before Hydra composes the command (one line, exit 2). Returns the parsed command, or
    None for one that Hydra answers by itself (--help, --cfg, --info, another config...)."""
    args = parse(argv)
    if args is None:
        between = _flags_between_overrides(argv)
        if between:
            _refuse(between)
        return None
    from gem.engines import distributed

    if args.multirun and distributed.launched() and int(os.environ["WORLD_SIZE"]) > 1:
        if distributed.launched_rank() == 0:
            print(
                "error: -m under torchrun: one torchrun runs one job of engine=distributed; sweep with "
                "hydra/launcher=submitit_slurm (one SLURM job per run), or run the sweep without torchrun "
                "(python run.py -m engine=distributed workers=N ... launches each run's workers itself)",
                file=sys.stderr,
            )
        sys.exit(2)
    if args.cfg and args.multirun:
        _refuse(
            f"--cfg with -m: Hydra prints the config of one job, not a sweep's; drop -m to print one job's "
            f"config (python run.py <overrides> --cfg {args.cfg}), or add plan=true to list every job of the "
            "sweep and its cost"
        )
    missing = (
        _missing_launcher(args.overrides)
        or _hydra_refusal(args.overrides)
        or (args.config_dir and not args.config_path and _shadowed(args.config_dir, args.overrides))
    )
    if missing:
        _refuse(missing)
    if (
        args.help
        or args.hydra_help
        or args.version
        or args.cfg
        or args.info
        or args.shell_completion
        or args.config_name
        or args.config_path
        or args.config_dir
        or args.experimental_rerun
    ):
        return None
    refusing(composed, base(args.overrides))  # what every job shares; the sweeper composes each job of a sweep
    if not args.multirun:
        refusing(expand, args.overrides, False)  # a sweep without -m
    return args


def preflight(argv: list[str]) -> list[Spec] | None:
    """Every check `python run.py <argv>` makes before a job runs, made in this process: one line and exit 2 on bad
    input, the plan and exit 0 for plan=true. Returns the jobs' Specs (None for a command Hydra answers by itself).
    A single run's directory, or a sweep's folder, is taken (held by this process), as the real command takes it."""
    args = precheck(argv)
    if args is None:
        return None
    jobs = refusing(expand, args.overrides, args.multirun)
    config = refusing(compose, base(args.overrides), True)
    if not args.multirun:
        return [refusing(check_run, config)]
    return refusing(check_sweep, config, jobs)


def base(overrides: list[str]) -> list[str]:
    """The command's overrides that are not sweeps: what every job shares."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_sweep_override()]
    except Exception:  # noqa: BLE001 - a malformed override: composed() gives its one line
        return overrides


# hydra/launcher options and the extra that installs their plugin
LAUNCHER_EXTRAS = {
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    **{
        name: ("hydra_plugins.hydra_submitit_launcher", "slurm")
        for name in ("submitit_local", "submitit_slurm", "distributed_local", "distributed_slurm")
    },
}


def launcher_installed(name: str) -> bool:
    """Whether `hydra/launcher=<name>` has its plugin installed (one of LAUNCHER_EXTRAS; any other is Hydra's
    own or the repository's): analysis.tune suggests joblib only where it is."""
    import importlib.util

    if name not in LAUNCHER_EXTRAS:
        return True
    module = LAUNCHER_EXTRAS[name][0]
    return importlib.util.find_spec(module.split(".")[0]) is not None and importlib.util.find_spec(module) is not None


def _missing_launcher(overrides: list[str]) -> str | None:
    """`hydra/launcher=joblib` without its plugin installed: the line that says how to install it."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") != "hydra/launcher" or value not in LAUNCHER_EXTRAS:
            continue
        extra = LAUNCHER_EXTRAS[value][1]
        if not launcher_installed(value):
            return (
                f"hydra/launcher={value} needs a Hydra launcher plugin that is not installed; install it with "
                f'pip install -e ".[{extra}]" (in this project\'s folder)'
            )
    return None


def _shadowed(config_dir: str, overrides: list[str]) -> str | None:
    """`--config-dir D experiment=x` where conf/ has an experiment/x.yaml too: Hydra would take conf/'s, silently
    running another config than D's (a tuning sweep's held-out stage ran the repository's n = 10 one this way). Each
    option a group override names counts: a sweep's (x,y; choice(...)), a list's, a quoted one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.schema import CONF_DIR

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a command Hydra cannot parse: Hydra says why
        return None
    for o in parsed:
        group = o.key_or_group
        if o.is_delete() or "." in group:
            continue
        if o.is_sweep_override():
            names = list(o.sweep_string_iterator()) if o.is_discrete_sweep() else []
        else:
            value = o.value()
            names = [str(v) for v in value] if isinstance(value, list) else [str(value)]
        for name in names:
            theirs, ours = Path(config_dir) / group / f"{name}.yaml", CONF_DIR / group / f"{name}.yaml"
            if theirs.is_file() and ours.is_file() and theirs.resolve() != ours.resolve():
                return (
                    f"{group}={name}: both --config-dir {config_dir} and the repository's conf/ hold "
                    f"{group}/{name}.yaml, and Hydra would take the repository's ({ours}); rename {theirs} and pass "
                    "its new name"
                )
    return None


def _hydra_refusal(overrides: list[str]) -> str | None:
    """An override of Hydra's own config (`hydra/launcher=foo`, `hydra.launcher.n_jobs=2` under the basic launcher,
    `hydra.job.chdir=maybe`) that Hydra would answer with several lines and exit code 1: its one line. Composed
    only when the command has such overrides (50 ms)."""
    from hydra.errors import MissingConfigException

    mine = [o for o in overrides if re.split(r"[./=]", o.lstrip("+~"), maxsplit=1)[0] == "hydra"]
    swept = [o for o in mine if o not in base(mine)]
    if swept:
        return f"{swept[0]}: Hydra's own keys cannot be swept; give one value (one command per value)"
    if not mine:
        return None
    try:
        compose(mine, return_hydra_config=True)
        return None
    except MissingConfigException as e:  # an option its group does not have
        group, _, value = str(e.missing_cfg_file or "").rpartition("/")
        if group and e.options:
            return f"{group}={value} is not an option; choose one of: {', '.join(e.options)}"
        return refusal(e)
    except Exception as e:  # noqa: BLE001 - every error of Hydra's config is one line
        cause = e.__cause__
        if not isinstance(cause, OmegaConfBaseException):
            return refusal(e)
        key, first = getattr(cause, "full_key", None) or "hydra", str(cause).strip().splitlines()[0]
        if "not in" not in first:
            return f"{key}: {first}"
        if key.startswith("hydra.launcher."):
            return (
                f"{key} is not a key of the launcher this command uses ({first}); choose the launcher that has it "
                "on the same command (hydra/launcher=joblib for hydra.launcher.n_jobs, submitit_slurm, ...)"
            )
        return f"{key} is not a key of Hydra's config ({first}); python run.py --cfg hydra shows its keys"


def _refuse(line: str):
    try:
        print(f"error: {line}", file=sys.stderr)
    except OSError:  # stderr closed (`plan=true 2>&1 | head`): exit all the same, before Hydra makes the run directory
        pass
    sys.exit(2)


def refusal(e: Exception) -> str:
    """The one line that says why a check refused (experiments.api raises it, the command line prints it)."""
    if isinstance(e, (ConfigError, gdata.DatasetMissing, Refused)):
        return str(e)
    if isinstance(e, OmegaConfBaseException):
        return one_line(e)
    msg = str(e).strip().splitlines()  # a malformed override, say: Hydra's first line is clear enough
    return msg[0] if msg else type(e).__name__


def refusing(fn, *args):
    """fn(*args), or one line and exit 2 on bad input: nothing has started and nothing is written."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - every error of a check is one line
        _refuse(refusal(e))


# ------------------------------------------------------------------------------ a command's jobs, checked


def task_config(config: DictConfig) -> DictConfig:
    """A job's config without Hydra's node: what Hydra hands the task function."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def _check_data(specs: list[Spec]) -> None:
    """Every dataset on disk (or downloaded), once per dataset, before any job starts; the batch fits it, and
    every job's length gives its workers a gradient (where the training split's size is known without loading)."""
    available = set()
    for spec in specs:
        d = spec.data
        key = (d.name, data_root(d.root), d.download)
        path = OmegaConf.select(spec.cfg, "data.path")
        if d.name == "tensors" and not os.path.isfile(str(path)):  # the class would name data._target_, not this
            raise ConfigError(
                f"data.path={path}: no such file (from {os.getcwd()}); give the path of your .npz or .pt file"
            )
        if key not in available:
            gdata.ensure_available(*key)
            available.add(key)
        train = gdata.train_size(d.name, key[1], d.synthetic.train_size, d.val_size)
        check_batch_size(spec.cfg.batch_size, d.name, train)
        if train is not None:
            check_length(spec.cfg, spec, train, budget_of(spec.cfg))


def check_run(config: DictConfig, exit_on_plan: bool = True) -> Spec:
    """One run (`config`: the command as Hydra composed it, its `hydra` node included): its Spec and data; its plan
    for plan=true (then exit 0, or the Spec returned with `exit_on_plan=False`); else its run directory taken (the
    lock is held until this process exits) and checked. Raises on bad input (`refusing` makes it one line)."""
    spec = checked(task_config(config))
    _check_data([spec])
    run_dir = Path(os.path.abspath(_named_dir(config, "hydra.run.dir")))
    if not spec.cfg.resume and (run_dir.parent / "multirun.yaml").exists():
        # analysis.load reads every folder of a sweep as one of its jobs: a run started by hand there would count
        raise Refused(
            f"hydra.run.dir={run_dir} is a job folder of the sweep in {run_dir.parent} (it has "
            "multirun.yaml): a run started there by hand would be counted as one of its jobs; give the run "
            f"a folder of its own, or finish the sweep with its identical -m command and "
            f"hydra.sweep.dir={run_dir.parent} resume=true"
        )
    if spec.cfg.plan:  # a plan lists no run that its command would refuse, as a sweep's plan does
        rundir.check_planned(spec, run_dir)
        plan.show([(list(config.hydra.overrides.task), spec)])
        if exit_on_plan:
            sys.exit(0)
        return spec
    rundir.check_run_dir(spec, run_dir)
    note = _single_run_note(config)
    if note:
        print(note, file=sys.stderr)
    return spec


def _named_dir(config: DictConfig, key: str) -> str:
    """A run's or sweep's folder as given; an empty one (or `.`) would put the run's files among whatever is in the
    current directory, the checkout say."""
    where = str(OmegaConf.select(config, key)).strip()
    if where in ("", ".", "./"):
        default = "outputs/<date>/<time>" if key == "hydra.run.dir" else "multirun/<date>/<time>"
        raise Refused(
            f"{key}='{where}' is not allowed: it would write the run's files into the current directory "
            f"({os.getcwd()}); name a folder of its own (default {default})"
        )
    return where


def _single_run_note(config: DictConfig) -> str | None:
    """`python run.py experiment=fig1` without -m runs one job, not the figure's sweep. That is legitimate (one
    run with an experiment's settings), but worth a line."""
    if not any(o.split("=", 1)[0].lstrip("+~") == "experiment" for o in config.hydra.overrides.task):
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    grids = OmegaConf.select(config, "hydra.sweeper.grids") or []
    if not params and not grids:
        return None
    swept = " ".join([f"{k}={v}" for k, v in params.items()] + ([f"over {len(grids)} grids"] if grids else []))
    return f"gem: note: this experiment sweeps {swept}; without -m only one job runs. Add -m to run the whole sweep."


def jobs_at_once(config: DictConfig) -> int:
    """How many of a sweep's jobs its launcher runs at a time on this machine: joblib's hydra.launcher.n_jobs
    (joblib's rule for a negative one: -1 all the cores, -2 all but one, ...), 1 for any other launcher."""
    n = OmegaConf.select(config, "hydra.launcher.n_jobs")
    if not isinstance(n, int) or n == 0:
        return 1
    return max(1, plan.cores() + 1 + n) if n < 0 else n


def heldout_seeds(config: DictConfig) -> list[int] | None:
    """A tuning sweep's held-out seeds (hydra.sweeper.heldout_seeds, "0,1,2"), or None for any other sweep."""
    seeds = OmegaConf.select(config, "hydra.sweeper.heldout_seeds")
    if seeds is None:
        return None
    try:
        return [int(s) for s in str(seeds).split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"hydra.sweeper.heldout_seeds={seeds} is not allowed; it must be seeds, as 0,1,2") from None


def check_sweep(config: DictConfig, jobs: list[list[str]], compose_job=None) -> list[Spec]:
    """A sweep (`config`: the command as Hydra composed it; `jobs`: each job's overrides; `compose_job`: how a job's
    config is composed, Hydra's compose API by default): every job's Spec and data, then its plan (exit 0) for
    plan=true, else its folders: the sweep's taken for this command (made if need be, its lock held until this
    process exits), no job's in use or holding results, unless resume=true, which says what happens to each job.
    Raises on bad input (`refusing` makes it one line), with every folder as it was."""
    here = not _elsewhere(config)
    bases: dict = {}  # the configs of the jobs' group choices, each composed once (config._composed_from)
    specs = [checked(composed(job, compose_job, bases), here) for job in jobs]
    _check_tasks(config, specs)
    _check_data(specs)
    actions = _check_sweep_dir(config, specs)
    if any(spec.cfg.plan for spec in specs):
        plan.show(
            list(zip(jobs, specs, strict=True)),
            actions=actions,
            heldout_seeds=heldout_seeds(config),
            at_once=jobs_at_once(config),
        )
        sys.exit(0)
    return specs


def _elsewhere(config: DictConfig) -> bool:
    """The sweep's jobs run on other machines: a SLURM launcher (submitit_slurm, distributed_slurm). This machine's
    GPUs and memory say nothing about theirs; each job checks them where it runs (main())."""
    target = OmegaConf.select(config, "hydra.launcher._target_") or ""
    return str(target).rsplit(".", 1)[-1].endswith("SlurmLauncher")


def _check_tasks(config: DictConfig, specs: list[Spec]) -> None:
    """A submitit launcher that starts several tasks per job (hydra/launcher=distributed_local or
    distributed_slurm: nodes x tasks_per_node) starts the ranks of one engine=distributed run: every job must be
    one, with workers + 1 ranks (rank 0 is the parameter server), and a launch over several nodes needs the run's
    secret. Refused here, before any job starts, rather than by each job's rank 0."""
    launcher = OmegaConf.select(config, "hydra.launcher")
    if not isinstance(launcher, DictConfig) or "tasks_per_node" not in launcher:
        return
    nodes, per = int(launcher.get("nodes") or 1), int(launcher.tasks_per_node or 1)
    tasks = nodes * per
    if tasks == 1:
        return
    keys = (
        f"hydra.launcher.tasks_per_node={per}"
        if nodes == 1
        else f"hydra.launcher.nodes x hydra.launcher.tasks_per_node = {nodes} x {per}"
    )
    for num, spec in enumerate(specs):
        if spec.engine.name != "distributed":
            raise ConfigError(
                f"{keys} starts {tasks} processes for each job, the ranks of one engine=distributed "
                f"run, but job {num} is engine={spec.engine.name}, which runs as one process: pass "
                "engine=distributed, or hydra.launcher.tasks_per_node=1"
            )
        if spec.workers + 1 != tasks:
            fix = (
                f"hydra.launcher.tasks_per_node={spec.workers + 1}"
                if nodes == 1
                else f"hydra.launcher.nodes and hydra.launcher.tasks_per_node whose product is {spec.workers + 1}"
            )
            raise ConfigError(
                f"{keys} starts {tasks} processes for each job, but job {num} has workers="
                f"{spec.workers}, which needs workers + 1 = {spec.workers + 1} (rank 0 is the parameter "
                f"server): pass {fix}, or workers={tasks - 1}; sweep workers with one command per value"
            )
    if nodes > 1:
        from gem.engines.distributed.secret import SECRET_ENV, SECRET_HINT, run_secret

        try:
            secret = run_secret()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # the jobs inherit this environment (sbatch exports it), or set the secret in their setup lines
        if secret is None and not any(SECRET_ENV in str(line) for line in launcher.get("setup") or []):
            raise ConfigError(
                f"hydra.launcher.nodes={nodes}: {SECRET_ENV} is not set, and a launch over several "
                f"machines needs the run's secret so that only its own workers can join: {SECRET_HINT}"
            )


def _check_sweep_dir(config: DictConfig, specs: list[Spec]) -> list[str] | None:
    """The sweep's folder taken for this command (its lock, held until this process exits; plan=true only checks
    that no other command holds it), then no job's folder in use or holding results (unless resume=true). Returns,
    for a sweep resumed with resume=true, what happens to each job (experiments.rundir.sweep_action)."""
    sweep_dir = Path(os.path.abspath(_named_dir(config, "hydra.sweep.dir")))
    numbered = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir") == "${hydra.job.num}"
    resume = any(spec.cfg.resume for spec in specs)
    if resume:
        if not numbered:
            raise Refused(
                "resume=true with -m needs the sweep's jobs in numbered folders "
                "(hydra.sweep.subdir=${hydra.job.num}, the default)"
            )
        if not sweep_dir.is_dir():  # before the lock, which would make it
            raise Refused(
                f"resume=true: hydra.sweep.dir={sweep_dir} does not exist; resuming a sweep needs "
                "hydra.sweep.dir=<the folder of the sweep to finish> and the identical -m command"
            )
    # Two commands on one folder would split its jobs between them, each refusing the other's as "in use": the
    # folder's lock, taken here, before any job folder is looked at, lets only one of them past this point. A
    # sweep's command holds its jobs' folders too (each job's lock, until it exits), so without it the second
    # command would blame a job that has finished.
    busy = (
        "is in use by a sweep that is still going (its command holds the folder's lock); wait for it to end; "
        "if it leaves jobs undone, this command then finishes them"
        if resume
        else "is in use by another sweep that is still going (its command holds the folder's lock); wait for it "
        "to end, or pick another sweep directory"
    )
    key = "resume=true: hydra.sweep.dir" if resume else "hydra.sweep.dir"
    planning = any(spec.cfg.plan for spec in specs)
    if planning:  # plan=true makes no folder and holds none
        if rundir.in_use(sweep_dir):
            raise Refused(f"{key}={sweep_dir} {busy}")
    else:
        rundir.claim(sweep_dir, key, busy)
    try:
        return _check_job_dirs(sweep_dir, specs, numbered, resume)
    except Refused:
        if not planning:
            rundir.unclaim(sweep_dir)  # and remove it, if this command made it
        raise


def _check_job_dirs(sweep_dir: Path, specs: list[Spec], numbered: bool, resume: bool) -> list[str] | None:
    if resume:
        return _plan_resume(sweep_dir, specs)
    if numbered:
        for num in range(len(specs)):
            job_dir = sweep_dir / str(num)
            if rundir.in_use(job_dir):
                raise Refused(
                    f"hydra.sweep.dir={sweep_dir}: job {num}'s directory {job_dir} is in use by another "
                    "run that is still going; pick another sweep directory"
                )
            st = rundir.status(job_dir)
            if st is not None:  # results are never overwritten
                raise Refused(
                    f"hydra.sweep.dir={sweep_dir} already holds a sweep: job {num}'s directory holds a "
                    f"run (status {st}); add resume=true to finish that sweep (the identical -m "
                    "command), or pick a new sweep directory"
                )
    return None


def _plan_resume(sweep_dir: Path, specs: list[Spec]) -> list[str]:
    """`-m ... resume=true`: say what happens to each job (experiments.rundir.sweep_action), or refuse the
    whole command before anything runs."""
    actions, by = [], {}
    for num, spec in enumerate(specs):
        action, why = rundir.sweep_action(spec, sweep_dir / str(num), num)
        actions.append(action)
        by.setdefault(action, []).append((num, why))
    words = {
        "skip": "finished (skipped, left as they are)",
        "resume": "resume from the last checkpoint",
        "rerun": "rerun (stopped before a checkpoint; their files move to .superseded/)",
        "new": "start",
    }
    parts = []
    for a in (a for a in words if a in by):
        # the reasons of a resume or rerun say something per job; finished and new jobs are listed as ranges
        listed = (
            ", ".join(f"{num} ({why})" for num, why in by[a])
            if a in ("resume", "rerun")
            else ranges([num for num, _ in by[a]])
        )
        parts.append(f"job{'s' if len(by[a]) > 1 else ''} {listed}: {words[a]}")
    print(f"gem: resuming the sweep in {sweep_dir}: " + "; ".join(parts), file=sys.stderr)
    return actions


def ready(jobs: list[list[str]], specs: list[Spec]) -> None:
    """The Specs the sweeper checked, for main() to take when Hydra's launcher runs their jobs in this process."""
    for job, spec in zip(jobs, specs, strict=True):
        _ready[tuple(job)] = spec


class Checks(Callback):
    """The checks of a single run, made once Hydra has composed the command and before it makes the run directory
    (conf/config.yaml names this callback). Hydra turns a callback's exception into a warning and goes on, so every
    failure here ends the command itself: one line, exit 2."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _ready[tuple(config.hydra.overrides.task)] = refusing(check_run, config)


# ----------------------------------------------------------------------------------------- one job


def end_helpers(timeout_s: float = 10.0) -> None:
    """Stop the helper processes multiprocessing started for this command (the forkserver the workers are forked
    from, and the resource tracker) and wait for them, so that the command leaves no child behind when it returns:
    a script that cleans up after gem, or a scheduler that counts processes, saw them alive for a second or two.
    They end by themselves once the command has gone; this makes it before, each within `timeout_s` (then killed).
    multiprocessing has no public call for this: where its private names differ, the helpers end as before."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker
    from multiprocessing import util

    def end(pid, fd) -> None:
        if pid is None or fd is None:
            return
        os.close(fd)  # its end of file is the helper's signal to exit
        deadline = time.monotonic() + timeout_s
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)

    try:
        server = forkserver._forkserver
        with server._lock:
            pid, address = server._forkserver_pid, server._forkserver_address
            end(pid, server._forkserver_alive_fd)
            if pid is not None and address and not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        tracker = resource_tracker._resource_tracker
        with tracker._lock:
            end(tracker._pid, tracker._fd)
            tracker._pid = tracker._fd = None
    except (AttributeError, ChildProcessError, OSError):
        pass


def main(cfg: DictConfig) -> dict | None:
    """Hydra's task function (run.py): the job's Spec, checked above, run by experiments.runner."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from gem.engines import distributed

    distributed.export_submitit_env()  # a submitit job of several tasks (distributed_*): each task is one rank
    if runner.launched_worker():
        try:
            check_launch(cfg)
        except ConfigError:  # the wrong number of tasks, or another engine: rank 0 says so, in one line
            return None
        runner.work(cfg)
        return None

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = list(hc.overrides.task)
    spec = _ready.pop(tuple(overrides), None)
    if spec is None:  # launched in another process (joblib, submitit), or by another sweeper: checked here, once
        try:
            spec = checked(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            if not multirun:
                sys.exit(2)
            return refused(e)
        if cfg.plan:  # a command whose checks Hydra skipped (--config-name of another config): this job's plan
            plan.show([(overrides, spec)])
            return None
    experiment = hc.runtime.choices.get("experiment")
    # W&B: a sweep's runs are grouped by experiment and launch time, each named by what its overrides set
    group = wandb_logger.group(experiment, multirun, hc.sweep.dir if multirun else hc.run.dir)
    name = wandb_logger.run_name(cfg, overrides)
    if multirun and cfg.resume:  # a sweep resumed with the identical command: only its unfinished jobs run
        done = _resume_job(spec, Path(hc.runtime.output_dir), hc.job.num)
        if done is not None:
            return done
    try:
        summary = runner.run(
            spec, Path(hc.runtime.output_dir), wandb_group=group, wandb_name=name, experiment=experiment
        )
    except Refused as e:  # nothing was written; in a sweep the other jobs go on
        print(f"error: {e}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(2)
        return refused(e)
    except KeyboardInterrupt as e:  # the run directory is already closed, with status failed
        why, code = ("SIGTERM", 143) if isinstance(e, runner.Terminated) else ("Ctrl-C", 130)
        print(
            f"gem: interrupted by {why}; the run directory {hc.runtime.output_dir} is closed "
            f"(status failed, rows up to the interruption kept); "
            f"{resume_hint(Path(hc.runtime.output_dir), multirun)}",
            file=sys.stderr,
        )
        sys.exit(code)
    except SystemExit as e:
        if "SUBMITIT_EXECUTOR" not in os.environ:
            raise
        # submitit requeues the job (preempted, or out of time with requeues left), from its signal handler: the
        # run directory is closed (status failed), and the requeued job resumes it (hydra_plugins/gem_launcher's
        # checkpoint). Leave at once: tearing the interpreter down under the group's threads aborts the process,
        # and the exit code that asks the local executor for the requeue would be lost
        print(
            f"gem: requeued by submitit; the run directory {hc.runtime.output_dir} is closed (status failed), and "
            "the requeued job resumes it from its last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    print(runner.format_summary(summary), flush=True)
    # A failed job ends a single run with an error code; in a sweep the other jobs go on. A diverged run is a
    # result, not an error.
    if summary["status"] == "failed" and not multirun:
        # where to go from here: as after an interruption (a sweep's line is its resume=true, at the end)
        print(f"gem: the run failed; {resume_hint(Path(hc.runtime.output_dir), False)}", file=sys.stderr)
        sys.exit(1)
    return summary


def refused(e: Exception) -> dict:
    """What a sweep's job refused when its turn came returns, its line printed: the sweeper counts these, and
    ends the sweep with exit code 1 once the other jobs have run (`end_if_refused`)."""
    return {"status": "refused", "reason": str(e)}


def end_if_refused(nums: list[int], total: int) -> None:
    """A sweep some of whose jobs (`nums`) were refused when their turn came (a folder in use, a check only their
    own process could make) has not done what it was asked: one line, and exit code 1, after the others have run."""
    if not nums:
        return
    which = (
        f"jobs {ranges(nums)}: refused when their turn came"
        if len(nums) > 1
        else f"job {nums[0]}: refused when its turn came"
    )
    print(
        f"error: {len(nums)} of the {total} jobs of the sweep did not run ({which}, as the lines above say); the "
        "others ran",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


def resume_hint(run_dir: Path, multirun: bool) -> str:
    """How to go on after an interruption: resume=true, from the run's last checkpoint if it has one."""
    from gem.engines import checkpoint as ckpt

    try:
        step = ckpt.read_manifest(run_dir)["step"]
    except ckpt.CheckpointError:
        step = None
    if multirun:
        # hydra.sweep.dir named: without it the identical command makes a new folder (multirun/<date>/<time>)
        return (
            f"to finish the sweep, run the identical -m command with hydra.sweep.dir={run_dir.parent} resume=true "
            "(this job "
            + (
                f"resumes from its checkpoint at commit {step})"
                if step is not None
                else "starts again: it had no checkpoint yet)"
            )
        )
    if step is None:
        return (
            "it had no checkpoint yet (engine.checkpoint_every), so resume=true cannot continue it: run the command "
            f"again with another hydra.run.dir ({run_dir} keeps the rows of this one)"
        )
    return (
        f"to continue from its checkpoint at commit {step}, run the same command with resume=true "
        f"hydra.run.dir={run_dir}"
    )


def _resume_job(spec: Spec, job_dir: Path, num: int) -> dict | None:
    """One job of a sweep run with resume=true (experiments.rundir.sweep_action): a finished job is left as it
    is and its summary returned; a job that never started, or stopped before its first checkpoint, starts afresh
    (the latter's files moved to .superseded/ first); a checkpointed one resumes (None: run it)."""
    try:
        rundir.claim(job_dir, f"job {num} of hydra.sweep.dir")  # before anything is decided or moved: one owner
        action, why = rundir.sweep_action(spec, job_dir, num)
    except Refused as e:
        rundir.unclaim(job_dir)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return refused(e)
    if action == "skip":
        rundir.unclaim(job_dir)
        print(f"gem: job {num} ({job_dir}) is already {why}: skipped, left as it is", flush=True)
        return json.loads((job_dir / "summary.json").read_text())
    if action == "rerun":
        moved = rundir.supersede(job_dir)
        print(
            f"gem: job {num} ({job_dir}) stopped before a checkpoint ({why}): rerun; its files are in {moved}",
            flush=True,
        )
    if action in ("new", "rerun"):
        with open_dict(spec.cfg):
            # a fresh run: resume=true means "finish the sweep", not "this run has a checkpoint"
            spec.cfg.resume = False
    return None
