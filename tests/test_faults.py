"""Faults and bad input, as a user meets them (issue 14's table): a refused command changes nothing, a run
directory has one owner, and every fault ends with one clear line and a summary that says what happened.

Most commands here go through `python run.py` in a process of its own, as a user types them (forked from
tests/helpers/warm_run.py's server, which has imported torch once), on the `sim` engine and the embedded digits (fast);
generous timeouts because CI machines are shared.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import warm_run
from helpers.commands import refused_line, run_py, snapshot
from helpers.paths import ROOT
from helpers.procs import workers_of

# the tests that share this module's costly fixtures (runs): under pytest-xdist they run in one process
SHARED = pytest.mark.xdist_group("faults")


QUICK = ["engine=sim", "epochs=1", "logger.wandb.mode=disabled", "logger.progress=false"]
KILLED = [*QUICK, "epochs=10", "engine.checkpoint_every=40"]  # the run that `killed_run` kills


def one_line(p) -> str:
    """A refusal: exit code 2 and exactly one line on stderr."""
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """A sim run killed with SIGKILL after it wrote a checkpoint: what `resume=true` is for."""
    d = tmp_path_factory.mktemp("killed") / "run"
    p = warm_run.Popen([*KILLED, f"hydra.run.dir={d}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while not (d / "checkpoint" / "manifest.json").exists():
            assert p.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
        time.sleep(0.1)  # some rows after the checkpoint, which a resume must cut
    finally:
        p.kill()
        p.wait(30)
    assert not (d / "summary.json").exists()
    return d


@pytest.fixture
def killed(killed_run, tmp_path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(killed_run, d)
    return d


# --- the table, row by row


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("completed") / "x"
    assert run_py(*QUICK, f"hydra.run.dir={d}").returncode == 0
    return d


@pytest.mark.slow
@SHARED
def test_resume_of_a_completed_run_is_refused_and_changes_nothing(completed_run):
    d = completed_run
    before = snapshot(d)
    line = one_line(run_py(*QUICK, "resume=true", f"hydra.run.dir={d}"))
    assert line == f"error: resume=true: the run in {d} has already completed; nothing to resume"
    assert snapshot(d) == before  # summary.json still says completed, with its numbers
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
@SHARED
def test_a_new_run_never_writes_over_a_finished_one(completed_run, capsys):
    before = snapshot(completed_run)
    line = refused_line(capsys, *QUICK, "seed=1", f"hydra.run.dir={completed_run}")
    assert "already holds a completed run" in line and "hydra.run.dir" in line
    assert snapshot(completed_run) == before


@pytest.mark.slow
@SHARED
def test_resume_with_a_changed_key_is_refused_and_keeps_hydra_and_rows(killed):
    before = snapshot(killed)
    line = one_line(run_py(*KILLED, "lr=0.1", "resume=true", f"hydra.run.dir={killed}"))
    assert "lr" in line and "resume with the original command's overrides" in line
    assert snapshot(killed) == before  # .hydra/ and the rows after the checkpoint are as they were
    assert not (killed / "summary.json").exists()


@pytest.mark.slow
@SHARED
def test_a_truncated_central_checkpoint_is_refused_before_rows_are_cut(killed):
    central = next((killed / "checkpoint").glob("step-*")) / "central.pt"
    central.write_bytes(central.read_bytes()[:100])
    before = snapshot(killed)
    line = one_line(run_py(*KILLED, "resume=true", f"hydra.run.dir={killed}"))
    assert str(central) in line and "cannot be read" in line
    assert snapshot(killed) == before  # the row parts were neither merged nor cut


@pytest.mark.slow
@SHARED
def test_garbage_in_a_worker_checkpoint_is_one_line_without_torch_advice(killed):
    worker = next((killed / "checkpoint").glob("step-*")) / "worker-0.pt"
    worker.write_bytes(b"not a checkpoint at all" * 100)
    before = snapshot(killed)
    line = one_line(run_py(*KILLED, "resume=true", f"hydra.run.dir={killed}"))
    assert str(worker) in line and "weights_only" not in line
    assert snapshot(killed) == before


@pytest.mark.slow
def test_resume_in_a_directory_that_does_not_exist_creates_nothing(tmp_path):
    d = tmp_path / "fresh"
    line = one_line(run_py(*QUICK, "resume=true", f"hydra.run.dir={d}"))
    assert "does not exist" in line and "hydra.run.dir" in line
    assert not d.exists()


@pytest.mark.slow
def test_a_directory_in_use_is_refused_in_one_line(tmp_path):
    """The lock is the kernel's (flock): a second command on a directory held by a live run is refused, and a
    holder killed with SIGKILL releases it."""
    d = tmp_path / "same"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from experiments import rundir; "
            f"rundir.claim(__import__('pathlib').Path({str(d)!r})); print('held', flush=True); "
            "time.sleep(600)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line(run_py(*QUICK, f"hydra.run.dir={d}"))
        assert line.startswith(f"error: hydra.run.dir={d} is in use by another run")
        assert list(d.iterdir()) == []  # nothing written by the refused command
    finally:
        holder.kill()
        holder.wait(30)
    from experiments import rundir

    rundir.claim(d)  # SIGKILL released the lock: no stale lock file to clean up
    rundir.unclaim(d)
    assert list(d.iterdir()) == []


@pytest.mark.slow
def test_two_runs_started_together_on_one_directory(tmp_path):
    # whichever checks second is refused: "in use" while the other runs, "already holds" once it has finished
    d = tmp_path / "same"
    procs = [warm_run.Popen([*QUICK, f"seed={s}", f"hydra.run.dir={d}"]) for s in (1, 2)]
    out = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], out
    refused = out[[p.returncode for p in procs].index(2)][1]
    assert "is in use by another run" in refused or "already holds" in refused
    summary = json.loads((d / "summary.json").read_text())
    m = pd.read_parquet(d / "metrics.parquet")
    ev = pd.read_parquet(d / "eval.parquet")
    assert len(m) == summary["steps"] and m["step"].is_unique and ev["step"].is_unique
    winner = procs[[p.returncode for p in procs].index(0)]
    assert f"seed={summary['seed']}" in " ".join(winner.args)
    assert f"seed: {summary['seed']}" in (d / ".hydra" / "config.yaml").read_text()  # one run's config only


def test_an_unusable_run_directory_is_one_line(capsys):
    line = refused_line(capsys, *QUICK, "hydra.run.dir=/proc/gem-run")
    assert line == "error: hydra.run.dir=/proc/gem-run cannot be used as a run directory: No such file or directory"


@pytest.mark.parametrize(
    "args, figure",
    [(["engine=process", "workers=20000"], "worker processes"), (["engine=sim", "workers=100000"], "virtual workers")],
)
def test_too_many_workers_for_this_machine_is_refused(tmp_path, args, figure, capsys):
    line = refused_line(capsys, "logger.wandb.mode=disabled", *args, f"hydra.run.dir={tmp_path / 'x'}")
    assert line.startswith(f"error: {args[1]} is too many for this machine") and figure in line
    assert "is available; use at most workers=" in line
    assert not (tmp_path / "x").exists()


def test_the_memory_check_counts_no_slot_for_a_local_launchs_workers(tmp_path, capsys, monkeypatch):
    """engine=distributed with shared_memory=true, launched locally: the workers apply their commits to θ in rank
    0's window, the server's own θ, and have no Δ slot there (a torchrun worker's slot is not checked: the launcher
    places the ranks)."""
    from gem.engines import memory

    monkeypatch.setattr(memory, "available", lambda: 2**20)  # 1 MB: any run is refused, and says what it needs
    each = {}
    for shared in ("true", "false"):
        line = refused_line(
            capsys,
            "logger.wandb.mode=disabled",
            "engine=distributed",
            "workers=4",
            "model=alexnet_cifar",
            "data=synthetic",
            f"engine.shared_memory={shared}",
            f"hydra.run.dir={tmp_path / 'x'}",
        )
        each[shared] = float(line.split(" worker processes of ")[1].split(" MB each")[0])
    assert each["true"] == each["false"] > 0
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # real `python run.py` processes: 5 s
def test_an_unknown_key_is_refused_plus_included(tmp_path, capsys):
    line = one_line(run_py(*QUICK, "+foo=1", f"hydra.run.dir={tmp_path / 'x'}"))  # as typed, once
    assert line.startswith("error: foo is not a config key; top-level keys are: algorithm, engine")
    line = refused_line(capsys, *QUICK, "+engine.bar=1", f"hydra.run.dir={tmp_path / 'x'}")
    assert line.startswith("error: engine.bar is not a key of engine")
    assert not (tmp_path / "x").exists()


def test_removed_row_parts_do_not_pass_as_completed(tmp_path, monkeypatch):
    """Part files deleted while the run goes on: the summary says rows are missing, and the status is not
    `completed`."""
    from experiments.config import compose
    from experiments.runner import run
    from gem import metrics

    flush = metrics.PartWriter.flush

    def flush_then_lose(self):
        flush(self)
        if self.final.name == "metrics.parquet" and self.next_part == 3:  # someone removes the first part
            (self.parts / "part-000000.parquet").unlink()

    monkeypatch.setattr(metrics.PartWriter, "flush", flush_then_lose)
    cfg = compose([*QUICK, "logger.flush_every=5"])
    summary = run(cfg, tmp_path)
    assert summary["status"] == "failed"
    assert summary["reason"].startswith(
        f"metrics.parquet holds {summary['steps'] - 5} of the {summary['steps']} commit rows recorded"
    )
    assert summary["val_loss"] is None


def file_size_limit(nbytes: int):
    """A child's preexec_fn: files it writes stop at `nbytes`, and a write past that fails as on a full disk."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return limit


