"""The `process` engine: real spawned workers, FIFO turns at the parameter server, lost workers, signals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT
from test_run import check_run_dir

from gem.algorithms import downpour, gem
from gem.data import make_synthetic
from gem.engines import Job, process
from gem.metrics import Recorder


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


def job(data, workers, algorithm="gem", hp=None, epochs=1, **kw):
    return Job(algorithm=algorithm, hp=hp or gem.Params(workers=workers), model="mnist_cnn", data=data,
               workers=workers, batch_size=32, epochs=epochs, seed=0, engine={}, eval_every=kw.pop("eval_every", 16),
               eval_train_size=64, **kw)


def run(job_, d):
    rec = Recorder(d)
    try:
        result = process.run(job_, rec)
    finally:
        rec.close()
    return result, pd.read_parquet(d / "metrics.parquet")


def test_real_workers_complete_with_every_commit_once(data, tmp_path):
    n, steps = 3, 2 * 256 // 32
    result, m = run(job(data, n, epochs=2), tmp_path)
    assert result.status == "completed" and result.steps == n * steps, result
    assert m["step"].tolist() == list(range(1, n * steps + 1))  # the clock: each commit once, no gap
    assert sorted(m["worker"].unique()) == [0, 1, 2]
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(1, steps + 1))] * n
    assert m["time_s"].is_monotonic_increasing and m["time_s"].iloc[0] > 0  # real wall-clock seconds
    assert (m["staleness"] >= 0).all() and m["staleness"].max() >= 1  # workers did overlap
    assert m["pi_median"].notna().all()
    t = pd.read_parquet(tmp_path / "tensors.parquet")
    assert len(t) == 10 * len(m)
    assert result.extra["lost_workers"] == []


def test_staleness_is_the_number_of_commits_since_the_workers_pull(data, tmp_path):
    _, m = run(job(data, 3, epochs=2), tmp_path)
    # a worker pulls right after its own commit, so τ = commits by others between two of its commits
    for _, g in m.groupby("worker"):
        steps = g["step"].tolist()
        assert g["staleness"].tolist()[1:] == [b - a - 1 for a, b in zip(steps, steps[1:], strict=False)]


def test_turns_are_first_in_first_out(data, tmp_path):
    """Equally fast workers share the server: in every stretch of the run each one has its share."""
    n = 4
    _, m = run(job(data, n, epochs=4), tmp_path)
    first_half = m[m["step"] <= len(m) // 2]  # before anyone runs out of budget
    shares = first_half["worker"].value_counts(normalize=True)
    assert len(shares) == n and shares.min() > 0.5 / n, shares.to_dict()


def test_divergence_stops_every_worker(data, tmp_path):
    result, _ = run(job(data, 3, algorithm="downpour", hp=downpour.Params(lr=1e8), epochs=4), tmp_path)
    assert result.status == "diverged" and "non-finite" in result.reason
    assert not _children(os.getpid())


def _children(pid) -> list[int]:
    """Worker processes (spawn_main) whose parent is pid; the resource tracker is left out."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == pid and "spawn_main" in cmd and state != "Z":
            out.append(int(d.name))
    return out


def _start(tmp_path, *args):
    d = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "run.py", "engine=process", "workers=3", "algorithm=gem",
                          "logger.wandb.mode=disabled", "logger.flush_every=5", f"hydra.run.dir={d}", *args],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + 180
    while not (d / "metrics.parts").exists() or len(_children(p.pid)) < 3:  # the workers are committing
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"run did not start: {p.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return p, d


@pytest.mark.slow
def test_a_killed_worker_is_recorded_and_the_run_goes_on(tmp_path):
    p, d = _start(tmp_path, "epochs=30")
    victim = _children(p.pid)[1]
    os.kill(victim, signal.SIGKILL)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 0, err
    summary, m, _ = check_run_dir(d)
    assert summary["status"] == "completed"
    assert len(summary["lost_workers"]) == 1 and "lost at commit" in summary["reason"], summary
    lost = summary["lost_workers"][0]
    budget = 30 * (1500 // 64)
    done = m.groupby("worker")["worker_step"].max()
    assert done[lost] < budget and all(done[w] == budget for w in done.index if w != lost)
    assert "lost" in out


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_and_sigterm_leave_no_child_behind(tmp_path, sig, code):
    p, d = _start(tmp_path, "epochs=1000")
    kids = _children(p.pid)
    if sig == "SIGINT":
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    else:
        p.send_signal(signal.SIGTERM)  # what a scheduler does: the main process only
    try:
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == code, err
    time.sleep(0.5)
    alive = [k for k in kids if Path(f"/proc/{k}").exists()
             and not (Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z")]
    assert alive == [], f"children left behind: {alive}"
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "failed" and "interrupted" in summary["reason"]
    m = pd.read_parquet(d / "metrics.parquet")
    assert m["step"].tolist() == list(range(1, len(m) + 1))
