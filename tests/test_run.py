"""End to end: `python run.py` writes a proper run directory; sweeps go on past diverged runs; W&B never
hangs or fails a run."""

import json

import pandas as pd
import pytest
from helpers.rundir import check_run_dir
from helpers.warm_run import run_py

from experiments.config import compose
from experiments.runner import run


@pytest.mark.slow
def test_python_run_sgd_writes_run_directory(tmp_path):
    d = tmp_path / "run"
    p = run_py("algorithm=sgd", "epochs=1", f"hydra.run.dir={d}")
    assert p.returncode == 0, p.stderr
    summary, m, ev = check_run_dir(d, steps=1500 // 64)
    assert summary["status"] == "completed" and summary["algorithm"] == "sgd" and summary["workers"] == 1
    assert summary["mean_staleness"] == 0
    assert summary["final_train_loss"] < m["loss"].iloc[0]  # it learned something
    assert (d / ".hydra" / "config.yaml").is_file()
    assert list((d / "wandb").glob("offline-run-*")), "W&B offline run should live under the run directory"
    assert "val accuracy" in p.stdout and str(d) in p.stdout
    assert "\r" not in p.stdout and "commit/s" not in p.stdout + p.stderr  # no progress bar off a terminal


@pytest.mark.slow
def test_online_without_api_key_falls_back_to_offline(tmp_path):
    d = tmp_path / "run"
    p = run_py("epochs=1", "logger.wandb.mode=online", f"hydra.run.dir={d}", timeout=180)
    assert p.returncode == 0, p.stderr
    assert "no W&B API key" in p.stderr
    assert json.loads((d / "summary.json").read_text())["status"] == "completed"


def test_disabled_wandb_writes_nothing(tmp_path):
    cfg = compose(
        [
            "algorithm=sgd",
            "engine=sim",
            "epochs=1",
            "data=synthetic",
            "data.synthetic.train_size=256",
            "logger.wandb.mode=disabled",
            "logger.eval_every=2",
        ]
    )
    summary = run(cfg, tmp_path)
    assert summary["status"] == "completed" and "wandb" not in summary
    assert not (tmp_path / "wandb").exists()
    _, _, ev = check_run_dir(tmp_path, steps=256 // 64)
    assert ev["step"].tolist() == [0, 2, 4]


def test_divergence_is_a_status_not_a_crash(tmp_path):
    cfg = compose(["epochs=1", "data=synthetic", "lr=10000", "logger.wandb.mode=disabled"])
    summary = run(cfg, tmp_path)
    assert summary["status"] == "diverged"
    assert "non-finite" in summary["reason"]
    assert summary["val_loss"] is None  # no validation numbers for a diverged central variable
    assert pd.read_parquet(tmp_path / "metrics.parquet")["loss"].notna().all()


@pytest.mark.slow
def test_sweep_goes_on_past_a_diverged_run(tmp_path):
    p = run_py("-m", "lr=10000,0.05", "epochs=1", "logger.wandb.mode=disabled", f"hydra.sweep.dir={tmp_path}")
    assert p.returncode == 0, p.stderr
    statuses = [json.loads((tmp_path / str(i) / "summary.json").read_text())["status"] for i in (0, 1)]
    assert statuses == ["diverged", "completed"]


@pytest.mark.slow
def test_sgd_on_real_mnist(tmp_path, mnist_root):
    cfg = compose(
        [
            "algorithm=sgd",
            "engine=sim",
            "data=mnist",
            f"data.root={mnist_root}",
            "epochs=1",
            "logger.wandb.mode=disabled",
        ]
    )
    summary = run(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 4500 // 64  # 500 of 5,000 held out
    # one epoch of 4,500 digits: well above chance
    assert summary["val_accuracy"] > 0.8 and summary["test_accuracy"] > 0.8  # chance: 0.1


# Ctrl-C and SIGTERM close the run directory on every engine: tests/test_engines.py.


@pytest.mark.slow  # 2-3.5 s a case in the fast tier (2026-11-29)
def test_online_init_failure_falls_back_to_offline_once_per_process(tmp_path, monkeypatch, capsys):
    import wandb

    from experiments import wandb_logger

    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setattr(wandb_logger, "_online_failed", None)
    monkeypatch.setattr(wandb_logger, "_unavailable", None)
    real_init, modes = wandb.init, []

    def init(**kw):  # W&B servers unreachable: online init fails, offline works
        modes.append(kw["mode"])
        if kw["mode"] == "online":
            raise wandb.errors.CommError("no such host")
        return real_init(**kw)

    monkeypatch.setattr(wandb, "init", init)
    for job in ("a", "b"):
        logger = wandb_logger.start("online", tmp_path / job, {"x": 1}, name=job)
        assert logger is not None
        logger("commit", {"step": 1, "loss": 0.5})
        logger.finish({"status": "completed"})
        assert list((tmp_path / job / "wandb").glob("offline-run-*"))
    assert modes == ["online", "offline", "offline"]  # the second job does not retry online
    assert "logging offline instead" in capsys.readouterr().err


def test_batch_larger_than_the_loaded_cifar_shard_is_refused_with_one_line(tmp_path):
    from helpers.cifar import write_cifar

    from experiments.rundir import Refused

    write_cifar(tmp_path / "cifar", per_batch=3)  # 15 training images, 1 held out for validation: 14 to train on
    cfg = compose(
        [
            "data=cifar10",
            "model=alexnet_cifar",
            f"data.root={tmp_path / 'cifar'}",
            "batch_size=16",
            "logger.wandb.mode=disabled",
        ]
    )
    with pytest.raises(Refused) as e:
        run(cfg, tmp_path / "run")
    assert str(e.value) == (
        "batch_size=16 is larger than a worker's shard: data=cifar10 has 14 training "
        "examples, and every worker draws from all of them"
    )
    assert not (tmp_path / "run").exists()  # refused: nothing written, not even the directory


@pytest.mark.slow
def test_algorithm_sweep_writes_one_directory_per_job(tmp_path):
    """The issue's sweep shape on digits: every job gets its own directory and summary, GEM reports π, and a
    diverged DOWNPOUR (lr far too large) does not make the sweep fail."""
    # engine=sim: the sweep's mechanics are the point here (the process engine in a sweep: the test above)
    p = run_py(
        "-m",
        "algorithm=gem,downpour,adaptive",
        "workers=2,3",
        "lr=0.05",
        "epochs=1",
        "engine=sim",
        "logger.wandb.mode=disabled",
        f"hydra.sweep.dir={tmp_path}",
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    runs = [json.loads((tmp_path / str(i) / "summary.json").read_text()) for i in range(6)]
    assert [(r["algorithm"], r["workers"]) for r in runs] == [
        (a, n) for a in ("gem", "downpour", "adaptive") for n in (2, 3)
    ]
    assert len({r["run_dir"] for r in runs}) == 6
    assert all(r["status"] == "completed" and r["mean_staleness"] > 0 for r in runs)
    assert all(("pi_median" in r) == (r["algorithm"] == "gem") for r in runs)
    assert (tmp_path / "0" / "tensors.parquet").exists() and not (tmp_path / "2" / "tensors.parquet").exists()
