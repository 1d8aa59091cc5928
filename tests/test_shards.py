"""Sharded servers (engine.servers=S; docs/design.md, "Sharded servers"), launched locally on loopback: θ cut into S
slices, rank 0 serving shard 0 and ranks n + 1 .. n + S - 1 the others, each on its own clock. Across hosts:
tests/test_multihost.py."""

import dataclasses
import math
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers.engines import Killed
from helpers.procs import workers_of

from gem import algorithms
from gem.data import make_synthetic
from gem.engines import Job, checkpoint, distributed
from gem.engines.distributed import launch
from gem.engines.distributed.shards import Sharded, combine, pieces, refusal, shard_ranks, slices
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
    algo = algorithms.get("downpour")
    with pytest.raises(ValueError, match=r"^engine.servers=3 is not allowed for a model of 4 param.*servers=2 gives"):
        Sharded(algo, algo.Params(), torch.zeros(4), 1, 3)  # slices of 2, 2 and 0


def test_only_full_duplex_rules_without_barriers_are_sharded_and_the_others_are_refused_in_one_line():
    two = DistributedOptions(servers=2)
    assert refusal("downpour", algorithms.get("downpour").Params(), two) is None
    assert refusal("gem", algorithms.get("gem").Params(), DistributedOptions()) is None  # one server: anything
    # the part that reads θ runs at each server on its slice: EASGD's elastic term; GEM's whole rule, with its m and s
    # kept there and statistics that say how they add up
    assert refusal("easgd", algorithms.get("easgd").Params(workers=2), two) is None
    for proxy in ("local", "global"):
        assert refusal("gem", algorithms.get("gem").Params(proxy=proxy), two) is None
    why = refusal("gem", algorithms.get("gem").Params(), DistributedOptions(servers=2, full_duplex=False))
    assert why.startswith("engine.servers=2 needs engine.full_duplex=true")
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


@pytest.mark.parametrize("algorithm", ["downpour", "easgd", "gem"])
def test_three_workers_on_two_servers_commit_once_each(data, tmp_path, algorithm):
    """Rank 0's clock orders the rows: every step once, every worker step once; the other shard applied every
    commit too, each with τ on its own clock (no more apart from rank 0's than the commits in flight). EASGD's
    elastic term and GEM's rule run at each server on its slice (the placement says so)."""
    n = 3
    j = job(data, n, algorithm, 2)
    result, m = run(j, tmp_path)
    steps, every = 2 * 256 // 32, algorithms.get(algorithm).commit_every(j.hp)
    assert result.status == "completed", result
    assert ("reads θ runs at each server, on its slice" in result.extra["placement"]) == (algorithm != "downpour")
    if algorithm == "gem":  # every commit's statistics, added up from both servers'
        assert m["proxy_energy"].gt(0).all() and m["pi_mean"].between(0, 5).all() and m["pi_median"].isna().all()
    assert m["step"].tolist() == list(range(1, n * steps // every + 1))
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(every, steps + 1, every))] * n
    (shard,) = result.extra["shards"]
    assert shard["shard"] == 1 and shard["rank"] == n + 1 and shard["commits"] == n * steps // every
    assert 0 < shard["server_busy"] < 1 and shard["server_commit_s"] > 0  # timed as rank 0's exchanges are
    assert abs(shard["mean_staleness"] - m["staleness"].mean()) <= n - 1
    assert not workers_of(os.getpid())


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dcasgd", "easgd", "gem"])
def test_a_sharded_run_killed_at_its_checkpoint_resumes_to_the_uninterrupted_run(
    data, tmp_path, monkeypatch, algorithm
):
    """The checkpoint holds θ whole and each shard's state (DC-ASGD's backups of its slice, its clock, its pull
    times), taken at the barrier where every shard has applied the same commits: killed once it is on disk and
    resumed, one worker on two servers gives the rows of a run never killed, bit for bit (EASGD: its x, the
    worker's, and each server's slice of θ; GEM: its m and s, whose slices each server keeps, whole in the worker's
    file, and sliced again for each server on resume)."""
    real_finish = checkpoint.finish

    def finish_then_die(*args, **kw):
        real_finish(*args, **kw)
        raise Killed()

    def make(d, resume=None):
        # (EASGD commits every 4 steps: twice the data, and a checkpoint every 3 commits, for one to be taken)
        epochs, every = (8, 3) if algorithm == "easgd" else (4, 12)
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
    if algorithm == "gem":  # the worker's file holds m and s whole, not rank 0's slice of them
        saved = checkpoint.load_worker(manifest, 0)["state"]
        assert saved["m"].numel() == saved["stale"].numel() == central["theta"].numel() and saved["m"].abs().sum() > 0
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


