"""Turns a resolved config into objects, runs an engine, and writes the run directory.

Run directory (DESIGN §4): `summary.json`, `metrics.parquet` (one row per commit), `eval.parquet` (the
central variable every `logger.eval_every` commits and at the end), `tensors.parquet` (per-tensor diagnostics,
for algorithms that log them), `wandb/` (unless disabled) and Hydra's `.hydra/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig

from experiments import instantiate, rundir, wandb_logger
from experiments.config import ConfigError, algorithm_params, check_batch_size, data_root, validate
from experiments.rundir import Refused
from gem import algorithms, engines, models
from gem import data as gdata
from gem.engines import Job, Result
from gem.engines.checkpoint import CheckpointError
from gem.engines.core import commits_per_worker
from gem.files import write_atomic
from gem.metrics import Recorder


def build_job(cfg: DictConfig, checked: dict, log=print, run_dir: Path | None = None,
              resume: dict | None = None) -> Job:
    """Everything the engine needs, resolved here in the parent: no Hydra object crosses into an engine."""
    workers = algorithms.workers_that_run(cfg.algorithm.name, cfg.workers)
    d, eng = checked["data"], checked["engine"]
    if workers != cfg.workers:
        log(f"gem: algorithm={cfg.algorithm.name} is sequential: running 1 worker (workers={cfg.workers} ignored)")
    shape = models.input_shape(checked["model"])  # digits and synthetic take the model's input shape
    if instantiate.is_instantiated(cfg.data):  # a torchvision-style class: its tensors travel with the job
        source = None
        dataset = instantiate.load_data(cfg)
    else:  # a built-in loader: a distributed worker on another machine loads it itself
        source = {"name": d.name, "root": data_root(d.root), "download": d.download,
                  "synthetic": dataclasses.asdict(d.synthetic), "shape": shape, "augment": d.augment}
        dataset = gdata.load_dataset(**source)
    spec, loss = instantiate.model_spec(cfg), checked["loss"]
    # the loaded data meets the model: inputs, number of classes, loss; and the loaded size (cifar10, _target_)
    instantiate.check_pairing(spec, loss, dataset, cfg.seed)
    check_batch_size(cfg.batch_size, d.name, len(dataset.train_y))
    engine = {k: v for k, v in dataclasses.asdict(eng).items() if k != "checkpoint_every"}
    return Job(algorithm=cfg.algorithm.name, hp=algorithm_params(cfg), model=spec, data=dataset,
               workers=workers, batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed, device=cfg.device,
               loss=loss, precision=cfg.precision,
               engine=engine, eval_every=cfg.logger.eval_every, eval_train_size=cfg.logger.eval_train_size,
               run_dir=str(run_dir) if run_dir is not None else None, checkpoint_every=eng.checkpoint_every,
               resume=resume, data_source=source)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    # disable=None: shown on a terminal, silent in CI logs and pipes
    return tqdm(total=total, unit="commit", disable=None if enabled else True, dynamic_ncols=True,
                smoothing=0.05, mininterval=0.5)


def _finite_or_none(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


class _Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an exception so that the run directory is closed properly."""


def _raise_on_sigterm(signum, frame):
    raise _Terminated()


def prepare(cfg: DictConfig, run_dir: Path) -> tuple[Job, dict | None, dict]:
    """Every check a command must pass, and its data loaded, before anything in the run directory is written.
    Refused (one line) otherwise. Returns the job, the checkpoint's manifest it resumes (or None) and the groups
    as checked (experiments.config.validate)."""
    try:
        checked = validate(cfg)
    except ConfigError as e:
        raise Refused(str(e)) from None
    manifest = rundir.check_run_dir(cfg, checked, run_dir)
    try:
        return build_job(cfg, checked, run_dir=run_dir, resume=manifest), manifest, checked
    except (ConfigError, gdata.DatasetMissing) as e:
        rundir.unclaim(run_dir)
        raise Refused(str(e)) from None


