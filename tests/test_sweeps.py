"""Sweeps as a user runs them: a plan before anything runs, the resume of a sweep that died, and one
line for the commands Hydra would answer with a traceback (`--cfg` with -m, a launcher whose extra is missing)."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import warm_run
from helpers.commands import refused_line, run_py, snapshot
from helpers.paths import ROOT

QUICK = ["engine=sim", "epochs=1", "logger.wandb.mode=disabled", "logger.progress=false"]


@pytest.fixture
def quick_calibration(monkeypatch):
    from experiments import plan

    monkeypatch.setattr(plan, "CALIBRATION_S", 0.05)  # a few timed calls: the numbers are not what is tested


def test_plan_lists_the_jobs_and_runs_nothing(tmp_path, capsys, quick_calibration):
    from experiments.command import preflight

    sweep = tmp_path / "sweep"
    before = sorted(p.name for p in (ROOT / "multirun").glob("*/*")) if (ROOT / "multirun").exists() else []
    with pytest.raises(SystemExit) as e:  # run.py's preflight, in this process: it exits before Hydra starts
        preflight(["-m", "algorithm=gem,downpour", "workers=2,3", *QUICK, "plan=true", f"hydra.sweep.dir={sweep}"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("gem: plan for 4 jobs")
    jobs = [line.split() for line in lines[2:6]]
    # the swept keys name each job; commits = n x (epochs x (1500 // 64)) on digits
    assert [j[1:3] for j in jobs] == [
        ["algorithm=gem", "workers=2"],
        ["algorithm=gem", "workers=3"],
        ["algorithm=downpour", "workers=2"],
        ["algorithm=downpour", "workers=3"],
    ]
    assert [int(j[5].replace(",", "")) for j in jobs] == [46, 69, 46, 69]
    assert lines[6].startswith("total: 230 commits, about ")
    assert "ms per gradient step" in out and "warning" not in out
    assert not sweep.exists()
    after = sorted(p.name for p in (ROOT / "multirun").glob("*/*")) if (ROOT / "multirun").exists() else []
    assert after == before


def test_plan_warns_above_the_threshold(monkeypatch, capsys, quick_calibration):
    from experiments import command, plan

    monkeypatch.setattr(plan, "WARN_S", 0.001)
    with pytest.raises(SystemExit) as e:
        command.preflight(["-m", "seed=0,1", *QUICK, "plan=true"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "gem: warning: this sweep is estimated at" in out and "its longest job is #" in out


def test_cfg_with_multirun_is_one_line(capsys):
    line = refused_line(capsys, "-m", "experiment=fig1_quick", "epochs=1", "--cfg", "job")
    assert line.startswith("error: --cfg with -m:") and "plan=true" in line


def test_missing_launcher_extra_names_the_install_command(capsys):
    pytest.importorskip("hydra")
    import importlib.util

    if importlib.util.find_spec("hydra_plugins") and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher"):
        pytest.skip("the submitit launcher is installed here")
    line = refused_line(capsys, "-m", "hydra/launcher=submitit_local", *QUICK)
    assert line == (
        "error: hydra/launcher=submitit_local needs a Hydra launcher plugin that is not installed; "
        'install it with pip install -e ".[slurm]" (in this project\'s folder)'
    )


@pytest.mark.parametrize(
    "launcher, plugin, extra",
    [
        ("submitit_slurm", "hydra_plugins.hydra_submitit_launcher", "slurm"),
        ("distributed_local", "hydra_plugins.hydra_submitit_launcher", "slurm"),
        ("joblib", "hydra_plugins.hydra_joblib_launcher", "joblib"),
    ],
)
def test_a_launcher_whose_plugin_is_missing_is_refused_installed_or_not(launcher, plugin, extra, capsys, monkeypatch):
    """The refusal above wherever the plugins are installed (the dev extra installs the submitit one): the plugin's
    module made unfindable, as it is where it is not installed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == plugin else find_spec(name, *a))
    line = refused_line(capsys, "-m", f"hydra/launcher={launcher}", *QUICK)
    assert line == (
        f"error: hydra/launcher={launcher} needs a Hydra launcher plugin that is not installed; "
        f'install it with pip install -e ".[{extra}]" (in this project\'s folder)'
    )


