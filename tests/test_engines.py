"""The engine contract, one suite for the three engines (docs/design.md): every commit once, staleness on the server's
clock, windowed commits, the same losses on every engine with one worker, checkpoints and resume, divergence,
lost workers and signals where an engine has real workers, and an algorithm the engines have never seen."""

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import warm_run
from helpers.engines import Killed, StoppingRecorder, hp_for, job, run
from helpers.paths import ROOT
from helpers.procs import descendants, hold_meta_for, in_session, is_alive, processes, workers_of
from helpers.rundir import check_run_dir

from gem import algorithms
from gem.algorithms import downpour
from gem.data import make_synthetic
from gem.engines import checkpoint, get
from gem.engines.coordinator import Ledger, Silence
from gem.engines.core import build_flat_model
from gem.engines.options import ProcessOptions
from gem.engines.server import Server
from gem.engines.worker import Worker
from gem.metrics import Recorder, read_table

ENGINES = ["sim", "process", "distributed"]
REAL = ["process", "distributed"]  # engines whose workers are processes
TIMING = ["time_s", "wait_s", "apply_s", "wait_commits", "sim_time"]  # measured, not computed


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


# ------------------------------------------------------------------------------------------ completion


@pytest.mark.parametrize("engine", ENGINES)
def test_every_commit_once_and_every_worker_step_once(data, tmp_path, engine):
    n, steps = 3, 2 * 256 // 32
    result, m = run(job(data, engine, n, epochs=2), tmp_path)
    assert result.status == "completed" and result.steps == n * steps, result
    assert m["step"].tolist() == list(range(1, n * steps + 1))  # the server's clock: each commit once, no gap
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(1, steps + 1))] * n
    assert m["time_s"].is_monotonic_increasing and (m["wait_s"] >= 0).all()
    assert m["pi_median"].notna().all() and m["central_energy"].notna().all()  # GEM's diagnostics came back
    assert len(pd.read_parquet(tmp_path / "tensors.parquet")) == 10 * len(m)
    assert result.extra["lost_workers"] == []
    if engine == "process":  # on the CPU θ lives in shared host memory (on one GPU: there, `central_device`)
        assert result.extra["central_device"] == "cpu"
    ev = read_table(tmp_path, "eval")["step"]
    if engine == "sim":  # every eval_every commits, and at the end
        assert ev.tolist() == [0, 16, 32, 48]
    else:  # taken at the server's clock once eval_every more commits are applied: within a worker's cycle of it
        assert ev.iloc[0] == 0 and ev.iloc[-1] == n * steps and ev.is_unique and ev.is_monotonic_increasing
    assert not workers_of(os.getpid())