def run(cfg: DictConfig, run_dir: Path, wandb_group: str | None = None, wandb_name: str | None = None,
        experiment: str | None = None) -> dict:
    """Run one job and write its directory. Returns the summary. Raises Refused (one line) before writing
    anything when the command cannot run; never raises for a failed or diverged run; Ctrl-C and SIGTERM close
    the run directory (status failed) and are raised again."""
    run_dir = Path(run_dir)
    job, manifest, checked = prepare(cfg, run_dir)
    t0 = time.perf_counter()
    summary = {"status": "failed", "algorithm": cfg.algorithm.name, "engine": cfg.engine.name,
               "workers": job.workers, "workers_requested": cfg.workers, "model": job.model.name,
               "data": job.data.name, "loss": job.loss, "precision": job.precision, "device": job.device,
               "seed": cfg.seed, "lr": cfg.lr, "momentum": cfg.momentum,
               "batch_size": cfg.batch_size, "epochs": cfg.epochs,
               "steps": 0, "final_train_loss": None, "val_loss": None, "val_accuracy": None,
               "mean_staleness": None, "wall_time_s": None, "reason": "", "lost_workers": [],
               "run_dir": str(run_dir), "experiment": experiment,
               "train_examples": len(job.data.train_y),  # epochs of data = step x batch_size x window / this
               "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    recorder = wandb = result = None
    old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm) if _main_thread() else None
    try:
        rundir.write_hydra(run_dir, cfg)
        print(f"gem: algorithm={job.algorithm} engine={cfg.engine.name} workers={job.workers} model={job.model.name} "
              f"data={job.data.name} ({len(job.data.train_y)} train / {len(job.data.val_y)} val) -> {run_dir}")
        log_cfg = cfg.logger
        logged = wandb_logger.config(cfg, job, checked, run_dir, experiment)  # every key, its defaults filled in
        wandb = wandb_logger.start(log_cfg.wandb.mode, run_dir, logged,
                                   project=log_cfg.wandb.project, entity=log_cfg.wandb.entity,
                                   group=log_cfg.wandb.group or wandb_group, name=wandb_name)
        total = job.workers * commits_per_worker(job, algorithms.get(job.algorithm).commit_every(job.hp))
        recorder = Recorder(run_dir, flush_every=log_cfg.flush_every, flush_seconds=log_cfg.flush_seconds,
                            sink=wandb, sink_every=log_cfg.wandb.log_every,
                            progress=_progress(total, log_cfg.progress),
                            resume_step=manifest["step"] if manifest else None)
        if manifest:
            print(f"gem: resuming from the checkpoint at commit {manifest['step']} in {manifest['path']}")
        result = engines.get(cfg.engine.name).run(job, recorder)
    except (ConfigError, CheckpointError, gdata.DatasetMissing) as e:
        result = Result("failed", recorder.commits if recorder else 0, reason=str(e))
        print(f"error: {e}", file=sys.stderr)
    except KeyboardInterrupt as e:
        why = "SIGTERM" if isinstance(e, _Terminated) else "Ctrl-C"
        result = Result("failed", recorder.commits if recorder else 0, reason=f"interrupted ({why})")
        raise
    except OSError as e:  # a write failed (disk full, the directory gone or read-only): its own one line
        result = Result("failed", recorder.commits if recorder else 0, reason=str(e))
        rundir.remove_temporary(run_dir)
        print(f"error: {e}", file=sys.stderr)
    except Exception as e:
        result = Result("failed", recorder.commits if recorder else 0, reason=f"{type(e).__name__}: {e}")
        where = run_dir / "error.txt"
        try:
            where.write_text(traceback.format_exc())
        except OSError:
            where = None
        print(f"error: run failed with {type(e).__name__}: {e}"
              + (f" (traceback in {where})" if where else ""), file=sys.stderr)
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
        if result is None:  # an exception that is not an Exception (SystemExit, say)
            result = Result("failed", recorder.commits if recorder else 0, reason="interrupted")
        summary.update(status=result.status, steps=result.steps, reason=result.reason, **result.extra)
        summary["lost_workers"] = sorted(summary.get("lost_workers") or [])
        if recorder is not None:
            _close(recorder, summary, result, run_dir)
        summary["wall_time_s"] = round(time.perf_counter() - t0, 3)
        if wandb is not None:
            summary["wandb"] = wandb.where
            wandb.finish(summary, exit_code=0 if summary["status"] == "completed" else 1)
        try:
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")  # whole or absent
        except OSError as e:
            rundir.remove_temporary(run_dir)
            print(f"error: {e}; the run's summary is not on disk", file=sys.stderr)
    return summary