def _status(d):
    return json.loads((d / "summary.json").read_text())["status"]


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_only_its_missing_jobs(tmp_path, capsys, quick_calibration):
    sweep = tmp_path / "sweep"
    cmd = ["-m", "seed=0,1,2", *QUICK, "workers=2", f"hydra.sweep.dir={sweep}"]
    p = run_py(*cmd)
    assert p.returncode == 0, p.stderr
    # what a sweep killed in job 1 leaves: job 0 done, job 1 without its summary (no checkpoint), job 2 not begun
    (sweep / "1" / "summary.json").unlink()
    shutil.rmtree(sweep / "2")
    done = snapshot(sweep / "0")
    from analysis import load

    # the multirun.yaml gem's sweeper wrote counts the jobs the figures and reports say have not run
    assert load.planned_jobs(sweep) == 3
    assert load.unstarted(load.runs(sweep), short=True) == "1 of the 3 jobs of sweep sweep have not run"

    # without resume=true a sweep directory with results is refused, as before (run.py's preflight, in-process)
    assert "add resume=true to finish that sweep" in refused_line(capsys, *cmd)
    changed = refused_line(capsys, *cmd[:-1], "epochs=2", f"hydra.sweep.dir={sweep}", "resume=true")
    assert "holds a run of another configuration (epochs: 1 there, 2 in this command)" in changed
    # another algorithm is one difference, named as such, beside the top-level keys (it named algorithm.eps)
    changed = refused_line(
        capsys, *cmd[:-1], "algorithm=downpour", "epochs=2", f"hydra.sweep.dir={sweep}", "resume=true"
    )
    assert (
        "holds a run of another configuration (algorithm: gem there, downpour in this command; epochs: 1 there, "
        "2 in this command)"
    ) in changed
    # a run started by hand in a job's folder would count as that job: refused, the folder as it was
    single = refused_line(capsys, *QUICK, "workers=2", f"hydra.run.dir={sweep / '1'}")
    assert single.startswith(
        f"error: hydra.run.dir={sweep / '1'} is a job folder of the sweep in {sweep} (it has multirun.yaml)"
    ), single
    assert snapshot(sweep / "0") == done

    # its plan says what the resume will do, job by job, and changes nothing
    with pytest.raises(SystemExit) as e:
        from experiments.command import preflight

        preflight([*cmd, "resume=true", "plan=true"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert [line.split("[")[1].split("]")[0] for line in out.splitlines()[2:5]] == [
        "finished: skipped",
        "rerun",
        "start",
    ]
    assert "total for the 2 jobs left to run: 92 commits" in out
    assert snapshot(sweep / "0") == done and (sweep / "1" / "metrics.parquet").exists()

    p = run_py(*cmd, "resume=true")
    assert p.returncode == 0, p.stderr
    assert (
        "gem: resuming the sweep in" in p.stderr
        and "job 0: finished (skipped, left as they are); job 1 (incomplete, no checkpoint): rerun" in p.stderr
        and "job 2: start" in p.stderr
    ), p.stderr
    assert snapshot(sweep / "0") == done  # untouched, to the byte and the modification time
    assert [_status(sweep / str(j)) for j in range(3)] == ["completed"] * 3
    kept = list((sweep / ".superseded").iterdir())  # the interrupted attempt is kept, out of the analyses
    assert len(kept) == 1 and kept[0].name.startswith("1-") and (kept[0] / "metrics.parquet").exists()

    r = load.runs(sweep)
    assert len(r) == 3 and set(r["status"]) == {"completed"}


def test_the_jobs_a_sweep_has_not_reached_are_counted(tmp_path):
    import pandas as pd
    import yaml

    from analysis import load

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    hydra = {
        "sweeper": {
            "_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
            "params": {"seed": "0,1,2", "workers": "5,10"},
        },
        "overrides": {"task": ["experiment=x", "workers=2,3,4", "lr=0.1"]},
    }  # the command line wins
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra}))
    assert load.planned_jobs(sweep) == 9
    for job in ("0", "1"):  # two job folders that hold a run; r below names one of them only
        (sweep / job).mkdir()
        (sweep / job / "summary.json").write_text("{}")
    r = pd.DataFrame({"run_dir": [str(sweep / "0")], "status": ["completed"]})
    assert load.unstarted(r, short=True) == "7 of the 9 jobs of sweep sweep have not run"
    assert f"hydra.sweep.dir={sweep} resume=true" in load.unstarted(r)
    assert load.unstarted(r.assign(run_dir=[str(tmp_path / "elsewhere" / "0")])) == ""  # no multirun.yaml