@pytest.mark.slow
def test_a_write_error_ends_the_run_with_one_line_and_no_temporary_files(tmp_path):
    """A file-size limit makes the first large write (a checkpoint) fail as a full disk does: the run ends
    failed, with the path and the OS's reason, and leaves no temporary file."""
    d = tmp_path / "x"
    p = run_py(
        *QUICK, "epochs=3", "engine.checkpoint_every=20", f"hydra.run.dir={d}", preexec_fn=file_size_limit(100_000)
    )
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write" in errors[0] and "File too large" in errors[0], p.stderr
    assert "Traceback" not in p.stderr
    # where to go from here, as after an interruption: its only checkpoint was the write that failed
    assert p.stderr.rstrip().endswith(
        "gem: the run failed; it had no checkpoint yet (engine.checkpoint_every), so resume=true cannot continue it: "
        f"run the command again with another hydra.run.dir ({d} keeps the rows of this one)"
    ), p.stderr
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot write" in summary["reason"]
    assert not list(d.rglob("*.tmp")) and not (d / "checkpoint" / "pending").exists()


@pytest.mark.slow
def test_a_disk_that_fills_at_a_row_flush_is_one_line_and_one_reason(tmp_path):
    """The rows' first flush (commit 40 of 92) fails as on a full disk. It gave two `error:` lines, and a reason
    that said the same error three times (the flush, then merging each table on the same disk)."""
    d = tmp_path / "x"
    p = run_py(
        *QUICK,
        "engine.checkpoint_every=0",
        "logger.flush_every=40",
        f"hydra.run.dir={d}",
        preexec_fn=file_size_limit(6_000),
    )
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot write {d}/metrics.parts/part-000000.parquet: File too large"], p.stderr
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == errors[0].removeprefix("error: ")