def _close(recorder: Recorder, summary: dict, result: Result, run_dir: Path) -> None:
    """Merge the tables, and put the recorded numbers in the summary; a table that lost rows on disk is said."""
    def fail(why: str) -> None:
        summary["status"] = "failed"
        summary["reason"] = (summary["reason"] + "; " if summary["reason"] else "") + why

    try:
        recorder.close()
    except OSError as e:  # the flushed parts are still on disk and readable
        rundir.remove_temporary(run_dir)
        fail(str(e))
        print(f"error: {e}", file=sys.stderr)
    missing = recorder.commits - recorder.rows_on_disk if recorder.rows_on_disk is not None else 0
    if missing > 0:
        fail(f"metrics.parquet holds {recorder.rows_on_disk} of the {recorder.commits} commit rows recorded: "
             f"part files were removed from {run_dir / 'metrics.parts'} during the run")
        print(f"error: {summary['reason']}", file=sys.stderr)
    # validation numbers describe the final central variable only: a diverged or failed run has none
    final = summary["status"] == "completed" and recorder.last_eval and recorder.last_eval["step"] == result.steps
    ev = recorder.last_eval if final else {}
    summary.update(final_train_loss=_finite_or_none(recorder.final_train_loss),
                   val_loss=_finite_or_none(ev.get("val_loss")), val_accuracy=ev.get("val_accuracy"),
                   mean_staleness=_finite_or_none(recorder.mean_staleness))
    if recorder.pi_median is not None:
        summary["pi_median"] = recorder.pi_median
    summary["commit_shares"] = recorder.commit_shares


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def format_summary(s: dict) -> str:
    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [
        f"status          {s['status']}" + (f"  ({s['reason']})" if s.get("reason") else ""),
        f"algorithm       {s['algorithm']}  engine={s['engine']}  workers={s['workers']}",
        f"commits         {s['steps']}",
        f"train loss      {num(s['final_train_loss'], '.4f')}  (mean of the last 10% of commits)",
        f"val loss        {num(s['val_loss'], '.4f')}",
        f"val accuracy    {num(s['val_accuracy'], '.4f')}",
        f"mean staleness  {num(s['mean_staleness'], '.2f')}",
        *([f"commit shares   {_shares(s['commit_shares'])}"] if len(s.get("commit_shares") or {}) > 1 else []),
        *([f"median pi       {s['pi_median']:.3f}  (each commit's median over all elements, averaged over commits)"]
          if s.get("pi_median") is not None else []),
        f"wall time       {num(s['wall_time_s'], '.1f')} s",
        f"run directory   {s['run_dir']}",
    ]
    if s.get("wandb"):
        lines.append(f"W&B run         {s['wandb']}")
    return "\n".join(lines)