def test_a_server_keeps_the_statistics_it_sent_each_worker_until_that_worker_s_next_commit_only():
    """The small sends after θ (a commit's statistics) are not waited for before the server's next commit, which
    could wait on another server, but at the same worker's next commit, which comes after the worker took them: one
    entry per worker however many commits (a gloo send says it has completed only once waited for, so a list that
    let go of completed ones grew by one entry a commit)."""
    from gem.engines.distributed.server_wire import Outbox

    class Send:
        def __init__(self):
            self.waited = False

        def wait(self, timeout):
            self.waited = True

    outbox, sent = Outbox(torch.zeros(3)), []
    for commit in range(100):
        src = 1 + commit % 3
        sends = [Send(), Send()]
        outbox.trail(src, sends, [torch.zeros(1)], 1.0)
        sent.append(sends)
    assert sorted(outbox.trailing) == [1, 2, 3]
    assert all(s.waited for sends in sent[:-3] for s in sends)  # each at its worker's next commit
    assert not any(s.waited for sends in sent[-3:] for s in sends)
    outbox.flush(1.0)  # the server's end: the last ones too
    assert all(s.waited for sends in sent for s in sends) and not outbox.trailing


def test_statistics_made_on_slices_add_up_as_the_algorithm_says():
    """A tensor cut by a shard's boundary has a piece on each side; a sum adds, a mean is weighted by the pieces'
    sizes, and a median is kept where one piece holds the tensor and NaN where it spans two."""
    layout = [("a", slice(0, 4)), ("b", slice(4, 10)), ("c", slice(10, 12))]
    cuts = slices(12, 2)  # [0, 6) and [6, 12): b is cut 2 | 4
    assert pieces(layout, *cuts[0]) == [("a", slice(0, 4)), ("b", slice(4, 6))]
    assert pieces(layout, *cuts[1]) == [("b", slice(0, 4)), ("c", slice(4, 6))]
    over = {"e": "sum", "m": "mean", "med": "median"}
    parts = [
        [{"e": 1.5, "m": 1.0, "med": 0.5}, {"m": [1.0, 4.0], "med": [0.25, 0.75]}],
        [{"e": 2.0, "m": 4.0, "med": 0.5}, {"m": [1.0, 3.0], "med": [0.1, 0.2]}],
    ]
    metrics, tensors = combine(over, parts, layout, cuts)
    assert metrics["e"] == 3.5 and metrics["m"] == 2.5 and math.isnan(metrics["med"])
    assert tensors["m"] == [1.0, (2 * 4.0 + 4 * 1.0) / 6, 3.0]
    assert tensors["med"][0] == 0.25 and math.isnan(tensors["med"][1]) and tensors["med"][2] == 0.2
    with pytest.raises(ValueError, match="'x' does not say how it adds up"):
        combine(over, [[{"x": 1.0}, None], [{"x": 1.0}, None]], layout, cuts)


@pytest.mark.parametrize("proxy", ["local", pytest.param("global", marks=pytest.mark.slow)])
def test_gem_on_two_and_three_servers_commits_what_one_server_commits(data, tmp_path, proxy):
    """GEM's whole rule runs at each server on its slice, with its slice of the worker's m and s kept there: with one
    worker, S servers commit what one commits, bit for bit (every loss and evaluation), and the row's statistics
    add up from the slices': the energies and π's means and fractions as one server's, up to float rounding; the
    median of a tensor whole on one server exactly; the medians that span servers (all of θ's, a cut tensor's)
    NaN."""
    hp = algorithms.get("gem").Params(proxy=proxy)
    frames = {}
    counts = (1, 2, 3) if proxy == "local" else (1, 3)  # (the global proxy's M is one more server tensor, sliced)
    for servers in counts:
        result, m = run(dataclasses.replace(job(data, 1, "gem", servers), hp=hp), tmp_path / str(servers))
        assert result.status == "completed", result
        tensors = read_table(tmp_path / str(servers), "tensors")
        frames[servers] = (m.drop(columns=TIMES, errors="ignore"), read_table(tmp_path / str(servers), "eval"), tensors)
    one, one_eval, one_tensors = frames[1]
    stats = ["pi_median", "pi_mean", "pi_zero_frac", "pi_max_frac", "proxy_energy", "central_energy"]
    numel = int(one_tensors.groupby("step").size().iloc[0])  # the model's tensors
    for servers in counts[1:]:
        m, evals, tensors = frames[servers]
        pd.testing.assert_frame_equal(one.drop(columns=stats), m.drop(columns=stats), check_exact=True)
        pd.testing.assert_frame_equal(one_eval.drop(columns="time_s"), evals.drop(columns="time_s"), check_exact=True)
        assert m["pi_median"].isna().all() and one["pi_median"].notna().all()
        for c in stats[1:]:  # (π's sums are float32's, one server's too: they agree to its rounding)
            pd.testing.assert_series_equal(one[c], m[c], check_exact=False, rtol=1e-6 if c == "pi_mean" else 1e-12)
        # per tensor: the median of a tensor cut between two servers is NaN, of the others one server's
        merged = one_tensors.merge(tensors, on=["step", "tensor"], suffixes=("", "_s"))
        assert len(merged) == len(one_tensors) == len(tensors) and numel > servers
        cut = merged["pi_median_s"].isna()
        assert 1 <= merged.loc[cut, "tensor"].nunique() <= servers - 1
        assert (merged.loc[~cut, "pi_median"] == merged.loc[~cut, "pi_median_s"]).all()
        for c, rtol in (("pi_mean", 1e-6), ("pi_zero_frac", 1e-12)):
            pd.testing.assert_series_equal(merged[c], merged[c + "_s"], check_exact=False, rtol=rtol, check_names=False)


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
