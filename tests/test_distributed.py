"""What is particular to the `distributed` engine, on loopback: rank 0 the parameter server, worker ranks, gloo
over TCP; first come, first served at the server, payloads on the wire, torchrun. The contract every engine keeps
(every commit once, staleness, windows, resume, lost workers, signals, ...) is in tests/test_engines.py."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from test_run import check_run_dir

from gem.algorithms import downpour, gem
from gem.data import make_synthetic
from gem.engines import Job, distributed
from gem.metrics import Recorder, read_table


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


def job(data, workers, algorithm="gem", hp=None, epochs=1, batch_size=32, **kw):
    return Job(algorithm=algorithm, hp=hp or gem.Params(workers=workers), model="mnist_cnn", data=data,
               workers=workers, batch_size=batch_size, epochs=epochs, seed=0,
               engine={"name": "distributed", "timeout_s": 60}, eval_every=kw.pop("eval_every", 16),
               eval_train_size=64, **kw)


def run(job_, d):
    rec = Recorder(d)
    try:
        result = distributed.run(job_, rec)
    finally:
        rec.close()
    return result, read_table(d), rec


def test_commits_are_served_first_come_first_served(data, tmp_path):
    """Every worker has the same budget, so the final shares are 1/n whatever the order: fairness shows while
    they all run. At b = 4 a worker's step is shorter than the server's exchange, so the workers queue at the
    server and are of equal speed as far as it can tell, where an unfair order would show most. Served in rank
    order (the original code's polling), low ranks would take most of the commits and τ would split into 0 for
    them and large for the others; first come, first served gives each of the 4 workers 1/n ± 10% of each half of
    the run, and τ = n - 1 for most commits (round robin)."""
    n = 4
    result, m, _ = run(job(data, n, algorithm="downpour", hp=downpour.Params(), batch_size=4), tmp_path)
    assert result.status == "completed" and len(m) == n * 256 // 4
    for half in (m[m["step"] <= len(m) // 2], m[m["step"] > len(m) // 2]):
        shares = half["worker"].value_counts(normalize=True)
        assert sorted(shares.index) == list(range(n))
        assert ((shares - 1 / n).abs() <= 0.1 / n).all(), shares.to_dict()
    assert m.loc[m["worker_step"] > 1, "staleness"].median() == n - 1


def test_the_global_proxy_travels_with_the_commit(data, tmp_path):
    """algorithm.proxy=global sends the worker's momentum as a payload; the server keeps their mean."""
    hp = gem.Params(workers=3, proxy="global")
    result, m, _ = run(job(data, 3, hp=hp, epochs=1), tmp_path)
    assert result.status == "completed" and m["pi_median"].notna().all()


def _torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not on PATH")
    return exe


@pytest.mark.slow
def test_torchrun_launches_the_server_and_workers(tmp_path):
    d = tmp_path / "run"
    p = subprocess.run([_torchrun(), "--nnodes=1", "--nproc_per_node=4", "run.py", "engine=distributed",
                        "workers=3", "epochs=2", "logger.wandb.mode=disabled", f"hydra.run.dir={d}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary, m, _ = check_run_dir(d, steps=3 * 2 * (1500 // 64))
    assert summary["status"] == "completed" and summary["engine"] == "distributed"
    assert summary["commit_shares"] == {"0": 0.3333, "1": 0.3333, "2": 0.3333}
    assert sorted(m["worker"].unique()) == [0, 1, 2]
    assert not list(ROOT.glob("outputs/*/*/rank*"))  # worker ranks write no run directory of their own


@pytest.mark.slow
def test_torchrun_with_the_wrong_number_of_processes_says_so_in_one_line(tmp_path):
    p = subprocess.run([_torchrun(), "--nnodes=1", "--nproc_per_node=3", "run.py", "engine=distributed",
                        "workers=3", "logger.wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: workers=3 does not match the 3 processes the launcher started: engine=distributed "
                      "needs workers + 1 (rank 0 is the parameter server); pass workers=2 or start 4 processes "
                      "(--nproc_per_node)"], p.stderr[-2000:]


class _HighRankWaits(distributed._Server):
    """An unfair server, like the original code's polling in rank order: the highest rank is served only once
    3 commits of lower ranks have gone before it."""

    held = None

    def next_header(self, header):
        others_running = len(set(self.ranks) - self.done) > 1
        if self.held is not None and (self.skipped >= 3 or not others_running):
            src, saved, self.held = self.held, self.held_header, None
            header.copy_(saved)
            return src
        src = super().next_header(header)
        if src == max(self.ranks) and int(header[0]) == distributed.ASK and others_running:
            self.held, self.held_header, self.skipped = src, header.clone(), 0
            return None
        if self.held is not None and int(header[0]) == distributed.ASK:
            self.skipped += 1
        return src


def test_the_fairness_test_catches_an_unfair_server(data, tmp_path, monkeypatch):
    """The test above is not vacuous: a server that lets the highest rank wait fails it."""
    monkeypatch.setattr(distributed, "_Server", _HighRankWaits)
    with pytest.raises(AssertionError, match=r"0\.1 / 4"):
        test_commits_are_served_first_come_first_served(data, tmp_path)
