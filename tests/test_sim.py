"""The `sim` engine with several virtual workers: commit order, staleness, determinism, and the algorithm
interface contract (pull, layout, per-tensor rows, θ before the worker's own commit)."""

import dataclasses
import math
import sys
import types
from dataclasses import dataclass

import pandas as pd
import pytest
import torch

from gem import algorithms
from gem.algorithms import Commit, sgd
from gem.data import make_synthetic
from gem.engines import Job, sim
from gem.metrics import Recorder


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=192, val_size=64, seed=1)


def job(data, workers, algorithm="sgd", hp=None, staleness="round_robin", seed=0, epochs=1, **kw):
    engine = {k: kw.pop(k) for k in ("straggler_fraction", "straggler_slowdown") if k in kw}
    return Job(
        algorithm=algorithm,
        hp=hp or sgd.Params(),
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=32,
        epochs=epochs,
        seed=seed,
        engine={"name": "sim", "staleness": staleness, **engine},
        eval_every=kw.pop("eval_every", 10**9),
        eval_train_size=64,
        **kw,
    )


def run(job_, tmp_path):
    rec = Recorder(tmp_path)
    result = sim.run(job_, rec)
    rec.close()
    return result, pd.read_parquet(tmp_path / "metrics.parquet")


def test_round_robin_order_and_staleness(data, tmp_path):
    n = 3
    result, m = run(job(data, n), tmp_path)
    steps = 192 // 32
    assert result.status == "completed" and result.steps == n * steps
    assert m["worker"].tolist() == [0, 1, 2] * steps
    assert m["staleness"].tolist()[:n] == [0, 1, 2]
    assert (m["staleness"].iloc[n:] == n - 1).all()  # τ = n − 1 once the pipeline is full
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(1, steps + 1))] * n


def test_same_seed_same_metrics_and_other_seed_differs(data, tmp_path):
    cols = ["step", "worker", "worker_step", "staleness", "loss", "sim_time"]
    _, a = run(job(data, 4, staleness="exponential", seed=3), tmp_path / "a")
    _, b = run(job(data, 4, staleness="exponential", seed=3), tmp_path / "b")
    _, c = run(job(data, 4, staleness="exponential", seed=4), tmp_path / "c")
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert a["worker"].tolist() != c["worker"].tolist() or a["loss"].tolist() != c["loss"].tolist()
    assert a["staleness"].nunique() > 1  # random compute times: staleness varies


