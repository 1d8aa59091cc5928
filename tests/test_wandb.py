"""W&B by experiment (experiments/wandb_logger.py): a sweep's runs are grouped by experiment and launch time, each run
is named by what its command sets, and the config logged has every key with its default filled in."""

import dataclasses
import json
import os
import re
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
from helpers import warm_run
from omegaconf import OmegaConf

from experiments import wandb_logger
from experiments.config import compose, expand, options
from experiments.runner import run
from experiments.wandb_logger import group as wandb_group
from experiments.wandb_logger import launch_time
from experiments.wandb_logger import run_name as wandb_name
from gem.engines.options import SimOptions

STAMP = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")


def test_a_sweep_is_grouped_by_experiment_and_launch_time(tmp_path):
    default = "multirun/2026-11-21/13-52-44-123456"  # Hydra's default sweep directory: the time is in its name
    assert wandb_group("fig1", True, default) == "fig1 2026-11-21 13:52:44"
    assert wandb_group(None, True, default) == "sweep 2026-11-21 13:52:44"
    assert wandb_group("fig1", False, "outputs/2026-11-21/13-52-44-123456") == "fig1 2026-11-21 13:52:44"
    assert wandb_group(None, False, "outputs/2026-11-21/13-52-44-123456") is None  # a plain single run
    assert STAMP.fullmatch(wandb_group("fig1", False, tmp_path / "mine").removeprefix("fig1 "))
    # a custom sweep directory: the time Hydra wrote its multirun.yaml, when the sweep was launched
    (tmp_path / "multirun.yaml").write_text("{}\n")
    when = datetime(2026, 11, 21, 13, 52, 44).timestamp()
    os.utime(tmp_path / "multirun.yaml", (when, when))
    assert wandb_group("fig1", True, tmp_path) == "fig1 2026-11-21 13:52:44"
    # ... and without one, the same time for every job of the sweep that this process runs
    first = launch_time(tmp_path / "custom", True)
    assert STAMP.fullmatch(first) and launch_time(tmp_path / "custom", True) == first


def _cfg(algorithm="gem", workers=10, seed=0):
    return OmegaConf.create({"algorithm": {"name": algorithm}, "workers": workers, "seed": seed})


def test_run_names_show_the_algorithm_n_the_seed_and_the_keys_set():
    assert wandb_name(_cfg(), ["experiment=fig1", "algorithm=gem", "workers=10", "seed=0"]) == "gem n=10 s0"
    overrides = [
        "algorithm=gem",
        "algorithm.kappa=2",
        "workers=10",
        "seed=0",
        "data.root=/data",
        "lr=0.01",
        "engine.cycle_cv=0.5",
        "logger.wandb.mode=offline",
        "hydra.launcher.n_jobs=2",
        "resume=true",
        "+algorithm.proxy=global",
        "~model.num_classes",
    ]
    assert wandb_name(_cfg(), overrides) == "gem κ=2 proxy=global n=10 η=0.01 cv=0.5 s0"
    assert wandb_name(_cfg("sgd", 1, 3), []) == "sgd n=1 s3"


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_run_names_are_unique_within_every_experiment_sweep():
    for experiment in options("experiment"):
        names = []
        for job in expand([f"experiment={experiment}", "data.root=/data"], True):
            values = dict(o.split("=", 1) for o in job)  # what the sweep does not set is the same in every job
            names.append(
                wandb_name(_cfg(values.get("algorithm", "a"), values.get("workers", 1), values.get("seed", 0)), job)
            )
        assert len(set(names)) == len(names), (experiment, names)
        if experiment == "fig8":
            assert "gem κ=2 n=30 s1" in names


class FakeRun:
    def __init__(self, kw):
        self.kw, self.dir, self.url, self.summary = kw, kw["dir"], None, {}

    def log(self, data, step=None):
        pass

    def finish(self, exit_code=0):
        pass


@pytest.fixture
def captured(monkeypatch):
    """wandb.init replaced: its keyword arguments are captured, nothing is written."""
    import wandb

    monkeypatch.setattr(wandb_logger, "_online_failed", None)
    monkeypatch.setattr(wandb_logger, "_unavailable", None)
    calls = []

    def init(**kw):
        calls.append(kw)
        return FakeRun(kw)

    monkeypatch.setattr(wandb, "init", init)
    return calls


@pytest.fixture
def hydra_context():
    """The HydraConfig a job launched by run.py sees (runtime.choices), for a config composed here."""
    from hydra.core.hydra_config import HydraConfig

    def set_(overrides):
        HydraConfig.instance().set_config(compose(overrides, return_hydra_config=True))
        return compose(overrides)

    yield set_
    HydraConfig.instance().cfg = None