def _resume_job(cfg: DictConfig, job_dir: Path, num: int) -> dict | None:
    """One job of a sweep run with resume=true (experiments.rundir.sweep_action): a finished job is left as it
    is and its summary returned; a job that never started, or stopped before its first checkpoint, starts afresh
    (the latter's files moved to .superseded/ first); a checkpointed one resumes (None: run it)."""
    from omegaconf import open_dict

    try:
        rundir.claim(job_dir, f"job {num} of hydra.sweep.dir")  # before anything is decided or moved: one owner
        action, why = rundir.sweep_action(cfg, validate(cfg), job_dir, num)
    except (Refused, ConfigError) as e:
        rundir.unclaim(job_dir)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return {"status": "refused", "reason": str(e)}
    if action == "skip":
        rundir.unclaim(job_dir)
        print(f"gem: job {num} ({job_dir}) is already {why}: skipped, left as it is", flush=True)
        return json.loads((job_dir / "summary.json").read_text())
    if action == "rerun":
        moved = rundir.supersede(job_dir)
        print(f"gem: job {num} ({job_dir}) stopped before a checkpoint ({why}): rerun; its files are in {moved}",
              flush=True)
    if action in ("new", "rerun"):
        with open_dict(cfg):
            cfg.resume = False  # a fresh run: resume=true means "finish the sweep", not "this run has a checkpoint"
    return None


def launched_worker() -> bool:
    """A rank > 0 of engine=distributed started by torchrun, or by SLURM through the submitit launcher."""
    from gem.engines import distributed

    return distributed.launched() and distributed.launched_rank() > 0


def work() -> int:
    """Such a rank's whole life: its job, and everything it records, come from and go to rank 0."""
    from gem.engines import distributed

    return distributed.worker_main()


def _shares(shares: dict) -> str:
    """Each worker's share of the commits: all of them for a few workers, else the spread."""
    if len(shares) <= 8:
        return "  ".join(f"w{w} {v:.3f}" for w, v in shares.items())
    lo, hi = min(shares.values()), max(shares.values())
    return f"{len(shares)} workers, {lo:.3f} to {hi:.3f} (1/n = {1 / len(shares):.3f})"


def main(cfg: DictConfig) -> dict | None:
    """Hydra's task function (run.py hands it the composed config)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.engine.name == "distributed":  # a SLURM job of several tasks: each task is one rank
        from gem.engines import distributed

        distributed.export_submitit_env()
        if launched_worker():
            work()
            return None

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    if cfg.plan:  # run.py's preflight shows a command's plan before Hydra starts; here when it was skipped
        from experiments import plan  # (--config-dir, --config-name, --experimental-rerun): this job's plan only

        plan.show([(list(hc.overrides.task), cfg, validate(cfg))])
        return None
    # W&B: a sweep's runs are grouped by experiment and launch time, each named by what its overrides set
    group = wandb_logger.group(hc.runtime.choices.get("experiment"), multirun,
                               hc.sweep.dir if multirun else hc.run.dir)
    name = wandb_logger.run_name(cfg, list(hc.overrides.task))
    if multirun and cfg.resume:  # a sweep resumed with the identical command: only its unfinished jobs run
        done = _resume_job(cfg, Path(hc.runtime.output_dir), hc.job.num)
        if done is not None:
            return done
    try:
        summary = run(cfg, Path(hc.runtime.output_dir), wandb_group=group, wandb_name=name,
                      experiment=hc.runtime.choices.get("experiment"))
    except Refused as e:  # nothing was written; in a sweep the other jobs go on
        print(f"error: {e}", file=sys.stderr, flush=True)
        if not multirun:
            sys.exit(2)
        return None
    except KeyboardInterrupt as e:  # the run directory is already closed, with status failed
        why, code = ("SIGTERM", 143) if isinstance(e, _Terminated) else ("Ctrl-C", 130)
        print(f"gem: interrupted by {why}; the run directory {hc.runtime.output_dir} is closed "
              "(status failed, rows up to the interruption kept)", file=sys.stderr)
        sys.exit(code)
    print(format_summary(summary), flush=True)
    # A failed job ends a single run with an error code; in a sweep the other jobs go on. A diverged run is a
    # result, not an error.
    if summary["status"] == "failed" and not multirun:
        sys.exit(1)
    return summary
