"""Evaluation rows carry `worker_step`: t·λ/n, the mean local steps per worker at the evaluation's clock t, so that
evaluation curves share the commit rows' x axis (gem.engines.coordinator)."""

import dataclasses

import pytest

from gem import algorithms
from gem.data import make_synthetic
from gem.engines import Job, get
from gem.metrics import Recorder, read_table


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


def sim_run(data, tmp_path, algorithm, workers, eval_every, **hp):
    params = algorithms.get(algorithm).Params
    fields = {f.name for f in dataclasses.fields(params)}
    job = Job(
        algorithm=algorithm,
        hp=params(**{**({"workers": workers} if "workers" in fields else {}), **hp}),
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=32,
        epochs=1,
        seed=0,
        engine={"name": "sim"},
        eval_every=eval_every,
        eval_train_size=64,
    )
    rec = Recorder(tmp_path)
    try:
        result = get("sim").run(job, rec)
    finally:
        rec.close()
    return result, read_table(tmp_path), read_table(tmp_path, "eval")


@pytest.mark.parametrize(
    "algorithm, workers, window, eval_every",
    [
        ("sgd", 1, 1, 3),  # one worker committing every step: worker_step is t
        ("downpour", 3, 1, 5),  # the last evaluation (t = 24) is not on the eval_every grid
        ("agn", 2, 2, 2),  # a window of λ local steps per commit
    ],
)
def test_every_evaluation_row_has_the_mean_worker_step(data, tmp_path, algorithm, workers, window, eval_every):
    hp = {"window": window} if algorithm == "agn" else {}
    result, m, ev = sim_run(data, tmp_path, algorithm, workers, eval_every, **hp)
    assert result.status == "completed"
    steps = workers * (256 // 32) // window  # commits: 8 local steps per worker, one commit per window
    assert result.steps == steps
    assert ev["step"].iloc[0] == 0 and ev["step"].iloc[-1] == steps  # the first and the final evaluation
    assert ev["worker_step"].notna().all()
    assert ev["worker_step"].tolist() == [t * window / workers for t in ev["step"]]
    # on the commit rows' scale: at the end every worker has taken all its local steps
    assert ev["worker_step"].iloc[-1] == m["worker_step"].max() == 256 // 32
    if workers == 1 and window == 1:
        assert ev["worker_step"].tolist() == ev["step"].tolist()


def test_an_evaluation_row_is_timed_when_theta_was_taken_not_when_its_evaluation_ended(data, monkeypatch):
    """On the real engines the workers go on committing while θ is evaluated: the row's time_s is the snapshot's,
    so a time to a target read from it does not include the evaluation's own seconds."""
    import time

    from gem.engines.core import Evaluator
    from gem.models import FlatModel

    job = Job(
        algorithm="sgd",
        hp=algorithms.get("sgd").Params(),
        model="mnist_cnn",
        data=data,
        workers=1,
        batch_size=32,
        epochs=1,
        seed=0,
        engine={"name": "sim"},
        eval_every=1,
        eval_train_size=64,
    )
    evaluate = Evaluator(job, data)
    slow = FlatModel.evaluate

    def evaluate_slowly(self, x, y, batch_size=1024):
        time.sleep(0.5)
        return slow(self, x, y, batch_size)

    monkeypatch.setattr(FlatModel, "evaluate", evaluate_slowly)
    t0 = time.perf_counter()
    row = evaluate(evaluate.model.param.clone(), step=0, t0=t0)
    assert time.perf_counter() - t0 >= 1.0 and row["time_s"] < 0.5
