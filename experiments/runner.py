"""One job run: its Spec (experiments.config) into a Job, the engine run, the run directory written.

Nothing here needs Hydra: `run(cfg or spec, run_dir)` runs a job from Python as well as from the command line
(experiments.command hands it the spec its checks made). Run directory (docs/contract.md): `summary.json`,
`metrics.parquet` (one row per commit), `eval.parquet` (the central variable every `logger.eval_every` commits and
at the end), `tensors.parquet` (per-tensor diagnostics, for algorithms that log them), `wandb/` (unless
disabled), `tensorboard/` (when asked) and `.hydra/` (when Hydra launched it).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments import instantiate, rundir, tensorboard_logger, wandb_logger
from experiments.config import ConfigError, Spec, checked
from experiments.job import build_job
from experiments.rundir import Refused
from gem import algorithms, engines
from gem import data as gdata
from gem.engines import Job, Result
from gem.engines.checkpoint import CheckpointError
from gem.engines.core import commits_per_worker
from gem.engines.sim import describe as describe_staleness
from gem.files import write_atomic
from gem.metrics import Recorder, fan_out


def _progress(total: int, enabled: bool):
    """The run's progress bar: on a terminal, and in a Jupyter kernel (a widget where ipywidgets is installed, else
    text); silent in CI logs and pipes, and with logger.progress=false."""
    from tqdm.std import tqdm

    options = dict(total=total, unit="commit", smoothing=0.05)
    if enabled and "ipykernel" in sys.modules:  # a notebook's output is no terminal, but it shows a bar
        try:
            import ipywidgets  # noqa: F401 - tqdm.notebook's widget needs it (else it warns and draws nothing)
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm(**options, mininterval=0.5)
        except ImportError:
            return tqdm(**options, mininterval=1.0, disable=False)
    # disable=None: shown on a terminal only
    return tqdm(**options, disable=None if enabled else True, dynamic_ncols=True, mininterval=0.5)


def _finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the run directory is closed properly."""


def _raise_on_sigterm(signum, frame):
    raise Terminated()


def _spec(config: DictConfig | Spec) -> Spec:
    """A config as a Spec, validated here if it is not one already; Refused (one line) on bad input."""
    if isinstance(config, Spec):
        return config
    try:
        return checked(config)
    except ConfigError as e:
        raise Refused(str(e)) from None


def prepare(spec: Spec, run_dir: Path) -> tuple[Job, dict | None]:
    """The run directory taken and checked, and the job built (its data loaded), before anything in the directory
    is written. Refused (one line) otherwise. Returns the job and the checkpoint's manifest it resumes (or None)."""
    manifest = rundir.check_run_dir(spec, run_dir)
    try:
        return build_job(spec, run_dir=run_dir, resume=manifest), manifest
    except (ConfigError, gdata.DatasetMissing) as e:
        rundir.unclaim(run_dir)
        raise Refused(str(e)) from None


