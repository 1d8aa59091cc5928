"""experiments.api: runs and sweeps from Python, with the command line's overrides, checks and one-line refusals."""

import json

import pytest
import torch.nn as nn
from helpers.paths import ROOT

import __main__
from experiments.api import Refused, run, sweep


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["workers=0"], "workers=0 is not allowed; workers must be an integer >= 1"),
        (["algorithm=nope"], "algorithm=nope is not an option; choose one of: "),
        (["seed=0,1"], "seed=0,1 is a sweep; add -m (--multirun) to run one job per value"),
        ([3], "3 is not an override: pass strings such as 'workers=8', or keywords (workers=8)"),
    ],
)
def test_bad_input_raises_the_command_line_s_one_line_and_writes_nothing(tmp_path, overrides, line):
    with pytest.raises(Refused) as e:
        run(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert str(e.value).startswith(line) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


class NotebookNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(28 * 28, num_classes)  # digits: 1x28x28

    def forward(self, x):
        return self.fc(x.flatten(1))


@pytest.fixture
def in_main(monkeypatch):
    """NotebookNet as a notebook cell defines it: a class of __main__."""
    monkeypatch.setattr(NotebookNet, "__module__", "__main__")
    monkeypatch.setattr(__main__, "NotebookNet", NotebookNet, raising=False)


def test_a_model_defined_in_main_is_refused_for_worker_processes_in_one_line(tmp_path, in_main):
    """A class from a notebook cell lives in __main__, which a worker process cannot import: refused before
    anything starts, naming the fix."""
    with pytest.raises(
        Refused,
        match=r"^model\._target_=__main__\.NotebookNet: a class defined in a notebook cell "
        r"or a script's __main__ cannot reach engine=process's worker processes.*"
        r"put the class in a module file",
    ):
        run(f"hydra.run.dir={tmp_path / 'run'}", model=NotebookNet)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_model_defined_in_main_trains_on_the_sim_engine(tmp_path, in_main):
    """The sim engine builds the model in this process, where __main__'s class is."""
    r = run(
        "engine=sim",
        "workers=2",
        "epochs=1",
        "logger.wandb.mode=disabled",
        f"hydra.run.dir={tmp_path / 'run'}",
        model=NotebookNet,
    )
    assert r.status == "completed" and r.summary["model"] == "__main__.NotebookNet"
    assert len(r.metrics) == r.summary["steps"]
    # the run directory of `python run.py`: .hydra/ included, so that analysis.load reads its config
    from analysis import load

    assert sorted(p.name for p in (r.run_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    row = load.runs(r.run_dir).iloc[0]
    assert (row["engine"], row["workers"], row["epochs"], row["model._target_"]) == (
        "sim",
        2,
        1,
        "__main__.NotebookNet",
    )


@pytest.mark.slow
def test_a_sweep_returns_its_runs_and_a_refused_one_raises(tmp_path):
    runs = sweep(
        "algorithm=gem,downpour",
        "engine=sim",
        "workers=2",
        "epochs=1",
        "logger.wandb.mode=disabled",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert sorted(runs["algorithm"]) == ["downpour", "gem"] and set(runs["status"]) == {"completed"}
    assert all(
        json.loads((tmp_path / "sweep" / str(i) / "summary.json").read_text())["status"] == "completed" for i in (0, 1)
    )
    with pytest.raises(Refused, match=r"^workers=0 is not allowed"):
        sweep("workers=0,1", f"hydra.sweep.dir={tmp_path / 'refused'}")
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_the_example_notebook_runs_in_a_jupyter_kernel(tmp_path):
    """examples/api.ipynb, executed by nbclient in a real kernel (engine=process: worker processes started from
    a kernel): both runs complete, the figure is drawn, bad input is refused in one line."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "examples" / "api.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert not [o for o in outputs if o.output_type == "error"], text[-2000:]
    assert "gem completed" in text and "downpour completed" in text, text[-2000:]
    assert "refused: workers=0 is not allowed; workers must be an integer >= 1" in text
    assert "276/276" in text and "TqdmWarning" not in text  # each run's progress bar, drawn in the notebook
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert len(list((tmp_path / "outputs").glob("*/*/summary.json"))) == 2


def test_an_interruption_inside_compiled_code_is_an_interruption_not_a_failure(tmp_path, monkeypatch):
    """Ctrl-C handled while a numba loop runs comes out of it as `SystemError: ... returned a result with an
    exception set`, caused by the KeyboardInterrupt (seen in CI on the sim engine): the run is interrupted, as
    for any Ctrl-C, not failed with an error."""
    from experiments import runner
    from experiments.config import compose
    from gem.engines import sim

    def numba_interrupted(job, recorder):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise SystemError("CPUDispatcher(<function _median_loop>) returned a result with an exception set") from e

    monkeypatch.setattr(sim, "run", numba_interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run(compose(["engine=sim", "logger.wandb.mode=disabled"]), tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == "interrupted (Ctrl-C)"
    assert not (tmp_path / "run" / "error.txt").exists()
