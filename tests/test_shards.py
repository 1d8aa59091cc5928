"""Sharded servers (engine.servers=S; docs/design.md, "Sharded servers"), launched locally on loopback: θ cut into S
slices, rank 0 serving shard 0 and ranks n + 1 .. n + S - 1 the others, each on its own clock. Across hosts:
tests/test_multihost.py."""

import dataclasses
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers.engines import Killed
from helpers.procs import workers_of

from gem import algorithms
from gem.data import make_synthetic
from gem.engines import Job, checkpoint, distributed
from gem.engines.distributed import launch
from gem.engines.distributed.shards import refusal, shard_ranks, slices
from gem.engines.options import DistributedOptions
from gem.metrics import Recorder, read_table

TIMES = ["time_s", "wait_s", "apply_s", "wait_commits"]  # what differs between two runs of the same commits


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


def job(data, workers, algorithm, servers, epochs=2, **kw):
    fields = {f.name for f in dataclasses.fields(algorithms.get(algorithm).Params)}
    hp = algorithms.get(algorithm).Params(**({"workers": workers} if "workers" in fields else {}))
    return Job(
        algorithm=algorithm,
        hp=hp,
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=32,
        epochs=epochs,
        seed=0,
        engine={"name": "distributed", "timeout_s": 60, "servers": servers},
        eval_every=kw.pop("eval_every", 16),
        eval_train_size=64,
        **kw,
    )


def run(job_, d):
    rec = Recorder(d, resume_step=job_.resume["step"] if job_.resume else None)
    try:
        result = distributed.run(job_, rec)
    finally:
        rec.close()
    return result, read_table(d)


def test_theta_is_cut_into_contiguous_slices_of_about_equal_size():
    for numel, servers in [(10, 1), (10, 3), (1_199_882, 2), (7, 7), (5, 2)]:
        cuts = slices(numel, servers)
        assert len(cuts) == servers and cuts[0][0] == 0 and cuts[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:], strict=False))  # contiguous, every element once
        sizes = [hi - lo for lo, hi in cuts]
        assert max(sizes) - min(sizes) <= servers  # about equal
    assert shard_ranks(4, 3) == [0, 5, 6]  # rank 0, then the ranks after the 4 workers


def test_only_full_duplex_rules_without_barriers_are_sharded_and_the_others_are_refused_in_one_line():
    two = DistributedOptions(servers=2)
    assert refusal("downpour", algorithms.get("downpour").Params(), two) is None
    assert refusal("gem", algorithms.get("gem").Params(), DistributedOptions()) is None  # one server: anything
    why = refusal("gem", algorithms.get("gem").Params(), two)
    assert why.startswith("engine.servers=2 is not allowed with algorithm=gem") and "reads the live θ" in why
    # EASGD's part that reads θ keeps nothing at the server and makes no statistics: each server runs it on its slice
    assert refusal("easgd", algorithms.get("easgd").Params(workers=2), two) is None
    for name in ("eamsgd", "ringmaster"):  # the live θ at the worker; a drop decided on each shard's own counters
        assert refusal(name, algorithms.get(name).Params(workers=2), two).startswith(
            f"engine.servers=2 is not allowed with algorithm={name}"
        )
    why = refusal("ssgd", algorithms.get("ssgd").Params(), two)
    assert why.startswith("engine.servers=2 is not allowed with algorithm=ssgd") and "barrier" in why
    why = refusal("downpour", algorithms.get("downpour").Params(), DistributedOptions(servers=2, full_duplex=False))
    assert why.startswith("engine.servers=2 needs engine.full_duplex=true")
    with pytest.raises(ValueError, match=r"^engine.servers=0 is not allowed; it must be an integer from 1 to 64$"):
        DistributedOptions(servers=0)


@pytest.mark.parametrize(
    "algorithm",
    [
        "downpour",
        pytest.param("dcasgd", marks=pytest.mark.slow),
        pytest.param("async_localsgd", marks=pytest.mark.slow),
        "easgd",
    ],
)
def test_one_worker_gives_the_same_rows_on_one_two_and_three_servers(data, tmp_path, algorithm):
    """Every server rule is element by element, and a shard's counters count the same commits: with one worker
    (one order) S servers compute what one computes, bit for bit, rows and evaluations (DC-ASGD: its backup of θ
    per worker is kept per slice; Local SGD: its outer momentum's counter per shard; EASGD: its elastic term
    α(x − θ), run at each server on its slice of x and of θ, as at rank 0 with one)."""
    frames = {}
    for servers in (1, 2, 3):
        result, m = run(job(data, 1, algorithm, servers), tmp_path / str(servers))
        assert result.status == "completed", result
        assert result.extra["servers"] == servers
        if servers > 1:
            assert [s["commits"] for s in result.extra["shards"]] == [len(m)] * (servers - 1)
        frames[servers] = (m.drop(columns=TIMES, errors="ignore"), read_table(tmp_path / str(servers), "eval"))
    for servers in (2, 3):
        pd.testing.assert_frame_equal(frames[1][0], frames[servers][0], check_exact=True)
        pd.testing.assert_frame_equal(
            frames[1][1].drop(columns="time_s"), frames[servers][1].drop(columns="time_s"), check_exact=True
        )