def run(
    config: DictConfig | Spec,
    run_dir: Path,
    wandb_group: str | None = None,
    wandb_name: str | None = None,
    experiment: str | None = None,
    hydra: DictConfig | None = None,
) -> dict:
    """Run one job and write its directory. Returns the summary. `config`: a composed config
    (experiments.config.compose) or its Spec. Raises Refused (one line) before writing anything when the command
    cannot run; never raises for a failed or diverged run; Ctrl-C and SIGTERM close the run directory (status
    failed) and are raised again. `hydra`: the `hydra` node of a config composed with Hydra's (experiments.api),
    saved as `.hydra/` as Hydra saves a launched job's; a job Hydra launched brings its own."""
    run_dir = Path(run_dir)
    spec = _spec(config)
    cfg = spec.cfg
    launched, choices = _launched_by_hydra()
    if launched is None and hydra is not None:  # composed by experiments.api: its `hydra` node, as Hydra would save it
        launched = OmegaConf.create({"hydra": hydra})
        choices = dict(hydra.runtime.choices)
    hydra = launched
    job, manifest = prepare(spec, run_dir)
    t0 = time.perf_counter()
    summary = {
        "status": "failed",
        "algorithm": cfg.algorithm.name,
        "engine": cfg.engine.name,
        "workers": job.workers,
        "workers_requested": cfg.workers,
        "model": job.model.name,
        "data": job.data.name,
        "loss": job.loss,
        "precision": job.precision,
        "device": job.device,
        "seed": cfg.seed,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "batch_size": cfg.batch_size,
        "epochs": cfg.epochs,
        "staleness_model": describe_staleness(job.engine),
        "steps": 0,
        "final_train_loss": None,
        "val_loss": None,
        "val_accuracy": None,
        "test_loss": None,
        "test_accuracy": None,
        "mean_staleness": None,
        "wall_time_s": None,
        "reason": "",
        "lost_workers": [],
        "run_dir": str(run_dir),
        "experiment": experiment,
        "train_examples": len(job.data.train_y),  # epochs of data = step x batch_size x window / this
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    recorder = wandb = tensorboard = result = None
    write_failed = False  # a file of the run could not be written: closing the tables fails the same way
    old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm) if _main_thread() else None
    try:
        rundir.write_hydra(run_dir, cfg, hydra)
        print(
            f"gem: algorithm={job.algorithm} engine={cfg.engine.name} workers={job.workers} model={job.model.name} "
            f"data={job.data.name} ({job.data.sizes()}) -> {run_dir}"
        )
        log_cfg = cfg.logger
        logged = wandb_logger.config(spec, job, run_dir, experiment, choices)  # every key, its defaults filled in
        wandb = wandb_logger.start(
            log_cfg.wandb.mode,
            run_dir,
            logged,
            project=log_cfg.wandb.project,
            entity=log_cfg.wandb.entity,
            group=log_cfg.wandb.group or wandb_group,
            name=wandb_name,
        )
        if spec.logger.tensorboard:
            tensorboard = tensorboard_logger.start(
                run_dir, log_cfg.flush_seconds, resume_step=manifest["step"] if manifest else None
            )
        total = job.workers * commits_per_worker(job, algorithms.get(job.algorithm).commit_every(job.hp))
        if job.budget.get("commits"):
            total = min(total, int(job.budget["commits"]))
        recorder = Recorder(
            run_dir,
            flush_every=log_cfg.flush_every,
            flush_seconds=log_cfg.flush_seconds,
            sink=fan_out(wandb, tensorboard),
            sink_every=log_cfg.wandb.log_every,
            progress=_progress(total, log_cfg.progress),
            resume_step=manifest["step"] if manifest else None,
        )
        if manifest:
            print(f"gem: resuming from the checkpoint at commit {manifest['step']} in {manifest['path']}")
        result = engines.get(cfg.engine.name).run(job, recorder)
    except (ConfigError, CheckpointError, gdata.DatasetMissing) as e:
        result = Result("failed", recorder.commits if recorder else 0, reason=str(e))
        print(f"error: {e}", file=sys.stderr)
    except KeyboardInterrupt as e:
        why = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        result = Result("failed", recorder.commits if recorder else 0, reason=f"interrupted ({why})")
        raise
    except OSError as e:  # a write failed (disk full, the directory gone or read-only): its own one line
        write_failed = True
        result = Result("failed", recorder.commits if recorder else 0, reason=str(e))
        rundir.remove_temporary(run_dir)
        print(f"error: {e}", file=sys.stderr)
    except Exception as e:
        interrupt = _interrupt_behind(e)
        if interrupt is not None:  # Ctrl-C or SIGTERM inside compiled code (numba): the interruption, not an error
            why = (
                "SIGTERM"
                if isinstance(interrupt, Terminated)
                else "Ctrl-C"
                if isinstance(interrupt, KeyboardInterrupt)
                else "exit"
            )
            result = Result("failed", recorder.commits if recorder else 0, reason=f"interrupted ({why})")
            raise interrupt from None
        result = Result("failed", recorder.commits if recorder else 0, reason=f"{type(e).__name__}: {e}")
        where = run_dir / "error.txt"
        try:
            where.write_text(traceback.format_exc())
        except OSError:
            where = None
        print(
            f"error: run failed with {type(e).__name__}: {e}" + (f" (traceback in {where})" if where else ""),
            file=sys.stderr,
        )
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
        if result is None:  # an exception that is not an Exception (SystemExit, say)
            result = Result("failed", recorder.commits if recorder else 0, reason="interrupted")
        summary.update(status=result.status, steps=result.steps, reason=result.reason, **result.extra)
        summary["lost_workers"] = sorted(summary.get("lost_workers") or [])
        if recorder is not None:
            _close(recorder, summary, result, run_dir, quiet=write_failed)
        summary["wall_time_s"] = round(time.perf_counter() - t0, 3)
        if tensorboard is not None:  # closed here, whatever ended the run: its event files stay readable
            tensorboard.finish(summary)
        if wandb is not None:
            summary["wandb"] = wandb.where
            wandb.finish(summary, exit_code=0 if summary["status"] == "completed" else 1)
        try:
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")  # whole or absent
        except OSError as e:
            rundir.remove_temporary(run_dir)
            print(f"error: {e}; the run's summary is not on disk", file=sys.stderr)
    return summary


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | SystemExit | None:
    """The KeyboardInterrupt (Ctrl-C, or SIGTERM as Terminated) or SystemExit (submitit's requeue, from its signal
    handler) that an error stands for: a signal handled while a numba-compiled loop runs comes out as
    `SystemError: ... returned a result with an exception set`, caused by the interruption."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _launched_by_hydra() -> tuple[DictConfig | None, dict]:
    """Hydra's config of this job and its group choices, when Hydra launched it (saved in `.hydra/`, logged to
    W&B); (None, {}) for a run started from Python."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, {}
    return HydraConfig.instance().cfg, dict(HydraConfig.get().runtime.choices)


