"""How long a run lasts (issue 44): fractional epochs, budget.worker_steps, and the caps budget.commits,
budget.seconds and budget.sim_time, with the limit that stopped it in the summary; the three splits a run reports;
the sim engine's default staleness model; and what the plan says of the evaluations' cost."""

import pandas as pd
import pytest

from experiments.config import compose
from experiments.rundir import Refused
from experiments.runner import run

SIM = ["engine=sim", "workers=3", "logger.wandb.mode=disabled", "logger.progress=false", "logger.eval_every=10"]
BATCHES = 1500 // 64  # digits: 23 mini-batches of 64 per epoch


def _run(tmp_path, *overrides):
    summary = run(compose([*SIM, *overrides]), tmp_path)
    return summary, pd.read_parquet(tmp_path / "metrics.parquet")


def test_a_quarter_of_an_epoch_and_worker_steps_set_the_workers_length(tmp_path):
    s, m = _run(tmp_path / "a", "epochs=0.25")
    # floor(0.25 x 23) = 5 gradient steps, and commits, per worker
    assert s["status"] == "completed" and s["steps"] == 3 * 5 and s["stopped_by"] == "epochs"
    assert m.groupby("worker")["worker_step"].max().tolist() == [5, 5, 5]
    s, m = _run(tmp_path / "b", "budget.worker_steps=7")  # in place of the default epochs=10
    assert s["steps"] == 3 * 7 and s["stopped_by"] == "budget.worker_steps" and s["epochs"] == 10


def test_budget_commits_on_sim_ends_the_run_at_that_clock_exactly(tmp_path):
    s, m = _run(tmp_path, "budget.commits=20")
    assert s["status"] == "completed" and s["steps"] == 20 and len(m) == 20 and s["stopped_by"] == "budget.commits"
    ev = pd.read_parquet(tmp_path / "eval.parquet")
    assert ev["step"].iloc[-1] == 20 and s["val_loss"] is not None  # the final θ is evaluated, as at any end


def test_budget_sim_time_lets_no_commit_land_after_it_and_eval_rows_carry_the_simulated_clock(tmp_path):
    s, m = _run(tmp_path, "budget.sim_time=6.5")
    assert s["stopped_by"] == "budget.sim_time" and 0 < s["steps"] < 3 * 10 * BATCHES
    assert m["sim_time"].max() <= 6.5
    ev = pd.read_parquet(tmp_path / "eval.parquet")
    # each evaluation knows when it was taken on the simulated clock: that of the commit it follows
    at = m.set_index("step")["sim_time"]
    assert ev["sim_time"].iloc[0] == 0 and (ev["sim_time"].iloc[1:] == ev["step"].iloc[1:].map(at)).all()


@pytest.mark.slow
def test_budget_commits_and_seconds_on_real_workers(tmp_path):
    """process: the workers in the middle of a gradient when the clock reaches the cap still commit, so a run ends
    at most n − 1 commits past it; budget.seconds counts from the start, as time_s."""
    s = run(
        compose(["workers=3", "budget.commits=30", "logger.wandb.mode=disabled", "logger.progress=false"]),
        tmp_path / "c",
    )
    assert s["status"] == "completed" and 30 <= s["steps"] <= 32 and s["stopped_by"] == "budget.commits"
    s = run(
        compose(
            ["workers=2", "epochs=1000", "budget.seconds=8", "logger.wandb.mode=disabled", "logger.progress=false"]
        ),
        tmp_path / "s",
    )
    m = pd.read_parquet(tmp_path / "s" / "metrics.parquet")
    assert s["status"] == "completed" and s["stopped_by"] == "budget.seconds" and 0 < s["steps"] < 2 * 1000 * BATCHES
    assert m["time_s"].max() < 8 + 5  # the gradients in flight at 8 s: one each, well under a second here


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["budget.seconds=10"],
            "budget.seconds=10.0 is not allowed on engine=sim: its seconds are this machine's, which "
            "the simulation does not model; use budget.sim_time",
        ),
        (
            ["engine=process", "budget.sim_time=10"],
            "budget.sim_time=10.0 is not allowed on engine=process: it is the sim "
            "engine's clock; use budget.seconds (wall-clock) or budget.commits",
        ),
        (
            ["algorithm=ssgd", "budget.commits=10"],
            "budget.commits is not allowed with algorithm=ssgd: its workers wait for whole rounds",
        ),
        (["budget.commits=0"], "budget.commits=0 is not allowed; it must be an integer >= 1, or null"),
        (
            ["epochs=0.01"],
            "epochs=0.01 (23 mini-batches of 64 per epoch of data=digits) gives each worker 0 gradient "
            "step(s); it needs at least one",
        ),
        (
            ["algorithm=agn", "budget.worker_steps=5"],
            "budget.worker_steps=5 gives each worker 5 gradient step(s); it needs at least 10 (algorithm.window",
        ),
    ],
)
def test_a_budget_that_cannot_run_is_refused_in_one_line_before_anything_is_written(tmp_path, overrides, line):
    with pytest.raises(Refused) as e:
        run(compose([*SIM, *overrides]), tmp_path / "run")
    assert str(e.value).startswith(line) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_run_reports_three_splits_and_its_staleness_model(tmp_path, capsys):
    s, _ = _run(tmp_path, "epochs=1")
    out = capsys.readouterr().out
    from experiments.runner import format_summary

    assert "data=digits (1500 train / 148 val / 149 test)" in out
    assert "test loss       " in format_summary(s) and "(gamma (CV 0.25))" in format_summary(s)
    assert s["test_loss"] > 0 and 0 <= s["test_accuracy"] <= 1
    # the sim engine's default: Gamma cycle times with CV 0.25, named in the summary
    assert s["staleness_model"] == "gamma (CV 0.25)"
    s, _ = _run(tmp_path / "rr", "epochs=1", "engine.staleness=round_robin")
    assert s["staleness_model"] == "round_robin"


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_the_plan_counts_the_evaluations_and_names_the_knob_that_shortens_them(capsys, monkeypatch):
    from experiments import command, plan

    monkeypatch.setattr(plan, "CALIBRATION_S", 0.05)
    with pytest.raises(SystemExit):
        command.preflight(["-m", "seed=0,1", *SIM, "logger.eval_every=1", "plan=true"])
    out = capsys.readouterr().out
    assert "evals" in out.splitlines()[1] and "of it evals" in out.splitlines()[1]
    assert "a larger logger.eval_every" in out  # one evaluation per commit: most of the estimate
    with pytest.raises(SystemExit):
        command.preflight(["-m", "seed=0,1", *SIM, "budget.commits=30", "plan=true"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:4]]
    assert [int(r[4].replace(",", "")) for r in rows] == [30, 30]  # the plan knows the cap


def test_stopped_by_names_the_workers_own_length_when_every_commit_was_made():
    """A run that made every worker's commits just before budget.seconds ran out was not stopped by it."""
    from types import SimpleNamespace

    from gem.engines.core import stopped_by

    job = SimpleNamespace(budget={"seconds": 5.0})
    assert stopped_by(job, 60, 6.0, full=True) == "epochs"
    assert stopped_by(job, 45, 6.0, full=False) == "budget.seconds"
    assert (
        stopped_by(SimpleNamespace(budget={"worker_steps": 7, "commits": 21}), 21, 1.0, full=True)
        == "budget.worker_steps"
    )