TINY = [
    "workers=2",
    "epochs=1",
    "data=synthetic",
    "data.synthetic.train_size=256",
    "data.synthetic.val_size=64",
    "logger.progress=false",
    "logger.wandb.mode=offline",
]


def test_the_logged_config_has_every_default_the_choices_and_the_experiment(tmp_path, captured, hydra_context):
    cfg = hydra_context(["experiment=fig1_quick", "algorithm=gem", *TINY])
    summary = run(
        cfg,
        tmp_path / "run",
        wandb_group="fig1_quick 2026-11-21 13:52:44",
        wandb_name="gem n=2 s0",
        experiment="fig1_quick",
    )
    assert summary["status"] == "completed"
    (kw,) = captured
    assert (kw["group"], kw["name"], kw["mode"]) == ("fig1_quick 2026-11-21 13:52:44", "gem n=2 s0", "offline")
    config = kw["config"]
    assert json.loads(json.dumps(config)) == config  # plain JSON
    # schema defaults the YAML does not set, and the algorithm's own defaults
    # the engine's every option (gem.engines.options: sim has no silence timeout), and the run's checkpoint schedule
    assert set(config["engine"]) == {f.name for f in dataclasses.fields(SimOptions)} | {"checkpoint_every"}
    assert config["data"]["augment"] is True and config["data"]["synthetic"]["train_size"] == 256
    assert config["algorithm"] == {"name": "gem", "kappa": 1.0, "pi_max": 5.0, "eps": 1e-12, "proxy": "local"}
    assert config["engine"]["staleness"] == "gamma"  # the experiment's own settings
    assert config["logger"]["wandb"]["log_every"] == 10 and config["loss"] == "nll"
    assert config["model"]["name"] == "mnist_cnn" and config["model"]["parameters"] > 0
    assert {k: config[k] for k in ("workers", "workers_requested", "lr", "batch_size", "epochs", "seed")} == {
        "workers": 2,
        "workers_requested": 2,
        "lr": 0.05,
        "batch_size": 64,
        "epochs": 1,
        "seed": 0,
    }
    assert config["experiment"] == "fig1_quick" and config["run_dir"] == str(tmp_path / "run")
    assert config["choices"] == {
        "experiment": "fig1_quick",
        "algorithm": "gem",
        "engine": "sim",
        "model": "mnist_cnn",
        "data": "synthetic",
        "logger": "default",
    }


def test_the_group_set_by_the_user_wins(tmp_path, captured):
    cfg = compose(["algorithm=sgd", "engine=sim", *TINY, "logger.wandb.group=mine"])
    run(cfg, tmp_path / "run", wandb_group="sweep 2026-11-21 13:52:44", wandb_name="sgd n=2 s0")
    assert captured[0]["group"] == "mine"
    assert captured[0]["config"]["workers"] == 1 and captured[0]["config"]["workers_requested"] == 2
    assert captured[0]["config"]["choices"] == {}  # no Hydra job: run() called directly


def wandb_records(path: Path):
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf records, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


@pytest.mark.slow
def test_a_sweep_logs_its_group_name_and_full_config_offline(tmp_path):
    p = warm_run.run_py(
        "-m",
        "experiment=fig1_quick",
        "algorithm=gem",
        "workers=2",
        "seed=0",
        "algorithm.kappa=2",
        "epochs=1",
        "logger.wandb.mode=offline",
        "logger.progress=false",
        f"hydra.sweep.dir={tmp_path}",
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    (offline,) = (tmp_path / "0" / "wandb").glob("offline-run-*/run-*.wandb")
    (header,) = [r.run for r in wandb_records(offline) if r.WhichOneof("record_type") == "run"]
    assert re.fullmatch(r"fig1_quick " + STAMP.pattern, header.run_group)  # a custom sweep directory: launch time
    assert header.display_name == "gem κ=2 n=2 epochs=1 s0"
    config = {u.key: json.loads(u.value_json) for u in header.config.update}
    assert config["algorithm"]["kappa"] == 2.0 and config["engine"]["cycle_cv"] == 0.25
    assert config["data"]["augment"] is True and config["data"]["name"] == "digits"
    assert config["experiment"] == "fig1_quick" and config["choices"]["algorithm"] == "gem"
    ev = pd.read_parquet(tmp_path / "0" / "eval.parquet")  # and the evaluation rows carry worker_step
    assert ev["worker_step"].tolist() == [t / 2 for t in ev["step"]]