def test_stragglers_commit_less_often(data, tmp_path):
    _, m = run(
        job(data, 4, staleness="stragglers", epochs=4, straggler_fraction=0.25, straggler_slowdown=4.0), tmp_path
    )
    first_half = m[m["step"] <= len(m) // 2]  # before the fast workers run out of budget
    counts = first_half["worker"].value_counts()
    assert len(counts) == 4 and counts.max() >= 3 * counts.min()


# ---------------------------------------------------------------------- the algorithm interface contract


@dataclass(frozen=True)
class StubParams:
    lr: float = 0.05
    momentum: float = 0.0


def make_stub(log):
    """An algorithm that records what the engine hands it, and commits a small SGD step."""
    mod = types.ModuleType("gem.algorithms.stub")

    def init_state(theta, hp):
        return {"s": theta.clone(), "prev_delta": torch.full_like(theta, float("nan"))}

    def worker_rule(state, x, grad, view, hp):
        # θ − s, with s copied at the previous commit, must equal this worker's previous commit (n = 1)
        if not torch.isnan(state["prev_delta"]).any():
            log["drift_err"].append(float((view.theta - state["s"] - state["prev_delta"]).abs().max()))
        state["s"].copy_(view.theta)
        log["x_equals_theta"].append(bool(torch.equal(x, view.theta)))
        log["views"].append((view.t, view.staleness, view.worker))
        delta = -hp.lr * grad
        state["prev_delta"].copy_(delta)
        return Commit(delta=delta, metrics={"stub_metric": 1.0}, aux={"delta": delta}, pull=log["pull"])

    def diagnostics(commit, layout, hp):
        log["layout"] = [(name, sl.start, sl.stop) for name, sl in layout]
        return {"stub_after_turn": 2.0}, {"stub_norm": [float(commit.aux["delta"][sl].norm()) for _, sl in layout]}

    def server_rule(view, commit, hp):
        view.theta.add_(commit.delta)

    mod.ALGORITHM = algorithms.Algorithm(
        "stub", StubParams, init_state, worker_rule, server_rule, diagnostics=diagnostics
    )
    return mod


@pytest.mark.parametrize("pull", [True, False])
def test_interface_contract(data, tmp_path, monkeypatch, pull):
    log = {"drift_err": [], "x_equals_theta": [], "views": [], "pull": pull}
    monkeypatch.setattr(algorithms, "ALGORITHMS", (*algorithms.ALGORITHMS, "stub"))
    monkeypatch.setitem(sys.modules, "gem.algorithms.stub", make_stub(log))
    rec = Recorder(tmp_path)
    result = sim.run(job(data, 1, algorithm="stub", hp=StubParams()), rec)
    rec.close()
    assert result.status == "completed"
    names = [n for n, _, _ in log["layout"]]
    assert names[:2] == ["conv1.weight", "conv1.bias"] and len(names) == 10
    assert log["layout"][-1][2] == 163_790  # slices cover the flat vector
    # the worker's own previous commit is part of θ − s
    assert len(log["drift_err"]) == 192 // 32 - 1 and max(log["drift_err"]) < 1e-6
    # with pull, x is θ after every commit; without, x stays the worker's own variable
    assert all(log["x_equals_theta"][1:]) == pull
    # the view: the clock before this commit, τ = 0 for a lone worker, the worker's id
    assert log["views"] == [(t, 0, 0) for t in range(192 // 32)]
    m = pd.read_parquet(tmp_path / "metrics.parquet")
    assert (m["stub_metric"] == 1.0).all() and (m["stub_after_turn"] == 2.0).all()
    t = pd.read_parquet(tmp_path / "tensors.parquet")
    assert len(t) == len(m) * 10 and set(t["tensor"]) == set(names)
    assert (t["stub_norm"] > 0).all()


def test_the_server_rule_sees_the_committing_worker(data, tmp_path, monkeypatch):
    """Per-worker state at the server (DC-ASGD's backups) needs the worker id and τ in the server rule."""
    seen = []

    def server_rule(view, commit, hp):
        seen.append((view.worker, view.staleness))
        view.theta.add_(commit.delta)

    mod = types.ModuleType("gem.algorithms.stub")
    mod.ALGORITHM = dataclasses.replace(sgd.ALGORITHM, name="stub", server_rule=server_rule, sequential=False)
    monkeypatch.setattr(algorithms, "ALGORITHMS", (*algorithms.ALGORITHMS, "stub"))
    monkeypatch.setitem(sys.modules, "gem.algorithms.stub", mod)
    rec = Recorder(tmp_path)
    assert sim.run(job(data, 3, algorithm="stub"), rec).status == "completed"
    rec.close()
    assert seen == [(0, 0), (1, 1), (2, 2)] + [(w, 2) for w in (0, 1, 2)] * (192 // 32 - 1)


def _barrier_stub(ahead: int, log: list):
    """DOWNPOUR whose commits set a barrier `ahead` commits past their own (Commit.pull_at)."""
    from gem.algorithms import downpour

    def worker_rule(state, x, grad, view, hp):
        log.append((view.worker, view.t, view.staleness))
        commit = downpour.worker_rule(state, x, grad, view, hp)
        commit.pull_at = view.t + ahead
        return commit

    mod = types.ModuleType("gem.algorithms.stub")
    mod.ALGORITHM = dataclasses.replace(downpour.ALGORITHM, name="stub", worker_rule=worker_rule)
    return mod


def test_a_barrier_holds_a_worker_until_the_clock_reaches_it(data, tmp_path, monkeypatch):
    """A commit with pull_at: the worker takes no gradient until the clock has reached it, then pulls (τ counts
    from there); a barrier that nothing can reach is an error, not a hang."""
    from gem.algorithms import downpour

    log = []
    monkeypatch.setattr(algorithms, "ALGORITHMS", (*algorithms.ALGORITHMS, "stub"))
    monkeypatch.setitem(sys.modules, "gem.algorithms.stub", _barrier_stub(3, log))
    rec = Recorder(tmp_path / "a")
    assert (
        sim.run(job(data, 3, algorithm="stub", hp=downpour.Params(), staleness="exponential", seed=2), rec).status
        == "completed"
    )
    rec.close()
    for w in range(3):
        mine = [(t, tau) for v, t, tau in log if v == w]
        assert len(mine) == 192 // 32
        for (t0, _), (t1, tau) in zip(mine, mine[1:], strict=False):
            assert t1 >= t0 + 3 and tau == t1 - (t0 + 3)  # held until t0 + 3, pulled exactly then
    monkeypatch.setitem(sys.modules, "gem.algorithms.stub", _barrier_stub(2, []))
    with pytest.raises(RuntimeError, match="barrier"):  # a lone worker can never reach t + 2
        sim.run(job(data, 1, algorithm="stub", hp=downpour.Params()), Recorder(tmp_path / "b"))


# ------------------------------------------------------------------------------- every algorithm on sim

ASYNC = [a for a in algorithms.ALGORITHMS if a != "sgd"]


def hp_for(name, n, **kw):
    params = algorithms.get(name).Params
    fields = {f.name for f in dataclasses.fields(params)}
    kw = {**({"workers": n} if "workers" in fields else {}), **kw}
    if "window" in fields:
        kw.setdefault("window", 2)
    return params(**kw)


@pytest.mark.parametrize("name", ASYNC)
def test_each_algorithm_runs_with_round_robin_staleness(data, tmp_path, name):
    n = 3
    result, m = run(job(data, n, algorithm=name, hp=hp_for(name, n), epochs=2), tmp_path)
    window = algorithms.get(name).commit_every(hp_for(name, n))
    commits_per_worker = 2 * (192 // 32) // window
    assert result.status == "completed" and result.steps == n * commits_per_worker == len(m)
    assert m["step"].tolist() == list(range(1, len(m) + 1))
    # ssgd's workers pull at the end of each round, so τ is a commit's place in its round
    expected = (m["step"] - 1) % n if name == "ssgd" else pd.Series(n - 1, index=m.index)
    assert m["staleness"].iloc[n:].tolist() == expected.iloc[n:].tolist()
    assert m["loss"].map(math.isfinite).all()
    assert set(m.groupby("worker")["worker_step"].max()) == {commits_per_worker * window}


def test_gem_writes_pi_and_energies_per_commit_and_per_tensor(data, tmp_path):
    result, m = run(job(data, 4, algorithm="gem", hp=hp_for("gem", 4), staleness="exponential"), tmp_path)
    for col in ("pi_median", "pi_mean", "pi_zero_frac", "pi_max_frac", "proxy_energy", "central_energy"):
        assert m[col].notna().all(), col
    assert ((m["pi_median"] >= 0) & (m["pi_median"] <= 5)).all()
    assert ((m["pi_zero_frac"] >= 0) & (m["pi_zero_frac"] <= 1)).all()
    t = pd.read_parquet(tmp_path / "tensors.parquet")
    assert len(t) == 10 * len(m)
    assert {"step", "worker", "tensor", "tensor_index", "pi_median", "pi_mean", "pi_zero_frac"} <= set(t.columns)
    # a heatmap needs one value per (commit, tensor)
    assert t.pivot(index="step", columns="tensor_index", values="pi_median").shape == (len(m), 10)


@pytest.mark.parametrize("name, extra", [("gem", {}), ("gem", {"proxy": "global"}), ("eamsgd", {}), ("adaptive", {})])
def test_algorithms_are_deterministic_for_a_seed(data, tmp_path, name, extra):
    j = lambda: job(data, 4, algorithm=name, hp=hp_for(name, 4, **extra), staleness="exponential", seed=5)  # noqa: E731
    _, a = run(j(), tmp_path / "a")
    _, b = run(j(), tmp_path / "b")
    timing = ["time_s", "wait_s", "apply_s"]  # wall-clock measurements: the rest must be identical
    pd.testing.assert_frame_equal(a.drop(columns=timing), b.drop(columns=timing))


def test_diverging_gem_or_downpour_stops_with_diverged(data, tmp_path):
    for name in ("downpour", "gem"):
        hp = hp_for(name, 4, lr=1e6)
        result, m = run(job(data, 4, algorithm=name, hp=hp), tmp_path / name)
        assert result.status == "diverged" and "non-finite" in result.reason


MEMORY_PROBE = """
import resource, sys, tempfile
from gem import algorithms
from gem.data import make_synthetic
from gem.engines import Job, sim
from gem.metrics import Recorder
name = sys.argv[1]
params = algorithms.get(name).Params
data = make_synthetic((1, 28, 28), train_size=32, val_size=32, seed=0)
for n in map(int, sys.argv[2:]):  # one run after the other: the peak after each
    hp = params(**({"workers": n} if "workers" in params.__dataclass_fields__ else {}))
    job = Job(algorithm=name, hp=hp, model="mnist_cnn", data=data, workers=n, batch_size=32, epochs=1, seed=0,
              engine={"staleness": "round_robin"}, eval_every=10**9, eval_train_size=32)
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d)
        assert sim.run(job, rec).status == "completed"
        rec.close()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("name, copies", [("gem", 3), ("downpour", 1)])
def test_memory_grows_by_the_workers_own_state_only(name, copies):
    """100 virtual workers of mnist_cnn: each costs its stale copy x plus its algorithm state (GEM: momentum
    and s; DOWNPOUR: none), and nothing else of model size. Peak RSS of n = 101 against n = 1."""
    import subprocess

    model_bytes = 163_790 * 4

    # n = 1 and then n = 101 in one process: the second run's peak above the first's is what its 100 more workers
    # cost (the first run's own memory is in both)
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, name, "1", "101"], capture_output=True, text=True, timeout=300, check=True
    )
    one, many = (int(v) for v in out.stdout.split()[-2:])
    per_worker = (many - one) / 100 / model_bytes
    assert per_worker <= copies + 0.5, f"{per_worker:.2f} model copies per worker"


def test_a_gem_run_with_the_fused_loops_is_the_run_with_torchs_operations(data, tmp_path, monkeypatch):
    """A whole run's commits (n = 4, GEM): every row and every per-tensor statistic the same, bit for bit, with
    GEM's fused CPU loops and with the torch operations they replace (losses, π, staleness: the same run); the
    proxy and central energies within float32 rounding."""
    from gem.algorithms import gem

    frames = {}
    for fused in (True, False):
        monkeypatch.setattr(gem, "FUSED", fused)
        d = tmp_path / str(fused)
        result, m = run(job(data, 4, "gem", gem.Params(), epochs=3), d)
        assert result.status == "completed"
        frames[fused] = (
            m.drop(columns=["time_s", "wait_s", "apply_s"], errors="ignore"),
            pd.read_parquet(d / "tensors.parquet"),
        )
    energies = ["proxy_energy", "central_energy"]  # metrics summed in float64 by the loops: float32 rounding apart
    fused, reference = frames[True][0], frames[False][0]
    pd.testing.assert_frame_equal(fused.drop(columns=energies), reference.drop(columns=energies), check_exact=True)
    pd.testing.assert_frame_equal(fused[energies], reference[energies], check_exact=False, rtol=1e-5, atol=0)
    pd.testing.assert_frame_equal(frames[True][1], frames[False][1], check_exact=True)
    assert frames[True][0]["pi_median"].nunique() > 1
