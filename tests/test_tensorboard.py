"""TensorBoard (experiments/tensorboard_logger.py): `logger.tensorboard=true` writes event files into
`<run_dir>/tensorboard/` holding the rows W&B gets (through gem.metrics.fan_out), at the commit clock t; the default
writes none; a run that is killed leaves them readable; a missing package is refused before anything is written."""

import sys

import pandas as pd
import pytest

from experiments import tensorboard_logger, wandb_logger
from experiments.command import preflight
from experiments.config import compose
from experiments.runner import run
from gem import metrics

pytest.importorskip("tensorboard")

RUN = [
    "engine=sim",
    "data=digits",
    "workers=2",
    "epochs=1",
    "logger.progress=false",
    "logger.eval_every=10",
    "logger.eval_train_size=256",
]


def event_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's event files, by tag, as (step, value), read back as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def steps_and(table: pd.DataFrame, column: str) -> list[tuple[int, float]]:
    return [(int(t), float(v)) for t, v in zip(table["step"], table[column], strict=True)]


def close(got, want):
    return len(got) == len(want) and all(
        t == u and v == pytest.approx(w, rel=1e-6, abs=1e-6) for (t, v), (u, w) in zip(got, want, strict=True)
    )


@pytest.fixture
def wandb_rows(monkeypatch):
    """wandb.init replaced by a run that keeps what is logged, as {tag: [(step, value)]}; nothing is written."""
    import wandb

    monkeypatch.setattr(wandb_logger, "_online_failed", None)
    monkeypatch.setattr(wandb_logger, "_unavailable", None)
    rows: dict[str, list] = {}

    class Run:
        def __init__(self, kw):
            self.dir, self.url, self.summary = kw["dir"], None, {}

        def log(self, data, step=None):
            for tag, value in data.items():
                rows.setdefault(tag, []).append((step, value))

        def finish(self, exit_code=0):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: Run(kw))
    return rows


@pytest.mark.slow  # about 3 s: a whole GEM run, with W&B and TensorBoard imported
def test_a_run_writes_every_commit_and_evaluation_row_beside_wandb(tmp_path, wandb_rows):
    summary = run(compose([*RUN, "logger.tensorboard=true", "logger.wandb.log_every=1"]), tmp_path / "run")
    assert summary["status"] == "completed"
    got = event_scalars(tmp_path / "run")
    m, ev = pd.read_parquet(tmp_path / "run" / "metrics.parquet"), pd.read_parquet(tmp_path / "run" / "eval.parquet")
    assert len(m) == summary["steps"] > 20 and len(ev) >= 3
    for column in ("loss", "staleness", "worker", "pi_median"):  # every commit row, at its step t
        assert close(got[f"train/{column}"], steps_and(m, column)), column
    for column in ("val_loss", "val_accuracy", "train_loss", "worker_step"):  # every evaluation row
        assert close(got[f"eval/{column}"], steps_and(ev, column)), column
    assert got["summary/steps"] == [(summary["steps"], summary["steps"])]
    assert close(got["summary/val_loss"], [(summary["steps"], summary["val_loss"])])
    # W&B, on at the same time, got the same rows under the same tags
    assert {tag for tag in got if not tag.startswith("summary/")} == set(wandb_rows)
    for tag, points in wandb_rows.items():
        assert close(got[tag], points), tag


def test_the_default_writes_no_event_files(tmp_path):
    assert compose([]).logger.tensorboard is False
    summary = run(compose([*RUN, "logger.wandb.mode=disabled"]), tmp_path / "run")
    assert summary["status"] == "completed" and not (tmp_path / "run" / "tensorboard").exists()


def test_a_killed_run_leaves_readable_event_files(tmp_path, monkeypatch):
    evaluate = metrics.Recorder.eval

    def killed_after_the_second(self, row):  # Ctrl-C just after the evaluation at t = 10
        evaluate(self, row)
        if row["step"] >= 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(metrics.Recorder, "eval", killed_after_the_second)
    with pytest.raises(KeyboardInterrupt):
        run(
            compose([*RUN, "logger.tensorboard=true", "logger.wandb.mode=disabled", "logger.wandb.log_every=1"]),
            tmp_path / "run",
        )
    got = event_scalars(tmp_path / "run")
    m = metrics.read_table(tmp_path / "run", "metrics")
    assert len(m) == 10 and close(got["train/loss"], steps_and(m, "loss"))
    assert [t for t, _ in got["eval/val_loss"]] == [0, 10]
    assert got["summary/steps"] == [(10, 10)]


def test_both_views_get_the_same_rows_at_one_cadence(tmp_path):
    a, b = [], []
    recorder = metrics.Recorder(
        tmp_path, sink=metrics.fan_out(None, lambda *r: a.append(r), lambda *r: b.append(r)), sink_every=3
    )
    for t in range(1, 8):
        recorder.commit({"step": t, "worker": 0, "worker_step": t, "staleness": 0, "loss": 1.0 / t})
    recorder.eval({"step": 7, "val_loss": 0.5})
    recorder.close()
    assert a == b and [(kind, row["step"]) for kind, row in a] == [("commit", 3), ("commit", 6), ("eval", 7)]
    assert metrics.fan_out(None, None) is None
    assert metrics.scalars("eval", {"step": 7, "val_loss": 0.5, "note": "x"}) == {"eval/val_loss": 0.5}


def test_a_resumed_run_replaces_the_points_past_its_checkpoint(tmp_path):
    first = tensorboard_logger.start(tmp_path, flush_seconds=30)
    for t in range(1, 9):  # killed at t = 8, its checkpoint at t = 5
        first("commit", {"step": t, "loss": 1.0})
    first.finish()
    resumed = tensorboard_logger.start(tmp_path, flush_seconds=30, resume_step=5)
    for t in range(6, 11):
        resumed("commit", {"step": t, "loss": 2.0})
    resumed.finish({"steps": 10})
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert event_scalars(tmp_path)["train/loss"] == [(t, 1.0 if t <= 5 else 2.0) for t in range(1, 11)]


def test_a_writer_that_fails_stops_logging_and_the_run_goes_on(capsys):
    class Full:
        closed = False

        def add_scalar(self, *a, **k):
            raise OSError(28, "No space left on device")

        def close(self):
            Full.closed = True

    logger = tensorboard_logger.TensorBoardLogger(Full(), None)
    logger("commit", {"step": 1, "loss": 0.5})
    logger("commit", {"step": 2, "loss": 0.4})  # stopped: nothing more is tried
    logger.finish({"steps": 2})
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TensorBoard stopped logging (OSError" in err and Full.closed


def test_a_missing_tensorboard_package_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(SystemExit) as e:
        preflight(["logger.tensorboard=true", f"hydra.run.dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "error: logger.tensorboard=true needs the tensorboard package, which is not installed; "
        "pip install tensorboard\n"
    )
    assert not (tmp_path / "run").exists()
