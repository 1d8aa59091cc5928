"""gem's launchers for sweeps of engine=distributed runs, one submitit job per run and one task per rank
(conf/hydra/launcher/distributed_local.yaml, distributed_slurm.yaml): Hydra's submitit launchers, except for what
a job returns.

Every task of a job runs the job (experiments.command.main): task 0 becomes rank 0, which writes the run
directory, and the others workers. The plugin's launcher takes a job's result from every task, so a worker that
died (killed, out of memory) made the whole sweep end with a traceback, although rank 0 had recorded it lost and
finished the run, as a run does when it loses a worker. Here a job's result is rank 0's; a worker task that ended
without a result gets one line that says where its output is. A job whose rank 0 ended without a result ends the
sweep with its error, as the plugin's launcher does. A job that submitit requeues (SLURM preempted it, or its time
ran out with requeues left) runs again with resume=true (`checkpoint`), so that it continues its run.

The ranks' output (each task's stdout and stderr) is in the submitit folder, `<sweep>/.submitit/<job id>/`; each
job gets one line here, with its status and run directory.

Hydra instantiates only launchers that live in the `hydra_plugins` package, which is why this module is here.
Without the submitit plugin (pip install -e ".[slurm]") it defines none; run.py says how to install it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # the plugin is not installed
    LocalLauncher = SlurmLauncher = None

INIT_KEYS = ("max_num_timeout",)  # keys of the executor's constructor (as the plugin passes them)
log = logging.getLogger(__name__)


class _RankZero:
    """What the plugin's `launch` does, building the executor in `executor()` (what the tests check the configs
    against) and taking each job's result from its task 0."""

    _EXECUTOR: str
    params: dict

    def executor(self):
        """The submitit executor with this launcher's parameters, as the plugin makes it: the keys of its
        BaseQueueConf as they are, the others prefixed by the executor's name. Nothing is submitted; submitit
        refuses a key its executor does not take."""
        import submitit

        init = {f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in INIT_KEYS}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"], **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in base else f"{self._EXECUTOR}_{k}": v
                for k, v in self.params.items()
                if k not in (*INIT_KEYS, "submitit_folder")
            }
        )
        return executor

    def launch(self, job_overrides, initial_job_idx):
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides

        executor = self.executor()
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*params, strict=True))
        return [_result(job, idx) for idx, job in enumerate(jobs, start=initial_job_idx)]

    def checkpoint(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
        """What submitit requeues when the job is preempted, or runs out of time with requeues left
        (max_num_timeout): the job with resume=true, so that its rank 0 continues the run from its last checkpoint
        (or starts it again if it had none, its files kept in .superseded/) instead of refusing the directory that
        holds it (experiments.command's resume of a sweep's job)."""
        import submitit

        overrides = [o for o in sweep_overrides if o.split("=", 1)[0].lstrip("+~") != "resume"] + ["resume=true"]
        return submitit.helpers.DelayedSubmission(self, overrides, job_dir_key, job_num, job_id, singleton_state)


def _result(job, num: int):
    """Job `num`'s result: rank 0's (its task 0), once every task has ended. A worker task that ended without a
    result, or with an error, gets one line: rank 0 recorded it (lost_workers), and its output says why."""
    from hydra.core.utils import JobStatus

    ret = job.task(0).result()  # rank 0 without a result: the sweep ends with its error, as the plugin's does
    for rank in range(1, job.num_tasks):
        task = job.task(rank)
        if not task.paths.result_pickle.exists():
            why = "ended without a result (killed?)"
        elif task.exception() is not None:
            why = "raised an error"
        else:
            continue
        print(
            f"gem: job {num}: rank {rank} (worker {rank - 1}) {why}; rank 0 recorded it in the run directory; its "
            f"output: {task.paths.stderr} and {task.paths.stdout}",
            file=sys.stderr,
            flush=True,
        )
    if ret.status != JobStatus.COMPLETED:  # the task function raised: the sweeper ends the sweep with it
        return ret
    summary, out = ret.return_value, job.task(0).paths
    if isinstance(summary, dict) and summary.get("status") == "refused":  # its line is in rank 0's output
        print(f"gem: job {num}: did not run: {summary['reason']}", file=sys.stderr, flush=True)
    elif isinstance(summary, dict) and "status" in summary:
        reason = f" ({summary['reason']})" if summary.get("reason") else ""
        print(
            f"gem: job {num}: {summary['status']}{reason}; run directory {summary.get('run_dir')}; the ranks' "
            f"output: {out.folder}",
            file=sys.stderr,
            flush=True,
        )
    else:  # no result: rank 0 said why in one line, in its output
        try:
            said = [line for line in out.stderr.read_text().splitlines() if line.startswith("error: ")]
        except OSError:
            said = []
        why = f": {said[-1][len('error: ') :]}" if said else f"; rank 0's output says why: {out.stderr}"
        print(f"gem: job {num}: did not run{why}", file=sys.stderr, flush=True)
    return ret


if LocalLauncher is not None:

    class DistributedLocalLauncher(_RankZero, LocalLauncher):
        """hydra/launcher=distributed_local: the tasks started on this machine by submitit's local executor."""

    class DistributedSlurmLauncher(_RankZero, SlurmLauncher):
        """hydra/launcher=distributed_slurm: one SLURM job per run, one task per rank."""