def _close(recorder: Recorder, summary: dict, result: Result, run_dir: Path, quiet: bool = False) -> None:
    """Merge the tables, and put the recorded numbers in the summary; a table that lost rows on disk is said.
    `quiet`: the run already ended on a write error, which is its one line and its reason: merging the tables then
    fails on the same disk, and saying so again (twice, for two tables) would only repeat it."""

    def fail(why: str) -> None:
        summary["status"] = "failed"
        summary["reason"] = (summary["reason"] + "; " if summary["reason"] else "") + why

    try:
        recorder.close()
    except OSError as e:  # the flushed parts are still on disk and readable
        rundir.remove_temporary(run_dir)
        if not quiet:
            fail(str(e))
            print(f"error: {e}", file=sys.stderr)
    missing = recorder.commits - recorder.rows_on_disk if recorder.rows_on_disk is not None else 0
    if missing > 0:
        fail(
            f"metrics.parquet holds {recorder.rows_on_disk} of the {recorder.commits} commit rows recorded: "
            f"part files were removed from {run_dir / 'metrics.parts'} during the run"
        )
        print(f"error: {summary['reason']}", file=sys.stderr)
    # validation numbers describe the final central variable only: a diverged or failed run has none
    final = summary["status"] == "completed" and recorder.last_eval and recorder.last_eval["step"] == result.steps
    ev = recorder.last_eval if final else {}
    summary.update(
        final_train_loss=_finite_or_none(recorder.final_train_loss),
        val_loss=_finite_or_none(ev.get("val_loss")),
        val_accuracy=ev.get("val_accuracy"),
        mean_staleness=_finite_or_none(recorder.mean_staleness),
    )
    if not final:  # the test split's numbers, like validation's, describe a completed run's final θ only
        summary.update(test_loss=None, test_accuracy=None)
    else:
        summary["test_loss"] = _finite_or_none(summary.get("test_loss"))
    if recorder.pi_median is not None:
        summary["pi_median"] = recorder.pi_median
    if recorder.dropped is not None:  # counted, never silently lost: the rows say which (`dropped`)
        summary["dropped_commits"] = recorder.dropped
    summary["commit_shares"] = recorder.commit_shares


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _servers(s: dict) -> str:
    """engine.servers > 1: how busy each shard's server was (rank 0's, then the others'), and what each applied."""

    def busy(v):
        return "n/a" if v is None else f"{v:.2f}"

    parts = [f"rank 0 busy {busy(s.get('server_busy'))}"]
    for x in s.get("shards") or []:
        tau = "n/a" if x.get("mean_staleness") is None else f"{x['mean_staleness']:.2f}"
        shard = f"shard {x['shard']} (rank {x['rank']})"
        parts.append(f"{shard} {x['commits']} commits, mean τ {tau}, busy {busy(x.get('server_busy'))}")
    return f"{s['servers']}: " + "; ".join(parts)