COUNT_VALIDATIONS = """
import atexit, runpy, sys
sys.path[0] = ""  # the working directory, the checkout, as for python run.py: Hydra finds gem's sweeper there
import experiments.config as config

calls = []
validate = config.validate
def counted(cfg, *args, **kw):
    calls.append(cfg.seed)
    return validate(cfg, *args, **kw)
config.validate = counted
atexit.register(lambda: print(f"validations: {sorted(calls)}", file=sys.stderr))
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path("run.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("multirun", [False, True], ids=["one run", "a sweep"])
def test_each_jobs_config_is_validated_once(tmp_path, multirun):
    """A command flows one way: each job's config is checked once, into the Spec that the job then runs (the
    callback or the sweeper checks it before anything starts; the task function takes it back)."""
    where = f"hydra.sweep.dir={tmp_path / 'sweep'}" if multirun else f"hydra.run.dir={tmp_path / 'run'}"
    argv = ["-m", "seed=0,1"] if multirun else ["seed=1"]
    script = tmp_path / "count_validations.py"
    script.write_text(COUNT_VALIDATIONS)
    p = warm_run.run_py(*argv, *QUICK, "workers=2", where, script=str(script), timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[-1] == ("validations: [0, 1]" if multirun else "validations: [1]"), p.stderr
    assert p.stdout.count("status          completed") == (2 if multirun else 1)


def test_the_plan_s_calibration_holds_on_a_busy_machine(monkeypatch, capsys, quick_calibration):
    """On a loaded machine the calibration once read 7.6 ms per step on 1 thread and 285 ms on 2: every core cannot
    be slower than one thread, so the plan takes one thread's speed and says why."""
    import torch

    from experiments import plan
    from experiments.command import preflight

    monkeypatch.setattr(plan, "cores", lambda: 2)
    monkeypatch.setattr(
        plan, "_timed", lambda fn, budget, at_least=3: 0.0076 if torch.get_num_threads() == 1 else 0.285
    )
    with pytest.raises(SystemExit):
        preflight(["engine=sim", "epochs=1", "plan=true"])
    out = capsys.readouterr().out
    assert (
        "7.6 ms per gradient step on 1 thread, and no faster on 2 (the cores are busy with other programs: the "
        "estimate assumes one thread's speed, which a run gets with OMP_NUM_THREADS=1; on every core it may be "
        "far slower)"
    ) in out


def test_a_plan_names_a_setting_that_only_some_jobs_have():
    """A grid's own setting (AGN at window 10 beside AGN at its default) tells its jobs apart in the plan, even
    though it takes one value wherever it is set."""
    from experiments.plan import _swept

    jobs = [
        (["algorithm=agn", "lr=0.05", "seed=0"], None),
        (["algorithm=agn", "lr=0.05", "seed=1"], None),
        (["algorithm=agn", "algorithm.window=10", "lr=0.05", "seed=0"], None),
        (["algorithm=agn", "algorithm.window=10", "lr=0.05", "seed=1"], None),
    ]
    assert _swept(jobs) == {"algorithm.window", "seed"}


def test_a_plan_of_jobs_run_two_at_a_time_gives_their_wall_time_on_their_share_of_the_cores(
    monkeypatch, capsys, quick_calibration
):
    """With a launcher that runs two jobs at once (joblib's n_jobs=2), each job gets one of 2 cores: the plan adds
    the wall time, each job timed on one thread, and never less than the longest job; one at a time, no such line."""
    from experiments import command, plan

    monkeypatch.setattr(plan, "cores", lambda: 2)
    step = {1: 0.010, 2: 0.004}  # a gradient step on 1 and on 2 threads: the sim jobs' cost depends on the share
    monkeypatch.setattr(plan, "_timed", lambda fn, budget, at_least=3: step[__import__("torch").get_num_threads()])
    monkeypatch.setattr(plan, "duration", lambda s: f"{s:.4f} s")  # the numbers, not their rounding
    cmd = ["-m", "seed=0,1,2", *QUICK, "plan=true"]
    with pytest.raises(SystemExit):
        command.preflight(cmd)
    alone = capsys.readouterr().out
    assert "jobs at a time" not in alone
    monkeypatch.setattr(command, "jobs_at_once", lambda config: 2)
    with pytest.raises(SystemExit):
        command.preflight(cmd)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "jobs at a time" in x)
    assert line.strip().startswith("with 2 jobs at a time (hydra.launcher.n_jobs=2): about ")
    assert line.endswith("each job on 1 of the 2 cores")
    serial = float(next(x for x in out.splitlines() if x.startswith("total:")).split("about ")[1].split(" s")[0])
    wall = float(line.split("about ")[1].split(" s")[0])
    # three equal jobs two at a time: 1.5 jobs' length, each job slower than alone (10 ms a step, not 4 ms)
    assert serial / 2 < wall < serial * 10 / 4 / 2