def test_lost_workers_is_a_list_on_every_status(tmp_path):
    from experiments.config import compose
    from experiments.runner import run

    done = run(compose(QUICK), tmp_path / "a")
    diverged = run(compose([*QUICK, "lr=10000"]), tmp_path / "b")
    assert (done["status"], done["lost_workers"]) == ("completed", [])
    assert diverged["status"] == "diverged" and diverged["lost_workers"] == []


@pytest.mark.slow
def test_every_worker_killed_fails_with_every_worker_lost(tmp_path):
    d = tmp_path / "x"
    p = warm_run.Popen(
        [
            "engine=process",
            "workers=2",
            "epochs=200",
            "logger.wandb.mode=disabled",
            "logger.flush_every=5",
            f"hydra.run.dir={d}",
        ]
    )
    try:
        deadline = time.monotonic() + 240
        while not (d / "metrics.parts").exists():  # the race is on: rows are on disk
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        workers = workers_of(p.pid)
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        p.communicate(timeout=300)
    finally:
        p.kill()
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_workers"] == [0, 1]


def test_the_interruption_line_says_how_to_go_on(tmp_path):
    """Ctrl-C and SIGTERM end with a line that says what resume=true will do with this run or sweep."""
    from experiments.command import resume_hint
    from gem.engines import checkpoint as ckpt

    assert resume_hint(tmp_path, False) == (
        "it had no checkpoint yet (engine.checkpoint_every), so resume=true cannot continue it: run the command "
        f"again with another hydra.run.dir ({tmp_path} keeps the rows of this one)"
    )
    assert resume_hint(tmp_path, True).endswith("resume=true (this job starts again: it had no checkpoint yet)")
    (tmp_path / ckpt.CHECKPOINT / "step-50").mkdir(parents=True)
    (tmp_path / ckpt.CHECKPOINT / "step-50" / "central.pt").write_bytes(b"")
    (tmp_path / ckpt.CHECKPOINT / "manifest.json").write_text('{"step": 50, "dir": "step-50"}')
    assert resume_hint(tmp_path, False) == (
        f"to continue from its checkpoint at commit 50, run the same command with resume=true hydra.run.dir={tmp_path}"
    )
    assert resume_hint(tmp_path, True).endswith("(this job resumes from its checkpoint at commit 50)")


