"""The sim engine's staleness models of issue 15: `gamma` (a controllable spread of cycle times) and `trace` (the
asynchrony a real run recorded, replayed)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import warm_run

from gem.data import make_synthetic
from gem.engines import Job, sim
from gem.engines.sim import Schedule, read_trace
from gem.metrics import Recorder, read_table

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["step", "worker", "worker_step", "staleness", "loss"]


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=192, val_size=64, seed=1)


def run(data, tmp_path, workers, seed=0, epochs=2, **engine):
    from gem.algorithms import sgd

    j = Job(
        algorithm="sgd",
        hp=sgd.Params(),
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=32,
        epochs=epochs,
        seed=seed,
        engine={"name": "sim", "staleness": "round_robin", **engine},
        eval_every=10**9,
        eval_train_size=64,
    )
    rec = Recorder(tmp_path)
    result = sim.run(j, rec)
    rec.close()
    assert result.status == "completed", result
    return read_table(tmp_path)


def test_gamma_with_no_spread_is_round_robin_and_a_small_spread_keeps_its_order(data, tmp_path):
    rr = run(data, tmp_path / "rr", 4)
    pd.testing.assert_frame_equal(run(data, tmp_path / "cv0", 4, staleness="gamma", cycle_cv=0.0)[ORDER], rr[ORDER])
    # the limit: workers start a cycle / n apart, so a spread much smaller than that changes nothing in a short run
    small = run(data, tmp_path / "small", 4, staleness="gamma", cycle_cv=1e-3)
    assert small["worker"].tolist() == rr["worker"].tolist() and small["staleness"].tolist() == rr["staleness"].tolist()
    wide = run(data, tmp_path / "wide", 4, staleness="gamma", cycle_cv=1.0)
    assert wide["staleness"].nunique() > 3  # a spread: τ varies around n − 1


@pytest.mark.parametrize("cv", [0.25, 0.5, 1.0, 2.0])
def test_gamma_cycle_times_have_mean_one_and_the_asked_spread(cv):
    s = Schedule("gamma", 3, seed=0, cycle_cv=cv)
    d = np.array([s.cycle(1, 1) for _ in range(20_000)])
    assert abs(d.mean() - 1) < 0.05 * cv and abs(d.std() / d.mean() - cv) < 0.05 * cv
    assert np.allclose([Schedule("gamma", 3, seed=0, cycle_cv=cv).cycle(1, 4) for _ in range(2)], 4 * d[0])


def test_gamma_is_deterministic_for_a_seed(data, tmp_path):
    a = run(data, tmp_path / "a", 4, seed=3, staleness="gamma", cycle_cv=0.5)
    b = run(data, tmp_path / "b", 4, seed=3, staleness="gamma", cycle_cv=0.5)
    c = run(data, tmp_path / "c", 4, seed=4, staleness="gamma", cycle_cv=0.5)
    pd.testing.assert_frame_equal(a[ORDER + ["sim_time"]], b[ORDER + ["sim_time"]])
    assert a["worker"].tolist() != c["worker"].tolist()


SMALL = ["data=synthetic", "data.synthetic.train_size=384", "data.synthetic.val_size=64"]  # 12 batches of 32


@pytest.fixture(scope="module")
def process_run(tmp_path_factory):
    """A tiny real run: 3 process workers, 12 commits each (a trace's statistics need no more)."""
    d = tmp_path_factory.mktemp("trace") / "process"
    r = warm_run.run_py(
        "workers=3",
        "epochs=1",
        "batch_size=32",
        *SMALL,
        "logger.wandb.mode=disabled",
        f"hydra.run.dir={d}",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def cycles(m: pd.DataFrame, time: str) -> dict[int, np.ndarray]:
    """Each worker's durations between two of its commits, per local step."""
    out = {}
    for w, g in m[m["worker"] >= 0].sort_values("step").groupby("worker"):
        out[w] = np.diff(g[time].to_numpy()) / np.diff(g["worker_step"].to_numpy())
    return out


@pytest.mark.slow
def test_a_trace_replays_a_process_run(process_run, tmp_path):
    """With as many workers as the recorded run, the sim commits in the run's order (so every τ is the measured
    one) and each worker's cycles have the recorded statistics; with more, the extra workers draw from the
    recorded durations of worker w mod m; and a seed fixes the draws."""
    from experiments.config import compose, validate
    from experiments.job import build_job

    recorded = read_table(process_run)
    m = int(json.loads((process_run / "summary.json").read_text())["workers"])
    trace = read_trace(process_run)
    assert len(trace) == m == 3 and sum(map(len, trace)) == len(recorded)

    def replay(workers, seed, d):
        cfg = compose(
            [
                "engine=sim",
                "engine.staleness=trace",
                f"engine.trace={process_run}",
                f"workers={workers}",
                f"seed={seed}",
                "epochs=1",
                "batch_size=32",
                *SMALL,
            ]
        )
        rec = Recorder(d)
        result = sim.run(build_job(validate(cfg), log=lambda *_: None), rec)
        rec.close()
        assert result.status == "completed", result
        return read_table(d)

    same = replay(m, 0, tmp_path / "same")
    assert same["worker"].tolist() == recorded["worker"].tolist()
    assert same["staleness"].tolist() == recorded["staleness"].tolist()
    real, simulated = cycles(recorded, "time_s"), cycles(same, "sim_time")
    unit = np.concatenate(list(real.values())).mean()  # the trace's time unit: its mean duration per step
    for w in range(m):
        assert np.allclose(simulated[w], real[w] / unit)
        assert np.isclose(simulated[w].std() / simulated[w].mean(), real[w].std() / real[w].mean())

    more = replay(2 * m, 1, tmp_path / "more")
    assert more.groupby("worker")["worker_step"].max().tolist() == [recorded["worker_step"].max()] * (2 * m)
    extra = cycles(more, "sim_time")
    for w in range(m, 2 * m):
        gap = np.abs(extra[w][:, None] - real[w % m][None, :] / unit).min(axis=1)
        assert (gap < 1e-9).all()  # every duration drawn from its source worker's
    again = replay(2 * m, 1, tmp_path / "again")
    pd.testing.assert_frame_equal(more[ORDER + ["sim_time"]], again[ORDER + ["sim_time"]])
    other = replay(2 * m, 2, tmp_path / "other")
    assert other["sim_time"].tolist() != more["sim_time"].tolist()


def test_a_checkpointed_schedule_continues_its_trace_where_it_stopped():
    """What a sim checkpoint keeps of the schedule: a resumed replay goes on with the next recorded duration, then
    the same draws."""
    trace = [[(0.0, 1), (1.0, 2), (3.0, 3), (4.0, 4)], [(0.5, 1), (2.0, 2), (2.5, 3)]]  # per worker (time_s, step)
    unit = (1 + 2 + 1 + 1.5 + 0.5) / 5  # the mean duration per step over every recorded cycle
    a = Schedule("trace", 3, seed=7, trace=trace)
    assert [a.start(w, 1) for w in range(2)] == [1.0, 1.0 + 0.5 / unit]  # recorded offsets, then one mean cycle
    first = [a.cycle(0, 1), a.cycle(1, 1), a.cycle(2, 1)]
    b = Schedule("trace", 3, seed=0, trace=trace)
    b.load_state_dict(a.state_dict())
    assert [b.cycle(w, 1) for w in (0, 1, 2, 0, 0, 1)] == [a.cycle(w, 1) for w in (0, 1, 2, 0, 0, 1)]
    assert first[:2] == [1 / unit, 1.5 / unit]  # each worker's first recorded cycle, in the trace's unit


def test_a_windowed_cycle_takes_one_recorded_cycle_and_a_worker_without_one_draws_from_all():
    """A trace's duration is per local step of one recorded cycle: a sim cycle of k steps takes k of it (so AGN's
    windows replay AGN's recorded commits), and a recorded worker that committed once has no cycle of its own."""
    trace = [[(0.0, 10), (2.0, 20), (6.0, 30)], [(1.0, 10)]]  # worker 0: cycles of 10 steps; worker 1: one commit
    s = Schedule("trace", 2, seed=0, trace=trace)
    unit = (0.2 + 0.4) / 2
    assert [s.cycle(0, 10), s.cycle(0, 10)] == pytest.approx([2.0 / unit, 4.0 / unit])
    assert all(s.cycle(1, 10) / 10 in (pytest.approx(0.2 / unit), pytest.approx(0.4 / unit)) for _ in range(20))
    assert s.used[1] == 0  # drawn, not replayed


def test_a_trace_that_cannot_be_replayed_is_refused_in_one_line(tmp_path):
    from gem.engines.sim import TraceError

    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"engine": "process", "status": "failed", "workers": 2}))
    with pytest.raises(TraceError, match=r"^engine.trace=.*: its metrics hold no commit rows$"):
        read_trace(d)
    (d / "summary.json").write_text("{not json")
    with pytest.raises(TraceError, match=r"^engine.trace=.*: its summary.json cannot be read"):
        read_trace(d)