def test_jobs_at_once_reads_the_joblib_launcher_s_n_jobs():
    from omegaconf import OmegaConf

    from experiments import command, plan

    assert command.jobs_at_once(OmegaConf.create({"hydra": {"launcher": {"n_jobs": 3}}})) == 3
    assert command.jobs_at_once(OmegaConf.create({"hydra": {"launcher": {"n_jobs": -1}}})) == plan.cores()
    assert command.jobs_at_once(OmegaConf.create({"hydra": {"launcher": {"n_jobs": -2}}})) == max(1, plan.cores() - 1)
    assert command.jobs_at_once(OmegaConf.create({"hydra": {"launcher": {"_target_": "basic"}}})) == 1


AT_ONCE = """
import os, runpy, sys, time
sys.path[0] = ""  # the working directory, the checkout, as for python run.py: Hydra finds gem's sweeper there
go = sys.argv[1]
open(f"{go}.{os.getpid()}", "w").close()  # here, and waiting
while not os.path.exists(go):
    time.sleep(0.001)
sys.argv = ["run.py", *sys.argv[2:]]
runpy.run_path("run.py", run_name="__main__")
"""


def _wait_for(condition, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
def test_two_identical_sweeps_started_at_once_do_not_split_the_jobs(tmp_path):
    """Both commands passed the sweep's check before either had started a job, then split the jobs between them,
    each refusing the other's as `in use` and exiting 0. The sweep's folder is one command's: the other is
    refused in one line, before it runs anything."""
    sweep, go = tmp_path / "sweep", tmp_path / "go"
    script = tmp_path / "at_once.py"
    script.write_text(AT_ONCE)
    cmd = ["-m", "seed=0,1,2", *QUICK, "workers=2", f"hydra.sweep.dir={sweep}"]
    procs = [warm_run.Popen([str(go), *cmd], script=str(script)) for _ in range(2)]
    _wait_for(lambda: len(list(tmp_path.glob("go.*"))) == 2)  # both at the barrier, then off at the same instant
    go.touch()
    out = [p.communicate(timeout=600) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], out
    (won_out, won_err), (lost_out, lost_err) = out if codes[0] == 0 else out[::-1]
    assert [line for line in lost_err.splitlines() if line.strip()] == [
        f"error: hydra.sweep.dir={sweep} is in use by another sweep that is still going (its command holds the "
        "folder's lock); wait for it to end, or pick another sweep directory"
    ]
    assert lost_out.strip() == ""  # no job launched
    assert won_out.count("status          completed") == 3 and "error" not in won_err, won_err
    assert [_status(sweep / str(j)) for j in range(3)] == ["completed"] * 3


@pytest.mark.slow
def test_resume_while_the_sweep_still_runs_names_the_sweep(tmp_path):
    """`resume=true` while the sweep's command still runs (job 0 done, job 1 going) blamed job 0, "in use by a run
    that is still going": the sweep's command holds each job's folder until it exits. It is the sweep that goes on."""
    sweep = tmp_path / "sweep"
    cmd = ["-m", "epochs=1,200", *QUICK[:1], *QUICK[2:], "workers=2", f"hydra.sweep.dir={sweep}"]
    first = warm_run.Popen(cmd, start_new_session=True)
    try:
        _wait_for(lambda: (sweep / "0" / "summary.json").exists() and (sweep / "1").exists())
        done = snapshot(sweep / "0")
        p = run_py(*cmd, "resume=true")
        assert first.poll() is None, "the first sweep ended before its resume was tried"
        assert p.returncode == 2 and [line for line in p.stderr.splitlines() if line.strip()] == [
            f"error: resume=true: hydra.sweep.dir={sweep} is in use by a sweep that is still going (its command "
            "holds the folder's lock); wait for it to end; if it leaves jobs undone, this command then finishes them"
        ], p.stderr
        assert snapshot(sweep / "0") == done
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=300)


