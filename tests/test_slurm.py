"""Sweeps of engine=distributed runs through Hydra's submitit launcher, one job per run and one task per rank
(conf/hydra/launcher/distributed_*.yaml, hydra_plugins/gem_launcher). There is no SLURM here: distributed_local
runs a sweep end to end with submitit's local executor, which starts and numbers the tasks as SLURM does, and
distributed_slurm's keys are checked against submitit's SLURM executor, which refuses any it does not take."""

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import warm_run
from helpers.commands import refused_line, run_py
from helpers.procs import mentioning
from helpers.rundir import check_run_dir

from experiments.config import compose

pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher",
    reason='the submitit launcher plugin is not installed (pip install -e ".[slurm]")',
)

# a small run: 2 workers of 8 commits each
QUICK = [
    "engine=distributed",
    "workers=2",
    "epochs=1",
    "data=synthetic",
    "data.synthetic.train_size=256",
    "data.synthetic.val_size=128",
    "batch_size=32",
    "logger.wandb.mode=disabled",
    "logger.progress=false",
]


def launcher(name: str, tmp_path, *overrides):
    """The launcher `hydra/launcher=<name>` makes, as Hydra instantiates it, and the composed config."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    cfg = compose([f"hydra/launcher={name}", f"hydra.sweep.dir={tmp_path}", *overrides], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    return get_class(params.pop("_target_"))(**params), cfg


def kinds(obj) -> list[str]:
    """The names of obj's classes (Hydra's plugin scan imports the plugin's modules anew: not its classes)."""
    return [c.__name__ for c in type(obj).__mro__]


@pytest.mark.parametrize("name", ["distributed_local", "distributed_slurm"])
def test_a_launchers_tasks_are_the_default_runs_ranks(name, tmp_path):
    """The yaml's tasks_per_node is workers + 1 for the default workers, and its keys are the plugin's."""
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

    launch, cfg = launcher(name, tmp_path)
    node = cfg.hydra.launcher
    assert node.nodes * node.tasks_per_node == cfg.workers + 1
    conf = SlurmQueueConf if name == "distributed_slurm" else LocalQueueConf
    assert set(node) <= {f.name for f in dataclasses.fields(conf)}


def test_distributed_slurm_keys_are_the_slurm_executors(tmp_path, monkeypatch):
    """Every key of distributed_slurm reaches sbatch: submitit's SLURM executor takes it (update_parameters refuses
    a name it does not know, and builds the sbatch script to check the values), and the script says it."""
    from submitit.slurm import slurm

    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun here: pretend
    launch, cfg = launcher(
        "distributed_slurm",
        tmp_path,
        "hydra.launcher.partition=gpu",
        "hydra.launcher.setup=['export GLOO_SOCKET_IFNAME=ib0']",
    )
    assert "SlurmLauncher" in kinds(launch)
    ex = launch.executor()  # what the launcher submits with; nothing is submitted
    assert ex.cluster == "slurm"
    sbatch = slurm._make_sbatch_string(command="python -u -m submitit.core._submit", folder=ex.folder, **ex.parameters)
    for line in (
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=5",
        "#SBATCH --cpus-per-task=2",
        "#SBATCH --mem=16GB",
        "#SBATCH --time=120",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --partition=gpu",
        "export GLOO_SOCKET_IFNAME=ib0",
    ):
        assert line in sbatch.splitlines(), sbatch
    assert "--requeue" not in sbatch
    assert ex._executor.max_num_timeout == 0  # no requeue: a run restarts from scratch
    with pytest.raises(NameError, match="no_such_key"):  # what this test relies on: a key it does not take fails
        launch.params["no_such_key"] = 1
        launch.executor()