@pytest.mark.parametrize("engine", ENGINES)
def test_staleness_is_the_number_of_commits_since_the_workers_pull(data, tmp_path, engine):
    _, m = run(job(data, engine, 3, epochs=2), tmp_path)
    # a worker pulls right after its own commit, so τ = commits by others between two of its commits
    for _, g in m.groupby("worker"):
        steps = g["step"].tolist()
        assert g["staleness"].iloc[0] == steps[0] - 1  # everyone starts from θ₀ at t = 0
        assert g["staleness"].tolist()[1:] == [b - a - 1 for a, b in zip(steps, steps[1:], strict=False)]
    assert m["staleness"].max() >= 1


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("algorithm", ["agn", "eamsgd"])
def test_a_window_commits_once_per_window(data, tmp_path, engine, algorithm):
    n, steps, window = 3, 2 * 256 // 32, 3  # 16 steps: five windows, and one cut short by the budget's end
    result, m = run(job(data, engine, n, algorithm, hp_for(algorithm, n, window=window), epochs=2), tmp_path)
    assert result.status == "completed" and result.steps == n * (steps // window) == len(m)
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [[3, 6, 9, 12, 15]] * n


class _CountingLink:
    """A link to a server in this process that counts how often the worker takes the turn."""

    def __init__(self, server):
        self.server, self.extra, self.turns, self.rows_seen = server, {}, 0, []

    def acquire(self, w):
        self.turns += 1
        return self.server.view(w)

    def submit(self, view, commit):
        pass

    def release(self):
        pass

    def now(self):
        return 0.0

    def clock(self):
        return 0.0

    def rows(self, row, tensors):
        self.rows_seen.append(row)


@pytest.mark.parametrize("algorithm, window", [("agn", 10), ("easgd", 4), ("downpour", 1)])
def test_the_worker_cycle_takes_the_turn_only_when_it_commits(data, algorithm, window):
    """Every engine runs this cycle, so no engine takes the turn for a local step."""
    j = job(data, "sim", 1, algorithm, hp_for(algorithm, 1, window=window), epochs=5)  # 40 steps
    algo = algorithms.get(algorithm)
    model = build_flat_model(j)
    link = _CountingLink(Server.create(algo, j.hp, model.param.clone(), 1))
    worker = Worker(0, j, algo, model)
    while worker.cycle(link):
        pass
    assert worker.step == 40 and link.turns == 40 // window == len(link.rows_seen)
    assert [r["worker_step"] for r in link.rows_seen] == list(range(window, 41, window))[: 40 // window]


def _copy(d):
    return {
        k: _copy(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()
    }


class _SavingLink(_CountingLink):
    """Takes a checkpoint of the worker and the server at the worker's `at`-th turn, as the process and
    distributed engines do: while the worker waits for the turn, with a gradient in hand."""

    def __init__(self, server, at):
        super().__init__(server)
        self.at, self.worker, self.saved = at, None, None

    def acquire(self, w):
        if self.turns + 1 == self.at:
            self.saved = _copy(self.worker.state_dict(in_hand=True)), _copy(self.server.state_dict())
        return super().acquire(w)


@pytest.mark.parametrize("algorithm", algorithms.ALGORITHMS)
def test_a_worker_checkpointed_at_its_turn_makes_the_same_commit_when_resumed(data, algorithm):
    """The state a worker saves while it waits for the turn (before the gradient in hand, which it takes again
    when resumed) must lead to exactly the commit it was about to make: nothing done before the turn may leak
    into the saved state (GEM's prepare, say), nothing may be missing from it."""
    hp = hp_for(algorithm, 1, **({"window": 2} if "window" in hp_for(algorithm, 1).__dataclass_fields__ else {}))
    j = job(data, "sim", 1, algorithm, hp, epochs=2)
    algo = algorithms.get(algorithm)

    def worker_and_link(at):
        model = build_flat_model(j)
        link = _SavingLink(Server.create(algo, j.hp, model.param.clone(), 1), at)
        link.worker = Worker(0, j, algo, model)
        return link.worker, link

    original, link = worker_and_link(at=3)
    for _ in range(3):  # commits 1..3: the state is saved at the third turn, before its commit
        assert original.cycle(link)
    after = _copy(original.state_dict()), _copy(link.server.state_dict()), link.rows_seen[-1]
    worker_state, server_state = link.saved
    resumed, link2 = worker_and_link(at=0)
    resumed.load_state_dict(worker_state)
    link2.server.load_state_dict(server_state)
    assert resumed.cycle(link2)
    row = link2.rows_seen[-1]
    timing = {"time_s", "wait_s", "apply_s"}
    assert {k: v for k, v in row.items() if k not in timing} == {k: v for k, v in after[2].items() if k not in timing}
    for key, value in _copy(resumed.state_dict()).items():
        ref = after[0][key]
        if isinstance(value, dict):
            assert value.keys() == ref.keys() and all(torch.equal(value[k], ref[k]) for k in value), key
        else:
            assert torch.equal(value, ref) if isinstance(value, torch.Tensor) else value == ref, key
    assert torch.equal(link2.server.theta, after[1]["theta"])


# ------------------------------------------------------------------------------ one worker, every engine


@pytest.mark.slow
# (ssgd with one worker is sgd; test_baselines.py runs it with three on every engine)
@pytest.mark.parametrize("algorithm", [a for a in algorithms.ALGORITHMS if a != "ssgd"])
def test_one_worker_gives_the_same_losses_on_every_engine(data, tmp_path, algorithm):
    """Same θ₀, data stream, dropout stream, threads and arithmetic: with workers=1 the engines differ only in
    transport, and on this machine they agree to the bit. (The tolerance allows for a machine where torch's
    default thread count, which sim uses, differs from floor(cores / workers): reductions in another order differ
    in the last bits.)"""
    hp = hp_for(algorithm, 1, **({"window": 2} if "window" in hp_for(algorithm, 1).__dataclass_fields__ else {}))
    losses = {}
    for engine in ENGINES:
        result, m = run(job(data, engine, 1, algorithm, hp, epochs=2), tmp_path / engine)
        assert result.status == "completed", (engine, result)
        losses[engine] = m["loss"].tolist()
    assert len(losses["sim"]) == 16 // algorithms.get(algorithm).commit_every(hp)
    for engine in REAL:
        assert losses[engine] == pytest.approx(losses["sim"], abs=1e-6, rel=0), engine


# ------------------------------------------------------------------------ an algorithm no engine knows

SCRATCH = '''
"""θ ← θ + Δ/(τ + 1)^p: a staleness-dependent learning rate, written against the record and nothing else."""
from dataclasses import dataclass, replace

from gem.algorithms import downpour


@dataclass(frozen=True)
class Params(downpour.Params):
    power: float = 0.5


def worker_rule(state, x, grad, view, hp):
    commit = downpour.worker_rule(state, x, grad, view, hp)
    commit.metrics["scale"] = 1.0 / (view.staleness + 1) ** hp.power  # what the server rule will use
    return commit


def server_rule(view, commit, hp):
    view.theta.add_(commit.delta, alpha=1.0 / (view.staleness + 1) ** hp.power)


ALGORITHM = replace(downpour.ALGORITHM, name="power_lr", Params=Params, worker_rule=worker_rule,
                    server_rule=server_rule)
'''


@pytest.fixture
def scratch_algorithm(tmp_path, monkeypatch):
    pkg = tmp_path / "scratch_algos"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "power_lr.py").write_text(textwrap.dedent(SCRATCH))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the parent's sys.path
    return "scratch_algos.power_lr"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_a_new_algorithm_runs_on_every_engine_unchanged(data, tmp_path, scratch_algorithm, engine):
    params = algorithms.get(scratch_algorithm).Params
    result, m = run(job(data, engine, 3, scratch_algorithm, params(power=0.5), epochs=2), tmp_path / "new")
    assert result.status == "completed" and len(m) == 3 * 16
    assert m["scale"].tolist() == pytest.approx((1 / (m["staleness"] + 1) ** 0.5).tolist())
    assert m["staleness"].max() >= 1
    if engine == "sim":  # power 0 is downpour, commit for commit
        _, zero = run(job(data, engine, 3, scratch_algorithm, params(power=0.0), epochs=2), tmp_path / "p0")
        _, ref = run(job(data, engine, 3, "downpour", downpour.Params(), epochs=2), tmp_path / "downpour")
        assert zero["loss"].tolist() == ref["loss"].tolist()


# ------------------------------------------------------------------------------------------ divergence


@pytest.mark.parametrize("engine", ENGINES)
def test_divergence_stops_every_worker(data, tmp_path, engine):
    result, m = run(job(data, engine, 3, "downpour", downpour.Params(lr=1e8), epochs=4), tmp_path)
    assert result.status == "diverged" and "non-finite" in result.reason
    assert m["step"].tolist() == list(range(1, len(m) + 1))  # the commits before it, each once
    assert not workers_of(os.getpid())


# ------------------------------------------------------------------------------------ checkpoints, resume


class _DyingRecorder(Recorder):
    """A recorder whose process is killed once `after` commits are recorded, and a checkpoint exists."""

    def __init__(self, d, after):
        super().__init__(d, flush_every=5)
        self.after = after

    def commit(self, row, tensors=None):
        super().commit(row, tensors)
        if self.commits >= self.after and (self.run_dir / "checkpoint" / "manifest.json").exists():
            self.flush()
            raise Killed()


def test_a_checkpoints_server_tensors_of_another_shape_are_refused_not_broadcast(tmp_path):
    """A checkpoint written by another version of an algorithm (ssgd's round was θ-sized before it became a row
    per worker) must not be copied in by broadcasting; the error names the tensor and both shapes."""
    from gem.engines.server import Server

    algo = algorithms.get("ssgd")
    server = Server.create(algo, algo.Params(workers=3), torch.zeros(5), 3)
    saved = server.state_dict() | {"server": {"round": torch.ones(5), "m": torch.ones(5)}}
    with pytest.raises(ValueError, match=r"central server.round is \(5,\) there but \(3, 5\) in this run"):
        server.load_state_dict(saved)
    assert server.state["round"].eq(0).all() and server.state["m"].eq(0).all()  # nothing copied
    # and before a run starts (experiments.rundir calls verify before it cuts anything of the run directory)
    checkpoint.save_atomic(saved, tmp_path / "central.pt")
    with pytest.raises(checkpoint.CheckpointError, match=r"^resume=true: central server.round is \(5,\) there"):
        checkpoint.verify({"path": str(tmp_path)}, 3, algo, algo.Params(workers=3))
    checkpoint.save_atomic(server.state_dict() | {"coordinator": {"finished": [0, 1, 2]}}, tmp_path / "central.pt")
    checkpoint.verify({"path": str(tmp_path)}, 3, algo, algo.Params(workers=3))  # this version's own: accepted


@pytest.mark.parametrize(
    "staleness, algorithm, hp",
    [
        ({"staleness": "exponential"}, "gem", {}),
        ({"staleness": "gamma", "cycle_cv": 0.5}, "gem", {}),
        # DyLU: each worker's pace and window are its state too (a resumed worker must size its windows as before)
        ({"staleness": "stragglers"}, "async_localsgd", {"window": 4, "dynamic_window": True}),
        ({"staleness": "gamma", "cycle_cv": 0.5}, "async_localsgd", {"window": 4, "dynamic_window": True}),
    ],
)
def test_a_resumed_sim_run_is_the_uninterrupted_run(data, tmp_path, staleness, algorithm, hp):
    """sim is deterministic, and its checkpoint holds every random stream and the event queue: a run killed after
    a checkpoint and resumed gives exactly the rows of a run never killed, whatever it recorded after the
    checkpoint before it died."""

    def make(d, resume=None):
        return job(
            data,
            "sim",
            4,
            algorithm,
            hp_for(algorithm, 4, **hp),
            epochs=3,
            run_dir=str(d),
            checkpoint_every=10,
            resume=resume,
            options=staleness,
        )

    whole, m_whole = run(make(tmp_path / "whole"), tmp_path / "whole")
    d = tmp_path / "killed"
    with pytest.raises(Killed):
        get("sim").run(make(d), _DyingRecorder(d, after=27))
    manifest = checkpoint.read_manifest(d)
    assert manifest["step"] == 20 and len(read_table(d)) > 20  # rows after the checkpoint were on disk
    rec = Recorder(d, resume_step=manifest["step"])
    result = get("sim").run(make(d, manifest), rec)
    rec.close()
    assert result.status == whole.status == "completed" and result.steps == whole.steps
    m = read_table(d)
    cols = [c for c in m_whole.columns if c not in TIMING]
    pd.testing.assert_frame_equal(m[cols], m_whole[cols])
    t, t_whole = (read_table(p, "tensors") for p in (d, tmp_path / "whole"))  # (GEM's π per tensor; others: none)
    pd.testing.assert_frame_equal(t, t_whole)
    ev, ev_whole = (read_table(p, "eval").drop(columns="time_s") for p in (d, tmp_path / "whole"))
    pd.testing.assert_frame_equal(ev, ev_whole)


@pytest.mark.slow
@pytest.mark.parametrize("engine", REAL)
@pytest.mark.parametrize("algorithm", ["gem", "downpour"])  # downpour's worker state is empty
def test_resume_continues_every_worker_where_the_checkpoint_left_it(data, tmp_path, monkeypatch, engine, algorithm):
    """Killed the moment its first checkpoint is on disk, a run resumes every worker from its own state: the live
    ones run their steps to the end exactly once, and one that the checkpoint lists as lost (or finished) does not
    start again."""
    real_finish = checkpoint.finish

    def finish_then_die(*args, **kw):
        real_finish(*args, **kw)
        raise Killed()

    epochs = 8  # 64 steps per worker, 192 commits
    steps_each = epochs * 256 // 32

    def make(resume=None):
        # an early checkpoint and no evaluation before the end. The coordinator asks for a checkpoint when it next
        # looks at the clock (it wakes on the workers' row batches, or every POLL_S): DOWNPOUR's 48 commits of a
        # 2-epoch run could all be served before that, and the run end with no checkpoint (1 run in 6, and in CI)
        return job(
            data,
            engine,
            3,
            algorithm,
            epochs=epochs,
            run_dir=str(tmp_path),
            checkpoint_every=4,
            eval_every=3 * steps_each,
            resume=resume,
        )

    monkeypatch.setattr(checkpoint, "finish", finish_then_die)
    with pytest.raises(Killed):
        get(engine).run(make(), Recorder(tmp_path, flush_every=5))
    monkeypatch.setattr(checkpoint, "finish", real_finish)
    assert not workers_of(os.getpid())
    manifest = checkpoint.read_manifest(tmp_path)
    step = manifest["step"]
    central = checkpoint.load_central(manifest)  # worker 2 was lost before the checkpoint
    central["coordinator"]["lost_workers"].append(2)
    central["coordinator"]["lost"].append("worker 2 lost (by the test)")
    checkpoint.save_atomic(central, Path(manifest["path"]) / "central.pt")
    rec = Recorder(tmp_path, resume_step=step)
    result = get(engine).run(make(manifest), rec)
    rec.close()
    assert result.status == "completed" and result.extra["lost_workers"] == [2], result
    m = read_table(tmp_path)
    assert m["step"].tolist() == list(range(1, len(m) + 1))  # every commit once
    steps = m.groupby("worker")["worker_step"].apply(list)
    assert steps[0] == steps[1] == list(range(1, steps_each + 1))
    # worker 2 does not start again: its steps (none, if the checkpoint came before its first commit, as on a loaded
    # machine) all lie before the checkpoint
    lost = steps.get(2, [])
    assert lost == list(range(1, len(lost) + 1)) and (m.loc[m["worker"] == 2, "step"] <= step).all()
    assert not (tmp_path / "checkpoint").exists()  # a completed run cannot be resumed: its checkpoint is gone


def test_the_ledger_drops_a_row_it_has_recorded_or_marked_lost(tmp_path):
    """A lost worker's row can arrive after its commit was marked lost; it must not stall the clock."""
    rec = Recorder(tmp_path)
    ledger = Ledger(rec, [])
    ledger.add({"step": 1, "worker": 0, "worker_step": 1, "staleness": 0, "loss": 1.0, "time_s": 0.1})
    ledger.fill_gaps(2)  # step 2's row never came: marked lost
    ledger.add({"step": 2, "worker": 1, "worker_step": 1, "staleness": 1, "loss": 1.0, "time_s": 0.2})  # late
    ledger.add({"step": 3, "worker": 0, "worker_step": 2, "staleness": 1, "loss": 1.0, "time_s": 0.3})
    ledger.fill_gaps(3)
    rec.close()
    assert read_table(tmp_path)["worker"].tolist() == [0, -1, 0]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_resume_after_the_main_process_is_killed(tmp_path, engine):
    """SIGKILL the process that writes the run directory (sim's only process, process's coordinator, rank 0 of a
    local distributed launch) after a checkpoint; its workers must exit on their own; resume=true finishes the
    run with every commit exactly once and every worker's steps 1..N exactly once."""
    args = ["epochs=3", "engine.checkpoint_every=25"]  # 207 commits: the kill falls well before the end
    p, d = _start(tmp_path, *args, engine=engine)
    kids = descendants(p.pid)
    step = _wait_for_checkpoint(d, p, 50)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(is_alive(k) for k in kids):  # orphans notice and exit (reaped by init)
        assert time.monotonic() < deadline, "workers outlived their coordinator"
        time.sleep(0.2)
    step = json.loads((d / "checkpoint" / "manifest.json").read_text())["step"]
    assert len(read_table(d)) >= step  # rows up to the checkpoint are on disk (and perhaps some after it)

    r = warm_run.run_py(
        f"engine={engine}",
        "workers=3",
        "algorithm=gem",
        "logger.wandb.mode=disabled",
        "logger.flush_every=5",
        f"hydra.run.dir={d}",
        *args,
        "resume=true",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"resuming from the checkpoint at commit {step}" in r.stdout
    budget = 3 * (1500 // 64)
    summary, m, ev = check_run_dir(d, steps=3 * budget)  # each step exactly once, no gap
    assert summary["status"] == "completed" and summary["engine"] == engine
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(1, budget + 1))] * 3
    assert ev["step"].is_unique and ev["step"].is_monotonic_increasing
    t = pd.read_parquet(d / "tensors.parquet")
    assert len(t) == 10 * len(m) and not t.duplicated(["step", "tensor_index"]).any()


@pytest.mark.slow
def test_resume_refuses_a_missing_or_foreign_checkpoint_with_one_line(tmp_path, data):
    from gem.engines.checkpoint import CheckpointError, check_resumable, read_manifest

    with pytest.raises(CheckpointError, match="no checkpoint in"):
        read_manifest(tmp_path)
    folder = checkpoint.pending(tmp_path)
    checkpoint.finish(tmp_path, folder, 10, {"theta": None}, job(data, "process", 3), 1.0)
    (tmp_path / "checkpoint" / "step-000000010" / "central.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        read_manifest(tmp_path)
    (tmp_path / "checkpoint" / "step-000000010" / "central.pt").write_bytes(b"not a checkpoint")
    manifest = read_manifest(tmp_path)
    with pytest.raises(CheckpointError, match="made with workers=3, this command has workers=2"):
        check_resumable(manifest, job(data, "process", 2))
    with pytest.raises(CheckpointError, match="made with engine=process, this command has engine=sim"):
        check_resumable(manifest, job(data, "sim", 3))
    r = warm_run.run_py(
        "engine=process",
        "workers=3",
        "algorithm=gem",
        "epochs=1",
        "batch_size=32",
        "data=synthetic",
        "data.synthetic.train_size=256",
        "data.synthetic.val_size=64",
        "data.synthetic.seed=1",
        "logger.wandb.mode=disabled",
        f"hydra.run.dir={tmp_path}",
        "resume=true",
        timeout=300,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr  # a refusal: one line, exit code 2
    assert lines[0].startswith("error: resume=true: checkpoint file") and "central.pt cannot be read" in lines[0]
    assert not workers_of(os.getpid())


# ---------------------------------------------------------------------------- lost workers and signals


def test_the_silence_rule():
    """A worker is lost when it has not made progress for longer than max(engine.timeout_s, engine.silent_cycles x
    the median time between two commits of a worker): the one rule of every engine with real workers."""
    s = Silence(timeout_s=2.0, cycles=10)
    s.start([0, 1, 2], now=100.0)
    assert s.limit() == 2.0 and s.median() is None  # the floor until a cycle is known
    assert s.silent(101.0) == [] and [w for w, _ in s.silent(102.5)] == [0, 1, 2]
    s.progress(0, 100.01)  # the first commit may come at once (it waited for the start): no cycle
    assert s.median() is None
    for k in range(1, 11):  # then workers 0 and 1 commit every 0.5 s; worker 2 is silent
        s.progress(0, 100.0 + 0.5 * k)
        s.progress(1, 100.0 + 0.5 * k)
    assert s.median() == 0.5 and s.limit() == 5.0  # 10 cycles of 0.5 s beat the 2 s floor
    assert s.silent(105.5) == [(2, 5.5)]
    assert s.why(5.5) == "silent for 5.5 s, limit 5.0 s = max(engine.timeout_s, 10 x median cycle 0.5 s)"
    s.seen(2, 105.0)  # waiting for the server behind another worker: not silent through its own fault
    assert s.silent(105.5) == [] and [w for w, _ in s.silent(110.1)] == [0, 1, 2]
    s.forget(2)  # lost, or finished: no longer watched
    assert s.silent(200.0) == [(0, 95.0), (1, 95.0)] and s.watched() == [0, 1]
    s.progress(0, 104.0)  # a row that arrives late changes neither its last commit nor the cycles
    assert s.median() == 0.5 and s.since[0] == 105.0
    s.progress(3, 1.0)  # a worker not watched: ignored
    assert s.watched() == [0, 1]
    slow = Silence(timeout_s=60, cycles=10)  # a windowed algorithm, a large model: cycles of 30 s
    slow.start([0], 0.0)
    for k in range(4):
        slow.progress(0, 30.0 * k)
    assert slow.limit() == 300.0 and slow.silent(300.0) == [] and slow.silent(391.0) == [(0, 301.0)]
    resumed = Silence.of(ProcessOptions(timeout_s=7, silent_cycles=4))  # the job's options; the timers start anew
    assert (resumed.floor, resumed.cycles, resumed.limit(), resumed.watched()) == (7.0, 4.0, 7.0, [])
    assert (Silence.of({}).floor, Silence.of({}).cycles) == (60.0, 10.0)


@pytest.mark.slow
@pytest.mark.parametrize("engine", REAL)
def test_a_killed_worker_is_recorded_and_the_run_goes_on(tmp_path, engine):
    # with checkpoints every 50 commits, the loss often falls in or next to one
    p, d = _start(tmp_path, "epochs=8", "engine.checkpoint_every=50", engine=engine)
    deadline = time.monotonic() + 120
    while set(read_table(d).get("worker", [])) < {0, 1, 2}:  # every worker's rows have reached the disk
        assert time.monotonic() < deadline and p.poll() is None, "not every worker reported a commit"
        time.sleep(0.1)
    victim = workers_of(p.pid)[1]
    os.kill(victim, signal.SIGKILL)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    # a failed run exits 1 with its reason in the summary on stdout, not on stderr
    assert p.returncode == 0, out[-2000:] + err
    summary, m, ev = check_run_dir(d)
    assert summary["status"] == "completed"
    assert len(summary["lost_workers"]) == 1 and "lost at commit" in summary["reason"], summary
    lost_at = int(summary["reason"].split("lost at commit ")[1].split()[0])
    # recording did not stall at the victim's missing rows: evaluations go on between the loss and the end
    assert ((ev["step"] > lost_at + 100) & (ev["step"] < summary["steps"])).any(), (lost_at, ev["step"].tolist())
    assert summary["final_train_loss"] is not None and summary["mean_staleness"] > 0
    lost = summary["lost_workers"][0]
    budget = 8 * (1500 // 64)
    # rows the victim had not yet sent are lost with it; their commits are marked, so the clock has no gap
    marked = m[m["worker"] == -1]
    assert len(marked) <= 16 and (marked.get("lost_row", pd.Series(dtype=bool)) == True).all()  # noqa: E712
    done = m[m["worker"] >= 0].groupby("worker")["worker_step"].max()
    assert done.get(lost, 0) < budget and all(done[w] == budget for w in done.index if w != lost)
    # seen by its process's exit code or, on engine=distributed, by its connection closing mid-commit
    assert "lost" in out and ("process died" in summary["reason"] or "connection closed" in summary["reason"])
    assert set(summary["commit_shares"]) == {"0", "1", "2"}


def _lost_one(job_, rec, lost):
    """Run; the run completes without worker `lost`, lost for its silence, as a killed worker is."""
    try:
        result = get(job_.engine.name).run(job_, rec)
    finally:
        rec.close()
    m, ev = read_table(rec.run_dir), read_table(rec.run_dir, "eval")
    assert result.status == "completed", result
    assert result.extra["lost_workers"] == [lost], result
    assert result.reason.startswith(f"worker {lost} lost at commit ") and "(silent for " in result.reason, result
    assert "max(engine.timeout_s, 3 x median cycle " in result.reason
    assert m["step"].tolist() == list(range(1, result.steps + 1))  # every commit once; its unsent rows marked
    done = m[m["worker"] >= 0].groupby("worker")["worker_step"].max()
    assert all(done[w] == 8 * 256 // 32 for w in done.index if w != lost)  # the others did all their work
    assert ev["step"].iloc[-1] == result.steps  # the final evaluation
    assert not workers_of(os.getpid())
    return result, m


@pytest.mark.slow
@pytest.mark.parametrize("engine", REAL)
def test_a_frozen_worker_is_lost_and_the_run_completes(data, tmp_path, engine, capsys):
    """SIGSTOP one of three workers mid-run: alive, but it makes no progress. Once it has not committed for
    longer than max(engine.timeout_s, engine.silent_cycles x the median cycle) it is killed and recorded, as a
    killed worker is, and the run completes with the others. (distributed, launched locally: a worker often freezes
    holding the turn, as on process, and the others wait in line; they are not to blame.)"""
    rec = StoppingRecorder(tmp_path, victim=1, after=10)
    result, _ = _lost_one(job(data, engine, 3, epochs=8, options={"timeout_s": 5, "silent_cycles": 3}), rec, 1)
    assert rec.stopped_at is not None
    assert 5 <= float(result.reason.split("silent for ")[1].split()[0]) < 60, result.reason
    lines = [line for line in capsys.readouterr().out.splitlines() if "lost at commit" in line]
    assert (
        len(lines) == 1
        and lines[0].startswith("gem: worker 1 lost at commit ")
        and lines[0].endswith("; the run goes on with the others")
    ), lines


@pytest.mark.slow
@pytest.mark.parametrize("engine", REAL)
def test_a_worker_hung_holding_the_server_is_lost_and_the_others_go_on(data, tmp_path, engine):
    """Worker 1 hangs inside its worker rule at its 5th commit (tests/gem_test_algos/hang_at_turn.py), that is
    while it holds the server's turn (process, and distributed launched locally), so every other worker waits for
    it. They are not to blame; it is killed, the server goes on, and the run completes."""
    j = job(
        data,
        engine,
        3,
        "gem_test_algos.hang_at_turn",
        downpour.Params(),
        epochs=8,
        options={"timeout_s": 5, "silent_cycles": 3},
    )
    result, m = _lost_one(j, Recorder(tmp_path), 1)
    assert result.steps == 2 * 8 * 256 // 32 + 4  # its first four commits, and never its 5th
    assert (m["worker"] == 1).sum() + m["worker"].eq(-1).sum() == 4  # their rows, or rows marked lost


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_and_sigterm_leave_no_child_behind(tmp_path, sig, code, engine):
    p, d = _start(tmp_path, "epochs=1000", engine=engine, fresh=True)
    kids = descendants(p.pid)
    if sig == "SIGINT":
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    else:
        p.send_signal(signal.SIGTERM)  # what a scheduler does: the main process only
    err = _ended(p)
    assert p.returncode == code, err
    assert "resume=true" in err.splitlines()[-1], err  # the last line says how to go on
    time.sleep(0.5)
    alive = {k: processes().get(k, (0, "", ""))[2] for k in kids if is_alive(k)}
    assert alive == {}, f"children left behind: {alive}"
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "failed" and "interrupted" in summary["reason"]
    m = pd.read_parquet(d / "metrics.parquet")
    assert m["step"].tolist() == list(range(1, len(m) + 1))


# a process of its own session: a Ctrl-C to its process group comes in while the forkserver is being started
# (right after it was spawned, before worker_context returns); prints what came of it
_CTRL_C_AT_START = r"""
import multiprocessing.util, os, signal, sys, threading, time
from gem.engines.worker import worker_context

spawn = multiprocessing.util.spawnv_passfds
def spawn_then_ctrl_c(path, args, fds):
    pid = spawn(path, args, fds)
    if "forkserver" in str(args):
        os.killpg(0, signal.SIGINT)  # reaches a thread that does not block it (torch's), or waits for this one
        time.sleep(0.2)  # for that thread's: Python acts on it at the next chance, here still in ensure_running
    return pid
multiprocessing.util.spawnv_passfds = spawn_then_ctrl_c
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # as a coordinator runs tqdm's, W&B's
try:
    ctx = worker_context()
    time.sleep(5)
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
p = worker_context().Process(target=time.sleep, args=(0,))  # the same forkserver, alive, forks
p.start(); p.join(120)
print("worker exit code", p.exitcode, flush=True)
"""


@pytest.mark.slow  # an interpreter that imports torch, and a forkserver that does
def test_a_ctrl_c_while_the_forkserver_starts_reaches_the_coordinator_and_spares_the_forkserver():
    """The forkserver is started with Ctrl-C held off, so that a terminal's Ctrl-C does not kill it while it imports
    torch. It was ignored in the coordinator for that moment, and a Ctrl-C that came then was lost: the run went on
    (seen twice in one suite on a loaded machine, the Ctrl-C tests below). Now it is blocked, and held where the
    kernel gives it to another thread, and acted on once the forkserver is recorded (acted on inside, it left a
    forkserver nobody knew of, and the next run started a second, a second Ctrl-C with it here)."""
    r = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AT_START],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert r.stdout.splitlines() == ["interrupted", "worker exit code 0"], r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("engine", REAL)
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_and_sigterm_while_the_workers_start_leave_nothing_behind(tmp_path, sig, code, engine):
    """Interrupted while its first worker was being started, that is while the forkserver imports torch (about 2 s
    here), every run did something wrong: a terminal's Ctrl-C killed the forkserver too, with a traceback under the
    run's last line; and the coordinator exited without knowing of the child the forkserver made next, which ran
    alone (here it died at once, with a traceback of its own: its semaphores were gone)."""
    d = tmp_path / "run"
    p = _fresh(
        [
            f"engine={engine}",
            "workers=3",
            "algorithm=gem",
            "logger.wandb.mode=disabled",
            "epochs=1000",
            f"hydra.run.dir={d}",
        ]
    )
    deadline = time.monotonic() + 120
    while not [k for k in descendants(p.pid) if "forkserver" in processes().get(k, (0, "", ""))[2]]:
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"no forkserver: {p.communicate()[1][-2000:]}")
        time.sleep(0.02)
    assert not workers_of(p.pid)  # still importing: no worker yet
    if sig == "SIGINT":
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGTERM)
    err = _ended(p)
    assert p.returncode == code, err
    assert "Traceback" not in err, err
    assert "resume=true" in err.splitlines()[-1], err
    # the forkserver, and any child it made, are gone: the forkserver leaves once its imports are done (the
    # machine may be loaded) and it sees the coordinator gone
    deadline = time.monotonic() + 60
    while left := in_session(p.pid):
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.2)


class _Interrupted(Exception):
    pass


def test_an_interruption_while_a_worker_starts_waits_for_it_to_be_recorded():
    """interrupts_held: a signal inside the block acts at its end (the handler the block found), a second one at
    once; the handler is the same after it."""
    from gem.engines.worker import interrupts_held

    def interrupt(signum, frame):
        raise _Interrupted(signum)

    old, done = signal.signal(signal.SIGTERM, interrupt), []
    try:
        with pytest.raises(_Interrupted), interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # Python runs its handler here, in this thread: held
            done.append("recorded")
        assert done == ["recorded"]
        with pytest.raises(_Interrupted), interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)  # asked twice: now
            time.sleep(0.05)
            done.append("not reached")
        assert done == ["recorded"] and signal.getsignal(signal.SIGTERM) is interrupt
    finally:
        signal.signal(signal.SIGTERM, old)


# ------------------------------------------------------------------------------------------------ helpers


def _fresh(args, start_new_session=True):
    """`python run.py <args>` in a fresh interpreter, as a terminal starts it: for the Ctrl-C tests. Runs forked by
    the warm server did not end on a Ctrl-C in some whole suites. One cause was the suite's own start in the
    background, with Ctrl-C ignored, which tests/conftest.py now undoes; but a warm run on `distributed` missed its
    Ctrl-C once more after that (CI, 2026-11-29, one of three suites), not yet explained, and a warm run dumps no
    stacks (PYTHONFAULTHANDLER is read when an interpreter starts). So these tests stay fresh."""
    return subprocess.Popen(
        [sys.executable, "run.py", *args],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=start_new_session,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a hung run's stacks: _ended
    )


def _ended(p, timeout_s=180):
    """The stderr of an interrupted run once it has ended; a loaded machine (the suite beside other jobs) stops
    slowly. Where it has not ended in time, the failure says whether run.py itself had exited (its pipes held open
    by a process it left) and what of its session lives on, with every thread's stack (PYTHONFAULTHANDLER, _fresh)."""
    try:
        return p.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        code, left = p.poll(), {k: processes().get(k, (0, "", ""))[1:] for k in in_session(p.pid)}
        for k in sorted(left, reverse=True):  # run.py last: its children dump their stacks first
            with contextlib.suppress(OSError):
                os.kill(k, signal.SIGABRT)
        try:
            err = p.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            err = "(stderr not closed within 30 s of SIGABRT)"
        for k in in_session(p.pid):  # (only here: an ended run's leftovers are what the tests look for)
            with contextlib.suppress(OSError):
                os.kill(k, signal.SIGKILL)
        raise AssertionError(
            f"run.py did not end within {timeout_s} s (exit code {code}); its session: {left}\n{err[-12000:]}"
        ) from None
    finally:
        p.kill()


def _start(tmp_path, *args, engine="process", workers=3, fresh=False):
    """`python run.py` with `workers` workers, returned once they are committing."""
    d = tmp_path / "run"
    p = (_fresh if fresh else warm_run.Popen)(
        [
            f"engine={engine}",
            f"workers={workers}",
            "algorithm=gem",
            "logger.wandb.mode=disabled",
            "logger.flush_every=5",
            f"hydra.run.dir={d}",
            *args,
        ],
        start_new_session=True,
    )
    processes = workers if engine in REAL else 0
    deadline = time.monotonic() + 180
    while not (d / "metrics.parts").exists() or len(workers_of(p.pid)) < processes:  # the workers are committing
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"run did not start: {p.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return p, d


def _wait_for_checkpoint(d, p, at_least):
    manifest = d / "checkpoint" / "manifest.json"
    deadline = time.monotonic() + 240
    while not (manifest.exists() and json.loads(manifest.read_text())["step"] >= at_least):
        if p.poll() is not None or time.monotonic() > deadline:
            # which of three things happened (one CI run failed here with an empty stderr and nothing else to
            # go on): the run ended on its own (a completed run removes its checkpoint), it died, or time ran out
            code = p.poll()
            p.kill()
            out, err = p.communicate()
            summary = d / "summary.json"
            ended = f"status {json.loads(summary.read_text()).get('status')}" if summary.exists() else "no summary"
            seen = json.loads(manifest.read_text())["step"] if manifest.exists() else None
            raise AssertionError(
                f"no checkpoint at commit >= {at_least} (last seen: {seen}); "
                f"{'still running after 240 s' if code is None else f'exit code {code}'}, "
                f"{ended}\nstdout: {(out or '')[-1000:]}\nstderr: {(err or '')[-2000:]}"
            )
        time.sleep(0.2)
    return json.loads(manifest.read_text())["step"]


class _FrozenInMetaRecorder(StoppingRecorder):
    """As StoppingRecorder, and the victim is frozen inside the turn's `meta` lock, its few instructions under it:
    made so here by taking `meta` on its behalf (the engine's Turn, caught as it is made) once it is stopped."""

    def __init__(self, d, victim, after, turns, named=True):
        super().__init__(d, victim, after)
        self.turns, self.named = turns, named

    def commit(self, row, tensors=None):
        was = self.stopped_at
        super().commit(row, tensors)
        if was is None and self.stopped_at is not None:
            turn = self.turns[-1]
            pid = next(p.pid for p in multiprocessing.active_children() if p.name == f"gem-worker-{self.victim}")
            hold_meta_for(turn, pid, self.named)


@pytest.mark.slow
@pytest.mark.parametrize("engine", REAL)
@pytest.mark.parametrize("named", [True, False])
def test_a_worker_frozen_inside_the_turn_s_lock_is_the_only_one_lost(data, tmp_path, engine, named, monkeypatch):
    """A worker frozen while it holds the turn's `meta` (a few instructions at a time: rare, but a SIGSTOP or a
    loaded machine can catch it there) stalls every worker that next asks for the turn before it is in line. They
    wait on it and are not to blame: only the frozen one is lost (all three were, once, on a loaded machine).
    `named=False`: frozen before it wrote its pid (CI's stop landed there once); the engine knows it as the one
    stopped."""
    from gem.engines import turn as turn_mod

    turns, real_init = [], turn_mod.Turn.__init__

    def caught(self, *a, **kw):
        real_init(self, *a, **kw)
        turns.append(self)

    monkeypatch.setattr(turn_mod.Turn, "__init__", caught)
    rec = _FrozenInMetaRecorder(tmp_path, victim=1, after=10, turns=turns, named=named)
    result, _ = _lost_one(job(data, engine, 3, epochs=8, options={"timeout_s": 5, "silent_cycles": 3}), rec, 1)
    assert rec.stopped_at is not None


@pytest.mark.slow  # silent_before on `process` only, whose checkpoint wait it is about: the suite's time
@pytest.mark.parametrize("engine, silent_before", [("process", 0.0), ("distributed", 0.0), ("process", 1.5)])
def test_a_worker_frozen_inside_the_turn_s_lock_at_a_checkpoint_is_the_only_one_lost(
    data, tmp_path, engine, silent_before, monkeypatch
):
    """The same freeze just as every worker is asked for its state (a checkpoint): the others cannot answer before
    the frozen one lets go of `meta`, and are not to blame. Only it is lost; the checkpoint and the run complete.
    `silent_before`: frozen that long before the others are asked, so that its silence (the coordinator's watch),
    not the checkpoint's wait, loses it first; on `process` the others then had only what was left of their time,
    and were lost with it (2 runs in 5 here; once in a loaded run of the suite)."""
    from gem.engines import turn as turn_mod

    real_ask, frozen = turn_mod.Turn.try_ask, []

    def try_ask(self, workers, action, timeout=turn_mod.POLL_S):
        asked = real_ask(self, workers, action, timeout)
        if asked and action == turn_mod.SAVE and not frozen:
            pid = next(p.pid for p in multiprocessing.active_children() if p.name == "gem-worker-1")
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
            hold_meta_for(self, pid)  # as if it had stopped inside meta
            time.sleep(silent_before)
        return asked

    monkeypatch.setattr(turn_mod.Turn, "try_ask", try_ask)
    j = job(
        data,
        engine,
        3,
        epochs=8,
        options={"timeout_s": 5, "silent_cycles": 3},
        run_dir=str(tmp_path),
        checkpoint_every=40,
    )
    rec = Recorder(tmp_path)
    try:
        result = get(engine).run(j, rec)
    finally:
        rec.close()
    assert frozen and result.status == "completed" and result.extra["lost_workers"] == [1], result