def format_summary(s: dict) -> str:
    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        f"status          {s['status']}" + (f"  ({s['reason']})" if s.get("reason") else ""),
        f"algorithm       {s['algorithm']}  engine={s['engine']}  workers={s['workers']}",
        f"commits         {s['steps']}" + (f"  (stopped by {s['stopped_by']})" if s.get("stopped_by") else ""),
        f"train loss      {num(s['final_train_loss'], '.4f')}  (mean of the last 10% of commits)",
        f"val loss        {num(s['val_loss'], '.4f')}",
        f"val accuracy    {num(s['val_accuracy'], '.4f')}",
        f"test loss       {num(s.get('test_loss'), '.4f')}  (the test split, evaluated once at the end)",
        f"test accuracy   {num(s.get('test_accuracy'), '.4f')}",
        f"mean staleness  {num(s['mean_staleness'], '.2f')}  ({s.get('staleness_model')})",
        *([f"commit shares   {_shares(s['commit_shares'])}"] if len(s.get("commit_shares") or {}) > 1 else []),
        *([f"servers         {_servers(s)}"] if (s.get("servers") or 1) > 1 else []),
        *(
            [f"dropped         {s['dropped_commits']} of the {s['steps']} commits (applied none: too stale)"]
            if s.get("dropped_commits") is not None
            else []
        ),
        *(
            [f"median pi       {s['pi_median']:.3f}  (each commit's median over all elements, averaged over commits)"]
            if s.get("pi_median") is not None
            else []
        ),
        f"wall time       {num(s['wall_time_s'], '.1f')} s",
        f"run directory   {s['run_dir']}",
    ]
    if s.get("wandb"):
        lines.append(f"W&B run         {s['wandb']}")
    return "\n".join(lines)


def launched_worker() -> bool:
    """A rank > 0 of engine=distributed started by torchrun, or by SLURM through the submitit launcher."""
    from gem.engines import distributed

    return distributed.launched() and distributed.launched_rank() > 0


def work(cfg=None) -> int:
    """Such a rank's whole life: its job, and everything it records, come from and go to rank 0. It imports
    only what its own command names (`cfg`, composed under SLURM; its command line under torchrun) for the job."""
    from gem.engines import distributed

    return distributed.worker_main(allowed=tuple(instantiate.worker_imports(cfg, sys.argv[1:])))


def _shares(shares: dict) -> str:
    """Each worker's share of the commits: all of them for a few workers, else the spread."""
    if len(shares) <= 8:
        return "  ".join(f"w{w} {v:.3f}" for w, v in shares.items())
    lo, hi = min(shares.values()), max(shares.values())
    return f"{len(shares)} workers, {lo:.3f} to {hi:.3f} (1/n = {1 / len(shares):.3f})"