def test_distributed_local_keys_are_the_local_executors(tmp_path):
    launch, _ = launcher("distributed_local", tmp_path, "hydra.launcher.tasks_per_node=3")
    assert "LocalLauncher" in kinds(launch)
    ex = launch.executor()
    assert ex.cluster == "local"
    assert {k: ex.parameters[k] for k in ("tasks_per_node", "nodes", "timeout_min")} == {
        "tasks_per_node": 3,
        "nodes": 1,
        "timeout_min": 60,
    }
    with pytest.raises(NameError, match="no_such_key"):
        launch.params["no_such_key"] = 1
        launch.executor()


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["workers=2"],
            "hydra.launcher.tasks_per_node=5 starts 5 processes for each job, but job 0 has workers=2, "
            "which needs workers + 1 = 3 (rank 0 is the parameter server): pass hydra.launcher.tasks_per_node=3, or "
            "workers=4; sweep workers with one command per value",
        ),
        (["workers=2,3", "hydra.launcher.tasks_per_node=3"], "but job 1 has workers=3, which needs workers + 1 = 4"),
        (
            ["engine=process", "workers=2", "hydra.launcher.tasks_per_node=3"],
            "hydra.launcher.tasks_per_node=3 starts 3 processes for each job, the ranks of one engine=distributed run, "
            "but job 0 is engine=process, which runs as one process: pass engine=distributed, or "
            "hydra.launcher.tasks_per_node=1",
        ),
    ],
)
def test_tasks_that_are_not_the_runs_ranks_are_refused_before_anything_starts(argv, says, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    line = refused_line(capsys, "-m", "hydra/launcher=distributed_local", *QUICK, *argv, f"hydra.sweep.dir={sweep}")
    assert line.startswith("error: ") and says in line
    assert not sweep.exists()


def test_a_sweep_over_several_nodes_needs_the_runs_secret(tmp_path, capsys, monkeypatch):
    from experiments.command import preflight

    monkeypatch.delenv("GEM_RUN_SECRET", raising=False)
    monkeypatch.delenv("GEM_RUN_SECRET_FILE", raising=False)
    argv = [
        "-m",
        "hydra/launcher=distributed_slurm",
        *QUICK,
        "workers=3",
        "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    line = refused_line(capsys, *argv)
    assert line.startswith(
        "error: hydra.launcher.nodes=2: GEM_RUN_SECRET is not set, and a launch over several "
        "machines needs the run's secret"
    )
    monkeypatch.setenv("GEM_RUN_SECRET", "0123456789abcdef0123")
    assert len(preflight(argv)) == 1  # checked, and nothing submitted


@pytest.mark.parametrize(
    "argv",
    [
        ["hydra/launcher=submitit_slurm", "engine=process", "device=cuda"],
        ["hydra/launcher=distributed_slurm", "engine=distributed", "workers=4", "device=cuda"],
        ["hydra/launcher=submitit_slurm", "engine=process", "workers=1000000"],
    ],
)
def test_a_slurm_sweep_is_not_held_to_this_machines_gpus_and_memory(argv, tmp_path):
    """The jobs of a SLURM sweep run on its nodes: where it is submitted from (a login node without a GPU, say)
    does not refuse device=cuda or a size that fits a node; each job checks those where it runs."""
    from experiments.command import preflight

    specs = preflight(["-m", *argv, "epochs=1", "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert len(specs) == 2


@pytest.mark.slow
def test_distributed_local_runs_a_sweep_with_one_task_per_rank(tmp_path):
    """`python run.py -m hydra/launcher=distributed_local ...`: two jobs, each of three tasks (rank 0 and two
    workers) started by submitit's local executor; rank 0 writes each run directory, as a local launch does."""
    sweep = tmp_path / "sweep"
    p = run_py(
        "-m",
        "hydra/launcher=distributed_local",
        *QUICK,
        "seed=0,1",
        "hydra.launcher.tasks_per_node=3",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert not mentioning(str(sweep)), "a task of the sweep is still running"
    from experiments.api import run

    local = run(*QUICK, f"hydra.run.dir={tmp_path / 'local'}").run_dir  # the same run, launched locally
    form = sorted(str(f.relative_to(local)) for f in local.rglob("*"))
    for job in ("0", "1"):
        d = sweep / job
        summary, m, _ = check_run_dir(d, steps=2 * (256 // 32))  # every commit once, in clock order
        assert summary["status"] == "completed" and summary["engine"] == "distributed" and summary["workers"] == 2
        assert summary["lost_workers"] == [] and summary["seed"] == int(job)
        assert sorted(m["worker"].unique()) == [0, 1]  # rows from both workers
        assert sorted(m.groupby("worker")["worker_step"].max()) == [8, 8]
        # the run directory a local launch writes, and nothing else: the other ranks write none
        assert sorted(str(f.relative_to(d)) for f in d.rglob("*")) == form
        assert summary.keys() == json.loads((local / "summary.json").read_text()).keys()
        # the same columns, but for the commits a local launch's worker saw go before it in the turn's line: those
        # workers pass the turn among themselves, as on engine=process, where a launched rank asks rank 0
        assert list(m.columns) == [c for c in pd.read_parquet(local / "metrics.parquet").columns if c != "wait_commits"]
        assert f"gem: job {job}: completed; run directory {d}; the ranks' output: {sweep}/.submitit/" in p.stderr
    # rank 0 holds the job's store here (env:// rendezvous): it kept its workers' connections (doors.cut_strangers)
    logs = list(sweep.glob(".submitit/*/*_0_log.err"))
    assert len(logs) == 2 and not [f for f in logs if "connection(s) to the job's store" in f.read_text()]


def test_a_jobs_result_is_rank_0s_and_a_dead_worker_is_one_line(tmp_path, capsys):
    """gem's launcher takes a job's result from its task 0 once every task has ended: a worker task that died
    (rank 2, no result) or raised (rank 1) does not end the sweep (rank 0 records it lost and finishes the run);
    each gets a line that says where its output is. Real tasks of submitit's local executor, without a run."""
    import submitit

    from hydra_plugins.gem_launcher.gem_launcher import _result

    def task():  # defined here, so that it travels to the tasks by value
        import os

        from hydra.core.utils import JobReturn, JobStatus

        rank = submitit.JobEnvironment().global_rank
        if rank == 2:
            os._exit(9)
        if rank == 1:
            raise RuntimeError("worker broke")
        ret = JobReturn()
        ret.status, ret.return_value = JobStatus.COMPLETED, {"status": "completed", "run_dir": "/r", "reason": ""}
        return ret

    ex = submitit.AutoExecutor(cluster="local", folder=tmp_path / "%j")
    ex.update_parameters(tasks_per_node=3, timeout_min=5)
    job = ex.submit(task)
    assert _result(job, 7).return_value["status"] == "completed"
    lines = capsys.readouterr().err.splitlines()
    folder = tmp_path / job.job_id
    assert lines == [
        f"gem: job 7: rank 1 (worker 0) raised an error; rank 0 recorded it in the run directory; its output: "
        f"{folder}/{job.job_id}_1_log.err and {folder}/{job.job_id}_1_log.out",
        f"gem: job 7: rank 2 (worker 1) ended without a result (killed?); rank 0 recorded it in the run directory; "
        f"its output: {folder}/{job.job_id}_2_log.err and {folder}/{job.job_id}_2_log.out",
        f"gem: job 7: completed; run directory /r; the ranks' output: {folder}",
    ]


def test_a_requeued_job_resumes_its_run(tmp_path):
    """What submitit requeues (a job preempted, or out of time with requeues left) is the job with resume=true."""
    launch, _ = launcher("distributed_local", tmp_path)
    delayed = launch.checkpoint(["workers=4", "resume=false", "seed=1"], "hydra.sweep.dir", 3, "id", {})
    assert delayed.args == (["workers=4", "seed=1", "resume=true"], "hydra.sweep.dir", 3, "id", {})
    assert delayed.function is launch


def _rank(sweep, rank: int) -> int | None:
    """The pid of task `rank` of the sweep's running job."""
    for d in Path("/proc").iterdir():
        try:
            cmd, env = (d / "cmdline").read_bytes(), (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (
            b"submitit.core._submit" in cmd
            and str(sweep).encode() in cmd
            and f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in env
        ):
            return int(d.name)
    return None


EPOCHS = 20  # the preempted run: 320 commits, a checkpoint every 10, the signal after the first


@pytest.mark.slow
def test_a_preempted_job_is_requeued_and_resumes_from_its_checkpoint(tmp_path):
    """SLURM's warning before it preempts a job or its time runs out (SIGUSR2, which submitit's local executor
    sends the same way): rank 0 closes the run directory, submitit requeues the job with resume=true, and the
    requeued job continues the run from its last checkpoint: every commit once in the end."""
    sweep = tmp_path / "sweep"
    argv = [
        "-m",
        "hydra/launcher=distributed_local",
        *QUICK,
        f"epochs={EPOCHS}",
        "engine.checkpoint_every=10",
        "hydra.launcher.tasks_per_node=3",
        f"hydra.sweep.dir={sweep}",
    ]
    p = warm_run.Popen(argv)
    try:
        pid = None
        deadline = time.monotonic() + 300
        while pid is None and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            # the manifest, not the folder: the folder appears with the first checkpoint's `pending/`, and a
            # signal before the manifest is written leaves nothing to resume from (the requeued job reruns)
            if (sweep / "0" / "checkpoint" / "manifest.json").is_file():
                pid = _rank(sweep, 0)
        assert pid is not None, "the run made no checkpoint"
        os.kill(pid, signal.SIGUSR2)
        out, err = p.communicate(timeout=600)
    finally:
        p.kill()
    assert p.returncode == 0, err[-3000:]
    assert not mentioning(str(sweep))
    d = sweep / "0"
    summary, m, _ = check_run_dir(d, steps=2 * EPOCHS * (256 // 32))
    assert summary["status"] == "completed" and summary["lost_workers"] == []
    for _, rows in m.groupby("worker"):
        assert rows["worker_step"].sort_values().tolist() == list(range(1, EPOCHS * (256 // 32) + 1))
    logs = "".join(f.read_text() for f in (sweep / ".submitit").glob("*/*_0_log.*"))
    assert "gem: requeued by submitit; the run directory" in logs
    assert "gem: resuming from the checkpoint at commit" in logs
    assert "resume=true" in (d / ".hydra" / "overrides.yaml").read_text()
    assert "gem: job 0: completed; run directory" in err