def test_a_run_stopped_before_its_first_checkpoint_is_not_sent_to_resume(tmp_path):
    """A new run in the directory of one stopped before its first checkpoint was refused with "resume=true continues
    it", and resume=true was refused in turn ("no checkpoint"): a circle. The refusal now says where to go."""
    import json

    from experiments.rundir import Refused, check_fresh
    from gem.engines import checkpoint as ckpt

    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    with pytest.raises(Refused) as e:
        check_fresh(tmp_path)
    assert str(e.value) == (
        f"hydra.run.dir={tmp_path} already holds a run (status failed) that stopped before its first checkpoint, so "
        "resume=true cannot continue it; pick a new directory for a new run (results are never overwritten)"
    )
    (tmp_path / ckpt.CHECKPOINT / "step-50").mkdir(parents=True)
    (tmp_path / ckpt.CHECKPOINT / "manifest.json").write_text(json.dumps({"step": 50, "dir": "step-50"}))
    with pytest.raises(Refused, match="resume=true continues it from its last checkpoint"):
        check_fresh(tmp_path)


@pytest.mark.slow  # a fresh interpreter and a run of 2 processes: about 10 s
def test_the_command_leaves_no_child_behind_when_it_returns(tmp_path):
    """Right after `python run.py` returned, its forkserver and multiprocessing's resource tracker were still alive
    for a second or two. Now nothing of its session is left once it has returned."""
    from helpers.procs import in_session

    argv = ["workers=2", "epochs=1", "logger.wandb.mode=disabled", "logger.progress=false"]
    log = tmp_path / "log"
    with open(log, "w") as out:  # (a pipe would be waited on to its end: by then a helper holding it is gone)
        p = subprocess.Popen(
            [sys.executable, "run.py", *argv, f"hydra.run.dir={tmp_path / 'run'}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            p.wait(timeout=300)
        finally:
            p.kill()
    left = in_session(p.pid)  # the run's session: its pid
    err = log.read_text()
    for pid in left:  # (not to outlive the test)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert p.returncode == 0, err
    assert left == [], "alive after the command returned: " + ", ".join(map(str, left))


def test_a_changed_sim_schedule_names_its_engine_key(tmp_path):
    """resume=true with another staleness model named `staleness=gamma` and `cycle_cv=0.25`, which the command line
    refuses as unknown keys: the refusal now names engine.staleness and engine.cycle_cv, as the command writes them."""
    import dataclasses
    from types import SimpleNamespace

    from gem.algorithms import gem as gem_algo
    from gem.engines.checkpoint import CheckpointError, check_resumable, fingerprint
    from gem.engines.options import SimOptions

    def identity(**engine):
        return SimpleNamespace(
            algorithm="gem", workers=2, batch_size=64, epochs=1.0, seed=0, device="cpu", loss="nll",
            precision="fp32", model="mnist_cnn", data=SimpleNamespace(name="digits"),
            hp=gem_algo.Params(), engine=dataclasses.replace(SimOptions(), **engine),
        )  # fmt: skip

    manifest = {"fingerprint": fingerprint(identity())}
    with pytest.raises(CheckpointError) as e:
        check_resumable(manifest, identity(staleness="round_robin"))
    assert "made with engine.staleness=gamma, this command has engine.staleness=round_robin" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        check_resumable(manifest, identity(cycle_cv=0.5))
    assert "made with engine.cycle_cv=0.25, this command has engine.cycle_cv=0.5" in str(e.value)


def test_a_diverged_run_is_not_sent_to_resume(tmp_path, capsys):
    """A new run in the directory of a diverged one was refused with "resume=true continues it from its last
    checkpoint", and resume=true then took the same commits to the same non-finite θ (on sim, exactly): a circle.
    A diverged run is a result, as in a resumed sweep: both commands say to start a new run elsewhere."""
    import json

    from experiments.rundir import Refused, check_fresh
    from gem.engines import checkpoint as ckpt

    reason = "non-finite loss nan at worker 0, worker step 6 (commit 10)"
    (tmp_path / "summary.json").write_text(json.dumps({"status": "diverged", "reason": reason}))
    (tmp_path / ckpt.CHECKPOINT / "step-5").mkdir(parents=True)
    (tmp_path / ckpt.CHECKPOINT / "manifest.json").write_text(json.dumps({"step": 5, "dir": "step-5"}))
    with pytest.raises(Refused) as e:
        check_fresh(tmp_path)
    assert str(e.value) == (
        f"hydra.run.dir={tmp_path} already holds a run that diverged ({reason}), a result as a completed run is; "
        "pick a new directory for a new run (results are never overwritten)"
    )
    before = snapshot(tmp_path)
    line = refused_line(capsys, *QUICK, "resume=true", f"hydra.run.dir={tmp_path}")
    assert line == (
        f"error: resume=true: the run in {tmp_path} diverged ({reason}), a result as a completed run is; nothing "
        "to resume: start a new run (a smaller lr, say) in a new hydra.run.dir"
    )
    assert snapshot(tmp_path) == before


def test_resume_says_whether_the_directory_holds_no_run_or_one_without_a_checkpoint(tmp_path, capsys):
    """resume=true on a folder that never held a run, and on a run stopped before its first checkpoint, both said
    "no checkpoint in <dir>/checkpoint; resume needs the run directory of a run that wrote checkpoints", which
    sends the second to a directory it does not have. Each now says what the folder holds and where to go."""
    import json

    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused_line(capsys, *QUICK, "resume=true", f"hydra.run.dir={empty}")
    assert line == (
        f"error: resume=true: hydra.run.dir={empty} holds no run to continue (no summary.json, rows or checkpoint); "
        "resume needs hydra.run.dir=<the directory of the run to continue>"
    )
    early = tmp_path / "early"
    early.mkdir()
    (early / "summary.json").write_text(json.dumps({"status": "failed", "reason": "interrupted (Ctrl-C)"}))
    before = snapshot(early)
    line = refused_line(capsys, *QUICK, "resume=true", f"hydra.run.dir={early}")
    assert line == (
        f"error: resume=true: the run in {early} (status failed) stopped before its first checkpoint "
        "(engine.checkpoint_every), so it cannot be continued; run the command without resume=true in a new "
        "hydra.run.dir"
    )
    assert snapshot(early) == before and sorted(p.name for p in tmp_path.iterdir()) == ["early", "empty"]


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_plan_lists_no_run_its_command_would_refuse(tmp_path, capsys):
    """`plan=true` on a run directory that holds a completed run listed the job and its time, and the same command
    without plan=true was then refused: a sweep's plan refuses a folder that holds results, a run's plan now too,
    and still makes no directory."""
    import json

    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text(json.dumps({"status": "completed"}))
    line = refused_line(capsys, *QUICK, "plan=true", f"hydra.run.dir={done}")
    assert line == (
        f"error: hydra.run.dir={done} already holds a completed run; pick a new directory (results are never "
        "overwritten)"
    )
    line = refused_line(capsys, *QUICK, "plan=true", "resume=true", f"hydra.run.dir={done}")
    assert line == f"error: resume=true: the run in {done} has already completed; nothing to resume"
    from experiments.command import preflight

    with pytest.raises(SystemExit) as e:
        preflight([*QUICK, "plan=true", f"hydra.run.dir={tmp_path / 'new'}"])
    assert e.value.code == 0 and "plan for 1 job" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done"]  # the plan made no directory


def test_the_way_back_to_a_sweep_names_its_folder(tmp_path):
    """An interrupted sweep, a run started by hand in a job's folder, and analysis.tune on an unfinished sweep said
    "the identical -m command with resume=true": for a sweep in its default folder (multirun/<date>/<time>) that
    command makes a new folder, and resume=true is refused there. Each line now names hydra.sweep.dir."""
    import json

    from analysis import tune
    from experiments.command import resume_hint

    job = tmp_path / "sweep" / "3"
    job.mkdir(parents=True)
    assert resume_hint(job, True) == (
        f"to finish the sweep, run the identical -m command with hydra.sweep.dir={tmp_path / 'sweep'} resume=true "
        "(this job starts again: it had no checkpoint yet)"
    )
    (job / ".hydra").mkdir()
    (job / ".hydra" / "config.yaml").write_text("algorithm: {name: gem}\nworkers: 2\nseed: 0\nlr: 0.05\n")
    (job / "summary.json").write_text(json.dumps({"status": "failed", "algorithm": "gem", "workers": 2, "seed": 0}))
    with pytest.raises(ValueError) as e:
        tune._check_finished(tune.load.runs(tmp_path / "sweep"), tmp_path / "sweep")
    assert str(e.value).endswith(f"the identical -m command with hydra.sweep.dir={tmp_path / 'sweep'} resume=true")


def test_a_run_by_hand_in_a_sweeps_job_folder_names_the_sweep(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("{}\n")
    line = refused_line(capsys, *QUICK, f"hydra.run.dir={sweep / '0'}")
    assert line.endswith(f"finish the sweep with its identical -m command and hydra.sweep.dir={sweep} resume=true")