HOLD_WHEN_LAUNCHED = """
import os, sys, time
from pathlib import Path
from experiments import rundir
sweep = Path(sys.argv[1])
print("ready", flush=True)
while not (sweep / "multirun.yaml").exists():  # the sweep has passed its checks
    time.sleep(0.001)
rundir.claim(sweep / "1")
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_sweep_whose_job_was_refused_at_its_turn_exits_1(tmp_path):
    """A job refused when its turn comes (here its folder taken by another process after the sweep's checks) is one
    line, and the other jobs run; the sweep then says it did not do all it was asked, and exits 1 (it exited 0)."""
    sweep = tmp_path / "sweep"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_WHEN_LAUNCHED, str(sweep)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        # job 0 runs long enough for the holder to take job 1's folder
        p = run_py("-m", "seed=0,1,2", *QUICK, "epochs=5", "workers=2", f"hydra.sweep.dir={sweep}", timeout=600)
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait(30)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: hydra.run.dir={sweep / '1'} is in use by another run that is still going (it holds the "
        "directory's lock); wait for it to end, or pick another directory",
        "error: 1 of the 3 jobs of the sweep did not run (job 1: refused when its turn came, as the lines above "
        "say); the others ran",
    ], p.stderr
    assert [_status(sweep / str(j)) for j in (0, 2)] == ["completed"] * 2 and list((sweep / "1").iterdir()) == []


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["hydra/launcher=foo"],
            # (then joblib and submitit_*, where their plugins are installed)
            "error: hydra/launcher=foo is not an option; choose one of: basic, distributed_local, distributed_slurm",
        ),
        (["hydra/sweeper=foo"], "error: hydra/sweeper=foo is not an option; choose one of: basic, gem"),
        (
            ["hydra.launcher.n_jobs=2"],
            "error: hydra.launcher.n_jobs is not a key of the launcher this command uses (Key 'n_jobs' not in "
            "'BasicLauncherConf'); choose the launcher that has it on the same command (hydra/launcher=joblib for "
            "hydra.launcher.n_jobs, submitit_slurm, ...)",
        ),
        (
            ["hydra.foo=1"],
            "error: hydra.foo is not a key of Hydra's config (Key 'foo' not in 'HydraConf'); python run.py --cfg "
            "hydra shows its keys",
        ),
        (["hydra.job.chdir=maybe"], "error: hydra.job.chdir: Value 'maybe' is not a valid bool (type str)"),
        (
            ["-m", "hydra.launcher.n_jobs=1,2"],
            "error: hydra.launcher.n_jobs=1,2: Hydra's own keys cannot be swept; give one value (one command per "
            "value)",
        ),
    ],
)
def test_a_bad_override_of_hydras_own_config_is_one_line(argv, line, capsys):
    """Hydra answered these with several lines (its message, the config search path, HYDRA_FULL_ERROR) and exit
    code 1; the options a group has, or the key, are now in one line, exit code 2."""
    assert refused_line(capsys, *argv, "engine=sim").startswith(line)


def test_a_flag_between_overrides_is_named_with_the_command_in_order(capsys):
    """`python run.py engine=sim -m seed=0,1` got Hydra's `unrecognized arguments: seed=0,1`, which names the
    override, not the flag between two of them; the line now says so and gives the command in order."""
    line = refused_line(capsys, "engine=sim", "-m", "seed=0,1", "plan=true")
    assert line == (
        "error: Hydra reads its flags (-m, --cfg, ...) before the overrides or after them, not between them; put "
        "them first: python run.py -m engine=sim seed=0,1 plan=true"
    )
    from experiments.command import parse

    assert parse(["-m", "engine=sim", "seed=0,1", "plan=true"]).multirun  # the command it gives parses
    assert "--cfg job engine=sim seed=1" in refused_line(capsys, "engine=sim", "--cfg", "job", "seed=1")


def test_a_refusal_exits_when_its_line_cannot_be_written(monkeypatch):
    """`python run.py ... plan=true 2>&1 | head -2`: the plan's output met a closed pipe, and so did the refusal's
    line, whose BrokenPipeError left the Hydra callback as an exception, which Hydra turns into a warning: it then
    made the run directory (`no directory is made`, said the plan) and started the job. The refusal exits anyway."""
    import io

    from experiments import command

    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stderr", Closed())
    with pytest.raises(SystemExit) as e:
        command.refusing(lambda: print("a plan's line", file=Closed()))
    assert e.value.code == 2