@pytest.mark.parametrize("algorithm", ["downpour", "easgd"])
def test_three_workers_on_two_servers_commit_once_each(data, tmp_path, algorithm):
    """Rank 0's clock orders the rows: every step once, every worker step once; the other shard applied every
    commit too, each with τ on its own clock (no more apart from rank 0's than the commits in flight). EASGD's
    elastic term runs at each server on its slice (the placement says so)."""
    n = 3
    j = job(data, n, algorithm, 2)
    result, m = run(j, tmp_path)
    steps, every = 2 * 256 // 32, algorithms.get(algorithm).commit_every(j.hp)
    assert result.status == "completed", result
    assert ("reads θ runs at each server, on its slice" in result.extra["placement"]) == (algorithm == "easgd")
    assert m["step"].tolist() == list(range(1, n * steps // every + 1))
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(every, steps + 1, every))] * n
    (shard,) = result.extra["shards"]
    assert shard["shard"] == 1 and shard["rank"] == n + 1 and shard["commits"] == n * steps // every
    assert 0 < shard["server_busy"] < 1 and shard["server_commit_s"] > 0  # timed as rank 0's exchanges are
    assert abs(shard["mean_staleness"] - m["staleness"].mean()) <= n - 1
    assert not workers_of(os.getpid())


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dcasgd", "easgd"])
def test_a_sharded_run_killed_at_its_checkpoint_resumes_to_the_uninterrupted_run(
    data, tmp_path, monkeypatch, algorithm
):
    """The checkpoint holds θ whole and each shard's state (DC-ASGD's backups of its slice, its clock, its pull
    times), taken at the barrier where every shard has applied the same commits: killed once it is on disk and
    resumed, one worker on two servers gives the rows of a run never killed, bit for bit (EASGD: its x, the
    worker's, and each server's slice of θ)."""
    real_finish = checkpoint.finish

    def finish_then_die(*args, **kw):
        real_finish(*args, **kw)
        raise Killed()

    def make(d, resume=None):
        # (EASGD commits every 4 steps: twice the data, and a checkpoint every 3 commits, for one to be taken)
        epochs, every = (4, 12) if algorithm == "dcasgd" else (8, 3)
        return job(data, 1, algorithm, 2, epochs=epochs, run_dir=str(d), checkpoint_every=every, resume=resume)

    whole, m_whole = run(make(tmp_path / "whole"), tmp_path / "whole")
    d = tmp_path / "killed"
    monkeypatch.setattr(checkpoint, "finish", finish_then_die)
    with pytest.raises(Killed):
        run(make(d), d)
    monkeypatch.setattr(checkpoint, "finish", real_finish)
    manifest = checkpoint.read_manifest(d)
    central = checkpoint.load_central(manifest)
    assert len(central["shards"]) == 2
    if algorithm == "dcasgd":
        assert central["shards"][1]["server"]["backup"].shape[1] == central["theta"].numel() // 2
    result, m = run(make(d, manifest), d)
    assert result.status == whole.status == "completed"
    pd.testing.assert_frame_equal(
        m_whole.drop(columns=TIMES, errors="ignore"), m.drop(columns=TIMES, errors="ignore"), check_exact=True
    )


@pytest.mark.slow  # two runs of 2 workers, one of them to its end: 20 s
def test_a_lost_server_ends_the_run_failed_naming_it_and_its_checkpoint_resumes(data, tmp_path, monkeypatch):
    """A shard's server killed mid-run: rank 0 hears its connection close, the run ends `failed` with a reason that
    names the shard and its rank, and its last checkpoint is kept; resume=true on the same servers completes it."""
    real_attach = launch._Coordinator.attach

    def attach(self, pg, children, *args, **kw):
        real_attach(self, pg, children, *args, **kw)
        shard = next(p for p in children if p.name == "gem-shard-1")

        def kill_later():  # once a checkpoint is on disk
            deadline = time.monotonic() + 60
            while not (Path(self.job.run_dir) / "checkpoint" / "manifest.json").exists():
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            shard.kill()

        threading.Thread(target=kill_later, daemon=True).start()

    def make(resume=None):
        return job(data, 2, "downpour", 2, epochs=12, run_dir=str(tmp_path), checkpoint_every=10, resume=resume)

    monkeypatch.setattr(launch._Coordinator, "attach", attach)
    result, _ = run(make(), tmp_path)
    monkeypatch.setattr(launch._Coordinator, "attach", real_attach)
    assert result.status == "failed", result
    assert "server of shard 1 (rank 3) lost" in result.reason, result.reason
    assert not workers_of(os.getpid())
    manifest = checkpoint.read_manifest(tmp_path)
    result, m = run(make(manifest), tmp_path)
    assert result.status == "completed", result
    assert m["step"].tolist() == list(range(1, len(m) + 1))


def test_the_run_s_summary_says_how_busy_each_server_was():
    """What `python run.py` prints of a run on several servers: one line, rank 0's busy share and each other shard's
    commits, mean τ and busy share; nothing of the kind with one server."""
    from experiments.runner import format_summary

    s = {
        "status": "completed", "algorithm": "downpour", "engine": "distributed", "workers": 4, "steps": 920,
        "final_train_loss": 0.1, "val_loss": 0.1, "val_accuracy": 0.9, "mean_staleness": 2.95,
        "staleness_model": "measured (distributed)", "wall_time_s": 12.1, "run_dir": "/tmp/x", "server_busy": 0.6581,
        "servers": 2,
        "shards": [{"shard": 1, "rank": 5, "commits": 920, "mean_staleness": 2.9489, "server_busy": 0.3295}],
    }  # fmt: skip
    lines = format_summary(s).splitlines()
    assert "servers         2: rank 0 busy 0.66; shard 1 (rank 5) 920 commits, mean τ 2.95, busy 0.33" in lines
    assert not any(line.startswith("servers") for line in format_summary({**s, "servers": 1}).splitlines())
