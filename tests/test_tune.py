"""The tuning protocol (analysis.tune, hydra.sweeper.grids) on sweeps written by hand: the score and the choice,
the held-out experiment it writes, the refusals, and the two protocols side by side."""

import json

import pytest
import yaml

from analysis import load, tune
from experiments.config import ConfigError, check_job, expand, jobs_of


def _run(d, algorithm, n, seed, lr, status="completed", val_loss=1.0, experiment="tune_quick", data=None, **knobs):
    """A run directory with what analysis.tune reads: its config (the settings; `data`, its data group) and its
    summary."""
    (d / ".hydra").mkdir(parents=True)
    config = {"algorithm": {"name": algorithm, **knobs}, "workers": n, "seed": seed, "lr": lr}
    if data:
        config["data"] = data
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "summary.json").write_text(
        json.dumps(
            {
                "status": status,
                "algorithm": algorithm,
                "workers": n,
                "seed": seed,
                "lr": lr,
                "experiment": experiment,
                "val_loss": val_loss if status == "completed" else None,
                "val_accuracy": 0.5,
                "test_loss": val_loss + 0.05 if status == "completed" else None,
                "test_accuracy": 0.5,
            }
        )
    )


def _tuning_sweep(root, seeds=(10, 11), data=None, downpour=((0.9, 0.9), (0.7, 0.7))):
    """GEM at n = 4: (lr, κ) = (0.05, 1) scores 1.0; (0.2, 2) 0.5 on one seed but diverges on the other; (0.05, 2)
    0.8 (0.7 and 0.9). DOWNPOUR: lr 0.05 scores 0.9, lr 0.2 0.7 (`downpour`: each seed's). Seeds 10 and 11."""
    job = 0
    for lr, kappa, losses in [(0.05, 1, (1.0, 1.0)), (0.2, 2, (0.5, None)), (0.05, 2, (0.7, 0.9))]:
        for seed, loss in zip(seeds, losses, strict=True):
            _run(
                root / str(job),
                "gem",
                4,
                seed,
                lr,
                status="completed" if loss else "diverged",
                val_loss=loss,
                data=data,
                kappa=kappa,
            )
            job += 1
    for lr, losses in zip((0.05, 0.2), downpour, strict=True):
        for seed, loss in zip(seeds, losses, strict=True):
            _run(root / str(job), "downpour", 4, seed, lr, val_loss=loss, data=data)
            job += 1
    return root


def _multirun_yaml(sweep, task, heldout_seeds=None, cwd="/home/user/project", config_dir=None):
    """The multirun.yaml gem's sweeper writes: what analysis.tune reads of it (the command's overrides, its
    working folder and config folders, the declared held-out seeds)."""
    sources = [{"path": "hydra.conf", "schema": "pkg", "provider": "hydra"}]
    sources.append({"path": "/work/gem/conf", "schema": "file", "provider": "main"})
    if config_dir:
        sources.append({"path": str(config_dir), "schema": "file", "provider": "command-line"})
    hydra = {
        "sweeper": {"_target_": "hydra_plugins.gem_sweeper.gem_sweeper.GemSweeper", "heldout_seeds": heldout_seeds},
        "overrides": {"task": list(task)},
        "runtime": {"cwd": cwd, "config_sources": sources},
    }
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra}))


def test_a_trial_is_scored_by_its_mean_validation_loss_and_a_diverged_seed_makes_it_the_worst(tmp_path):
    t = tune.trials(load.runs(_tuning_sweep(tmp_path)))
    gem = t[t["algorithm"] == "gem"].set_index("setting")
    assert list(gem.index) == ["kappa=1 lr=0.05", "kappa=2 lr=0.2", "kappa=2 lr=0.05"]  # the sweep's order
    assert gem.loc["kappa=2 lr=0.2", "score"] == float("inf") and gem.loc["kappa=2 lr=0.2", "diverged"] == 1
    assert gem.loc["kappa=2 lr=0.05", "val_loss_mean"] == pytest.approx(0.8)
    assert gem["chosen"].tolist() == [False, False, True] and gem["rank"].tolist() == [2, 3, 1]
    down = t[t["algorithm"] == "downpour"].set_index("setting")  # κ is GEM's setting, not DOWNPOUR's
    assert list(down.index) == ["lr=0.05", "lr=0.2"] and down.loc["lr=0.2", "chosen"]


def test_the_sensitivity_figure_explains_its_crosses_in_the_legend_only_where_it_draws_one(tmp_path, monkeypatch):
    """An η at which every trial of an algorithm had a diverged seed is an × on the panel's top line, explained in the
    legend (written in the panel, above that line, an × covered the words); a figure with no × does not explain it.
    Two algorithms crossed at one η are two ×'s side by side (drawn at one point, one hid the other: n = 30)."""
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # the figure, kept to be read
    t = tune.trials(load.runs(_tuning_sweep(tmp_path)))  # GEM's only trial at η 0.2 has a diverged seed
    both = t.copy()
    both.loc[(both["algorithm"] == "downpour") & (both["lr"] == 0.2), "score"] = float("inf")  # DOWNPOUR's too
    for table in (t, t[t["lr"] != 0.2], both):
        tune.sensitivity_figure(table, tmp_path / "sensitivity.png")
    legends = [[x.get_text() for x in f.axes[-1].get_legend().get_texts()] for f in drawn]
    crosses = [[label for label in legend if label.startswith("×")] for legend in legends]
    assert crosses[0] == ["× on the top line: every\ntrial at this η had a\ndiverged seed"] and crosses[1] == []
    assert "gem" in legends[0] and "gem" in legends[1]
    # two algorithms crossed at one η: two ×'s, side by side, each in its algorithm's colour
    marks = [line for line in drawn[2].axes[0].get_lines() if line.get_marker() == "x"]
    assert len(marks) == 2 and len({float(m.get_xdata()[0]) for m in marks}) == 2
    assert len({m.get_color() for m in marks}) == 2


@pytest.mark.slow
def test_tune_writes_the_held_out_experiment_with_the_papers_setting_beside_each_choice(tmp_path, monkeypatch, capsys):
    import experiments.schema

    sweep = _tuning_sweep(tmp_path / "sweep")
    conf = tmp_path / "conf"
    monkeypatch.setattr(experiments.schema, "CONF_DIR", conf)  # where --write-conf writes (not the repo's conf/)
    # by default beside the tuning sweep, as run outputs are, and found there by Hydra's --config-dir
    assert tune.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    here = (sweep / "heldout").resolve()
    assert f"python run.py -m --config-dir {here} experiment=tune_quick_heldout plan=true" in out
    assert "1 of them the paper's" not in out and not conf.exists()
    text = (here / "experiment" / "tune_quick_heldout.yaml").read_text()
    # --write-conf: into the repository's conf/experiment/ (the paper's tune_heldout), run by its name alone
    assert tune.main([str(sweep), "--write-conf"]) == 0
    assert "  python run.py -m experiment=tune_quick_heldout plan=true" in capsys.readouterr().out
    assert (conf / "experiment" / "tune_quick_heldout.yaml").read_text() == text
    node = yaml.safe_load(text)
    assert node["defaults"] == ["tune_quick"] and node["hydra"]["sweeper"]["params"] == {"seed": "0,1,2"}
    assert node["hydra"]["sweeper"]["heldout_seeds"] is None  # it is the held-out stage
    assert node["hydra"]["sweeper"]["grids"] == [
        {"algorithm": "gem", "workers": "4", "lr": 0.05},  # the paper's protocol: η 0.05, κ at its default
        {"algorithm": "gem", "workers": 4, "algorithm.kappa": 2, "lr": 0.05},
        {"algorithm": "downpour", "workers": "4", "lr": 0.05},
        {"algorithm": "downpour", "workers": 4, "lr": 0.2},
    ]
    assert (sweep / "tuning.csv").exists() and (sweep / "sensitivity.png").stat().st_size > 10_000

    # the same choice again is no change; another choice is not overwritten without --force
    assert tune.main([str(sweep), "--write-conf"]) == 0
    (conf / "experiment" / "tune_quick_heldout.yaml").write_text(text.replace("0.2", "0.4"))
    capsys.readouterr()
    assert tune.main([str(sweep), "--write-conf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds another choice; add --force" in err

    # where conf/ holds an experiment of that name, Hydra would take conf/'s: the sweep's own is named after it
    assert tune.main([str(sweep)]) == 0
    assert f"--config-dir {here} experiment=tune_quick_heldout_sweep plan=true" in capsys.readouterr().out
    assert (here / "experiment" / "tune_quick_heldout_sweep.yaml").read_text() == text

    # Hydra finds it where the suggested command says: a plan of its jobs, from another folder
    from helpers import warm_run
    from helpers.paths import ROOT

    monkeypatch.undo()
    r = warm_run.run_py(
        "-m",
        "--config-dir",
        str(here),
        "experiment=tune_quick_heldout",
        "plan=true",
        cwd=tmp_path,
        script=str(ROOT / "run.py"),
    )
    assert r.returncode == 0, r.stderr
    assert "gem: plan for 12 jobs" in r.stdout and "algorithm=downpour lr=0.2 seed=2" in r.stdout

    # every job it makes is a valid job of the experiment it names (composed from the repository's conf/)
    jobs = jobs_of({"seed": "0,1,2"}, ["experiment=tune_quick"], node["hydra"]["sweeper"]["grids"])
    assert len(jobs) == 12 and all(check_job(j) for j in jobs[::3])


def test_tune_refuses_an_unfinished_sweep_and_held_out_seeds_that_were_tuned_on(tmp_path, capsys):
    sweep = _tuning_sweep(tmp_path / "sweep")
    assert tune.main([str(sweep), "--seeds", "0,11"]) == 2
    assert capsys.readouterr().err == (
        "error: --seeds=0,11 is not allowed; seed 11 was a tuning seed (the tuning sweep ran seeds 10,11), the "
        "held-out seeds must be new\n"
    )
    (sweep / "3" / "summary.json").unlink()  # a job killed before its summary
    assert tune.main([str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "1 run(s) incomplete" in err and "resume=true" in err
    # one still running (its command holds its directory): resume=true would be refused for it, so not advised
    import fcntl
    import os

    fd = os.open(sweep / "3", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert tune.main([str(sweep)]) == 2
        err = capsys.readouterr().err
        running = f"1 run(s) still running ({sweep / '3'}): wait for their command to end, then tune"
        assert err == f"error: {sweep}: {running}\n"
    finally:
        os.close(fd)


def test_the_held_out_seeds_default_to_fresh_ones_where_the_sweep_declares_none(tmp_path, capsys):
    # a user's own sweep on seeds 0 and 1, declaring no hydra.sweeper.heldout_seeds: the next three, said so
    sweep = _tuning_sweep(tmp_path / "sweep", seeds=(0, 1))
    assert tune.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert (
        "on seeds 2,3,4 (the 3 smallest seeds the tuning sweep did not use: it ran seeds 0,1; --seeds picks others)"
        in out
    )
    node = yaml.safe_load((sweep / "heldout" / "experiment" / "tune_quick_heldout.yaml").read_text())
    assert node["hydra"]["sweeper"]["params"] == {"seed": "2,3,4"}
    # held-out seeds the sweep declares (experiment=tune's 0,1,2) that it also tuned on (seed=0,1 on its command)
    # are refused, naming where they came from; the command writes nothing
    other = _tuning_sweep(tmp_path / "other", seeds=(0, 1))
    _multirun_yaml(other, ["experiment=tune_quick", "seed=0,1"], heldout_seeds="0,1,2")
    before = sorted(p.name for p in other.iterdir())
    assert tune.main([str(other)]) == 2
    assert capsys.readouterr().err == (
        f"error: hydra.sweeper.heldout_seeds=0,1,2 (declared by the tuning sweep, in {other / 'multirun.yaml'}) is "
        "not allowed; seed 0 was a tuning seed (the tuning sweep ran seeds 0,1), the held-out seeds must be new: "
        "pass others with --seeds, such as --seeds=2,3,4\n"
    )
    assert sorted(p.name for p in other.iterdir()) == before
    assert tune.main([str(other), "--seeds", "5,6,7"]) == 0 and "on seeds 5,6,7 (--seeds)" in capsys.readouterr().out


def _suggested(out: str) -> list[str]:
    """The commands analysis.tune suggests for the held-out stage (its indented lines)."""
    return [line.strip() for line in out.splitlines() if line.startswith("  python ")]


def test_the_suggested_commands_fit_the_sweeps_data_and_the_installed_launchers(tmp_path, capsys, monkeypatch):
    from helpers.paths import ROOT

    import experiments.schema
    from experiments import command

    monkeypatch.chdir(ROOT)  # where the README runs `python run.py`
    # nothing is written into the source tree's conf/ (were it, it would be this test's folder)
    monkeypatch.setattr(experiments.schema, "CONF_DIR", tmp_path / "conf")
    # digits reads no files: no data.root, whatever the sweep's command said; no joblib where it is not installed
    monkeypatch.setattr(command, "launcher_installed", lambda name: False, raising=False)
    digits = {"name": "digits", "root": "data", "num_classes": 10}
    sweep = _tuning_sweep(tmp_path / "digits", data=digits)
    _multirun_yaml(sweep, ["experiment=tune_quick", "data.root=somewhere", "workers=4"], heldout_seeds="0,1,2")
    assert tune.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    here = (sweep / "heldout").resolve()
    assert _suggested(out) == [
        f"python run.py -m --config-dir {here} experiment=tune_quick_heldout plan=true",
        f"python run.py -m --config-dir {here} experiment=tune_quick_heldout",
        f"python -m analysis.tune {sweep} --heldout <its sweep folder>",
    ]
    assert 'pip install -e ".[joblib]"' in out and "data.root" not in out
    # MNIST reads its files under data.root: the sweep's own, made absolute, with the rest of its command (not
    # what the held-out experiment sets itself: the seeds, n, the settings); joblib where it is installed
    monkeypatch.setattr(command, "launcher_installed", lambda name: True)
    mnist = {"name": "mnist", "root": "../data/full", "num_classes": 10}
    sweep = _tuning_sweep(tmp_path / "mnist", data=mnist)
    task = [
        "experiment=tune_quick",
        "data=mnist",
        "data.root=../data/full",
        "workers=4",
        "budget.worker_steps=40",
        "logger.eval_every=80",
    ]
    _multirun_yaml(sweep, [*task, "seed=10,11"], heldout_seeds="0,1,2", cwd="/home/user/project")
    assert tune.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    run = (
        f"python run.py -m --config-dir {(sweep / 'heldout').resolve()} experiment=tune_quick_heldout data=mnist "
        "data.root=/home/user/data/full budget.worker_steps=40"
    )
    assert _suggested(out)[:2] == [f"{run} plan=true", f"{run} hydra/launcher=joblib hydra.launcher.n_jobs=2"]
    assert "(left out of the tuning sweep's command: workers=4 logger.eval_every=80: the held-out experiment" in out
    # a sweep of no experiment: the held-out stage stands on nothing but the command's own settings, carried
    plain = tmp_path / "plain"
    for job, (lr, seed) in enumerate([(0.05, 10), (0.05, 11), (0.2, 10), (0.2, 11)]):
        _run(plain / str(job), "downpour", 4, seed, lr, val_loss=1.0 - lr, experiment=None, data=digits)
    _multirun_yaml(plain, ["algorithm=downpour", "lr=0.05,0.2", "seed=10,11", "engine=sim", "epochs=2"])
    assert tune.main([str(plain)]) == 0
    out = capsys.readouterr().out
    node = yaml.safe_load((plain / "heldout" / "experiment" / "tuning_heldout.yaml").read_text())
    assert "defaults" not in node and node["hydra"]["sweeper"]["grids"][1] == {
        "algorithm": "downpour",
        "workers": 4,
        "lr": 0.2,
    }
    here = (plain / "heldout").resolve()
    run = f"python run.py -m --config-dir {here} experiment=tuning_heldout engine=sim epochs=2"
    assert _suggested(out)[0] == f"{run} plan=true"
    assert not (tmp_path / "conf").exists()
    # from another folder, run.py is named by its path: the command runs as printed there too
    monkeypatch.chdir(tmp_path)
    assert tune.main([str(plain)]) == 0
    elsewhere = run.replace(" run.py ", f" {ROOT / 'run.py'} ")
    assert _suggested(capsys.readouterr().out)[0] == f"{elsewhere} plan=true"


def test_a_sweep_of_an_experiment_in_its_own_config_dir_gets_a_held_out_stage_that_finds_it(tmp_path, capsys):
    # the user's own experiment, in their own folder (python run.py -m --config-dir mine experiment=mine_tune)
    mine = tmp_path / "mine"
    (mine / "experiment").mkdir(parents=True)
    (mine / "experiment" / "mine_tune.yaml").write_text("# @package _global_\ndefaults:\n  - tune_quick\n\nlr: 0.1\n")
    sweep = tmp_path / "sweep"
    for job, (lr, seed) in enumerate([(0.1, 10), (0.1, 11), (0.2, 10), (0.2, 11)]):
        _run(sweep / str(job), "downpour", 4, seed, lr, val_loss=1.0 - lr, experiment="mine_tune")
    _multirun_yaml(sweep, ["experiment=mine_tune", "lr=0.1,0.2"], heldout_seeds="0,1,2", config_dir=mine)
    assert tune.main([str(sweep)]) == 0  # the paper's setting is composed from the user's experiment: η 0.1
    node = yaml.safe_load((sweep / "heldout" / "experiment" / "mine_tune_heldout.yaml").read_text())
    assert node["defaults"] == ["mine_tune"]
    assert node["hydra"]["sweeper"]["grids"] == [
        {"algorithm": "downpour", "workers": "4", "lr": 0.1},
        {"algorithm": "downpour", "workers": 4, "lr": 0.2},
    ]
    here = (sweep / "heldout").resolve()
    assert _suggested(capsys.readouterr().out)[0] == (
        f"python run.py -m --config-dir {here} 'hydra.searchpath=[file://{mine}]' experiment=mine_tune_heldout "
        "plan=true"
    )


def test_each_choice_says_whether_its_seeds_tell_it_apart_from_the_runner_up(tmp_path, capsys):
    # GEM's choice (κ 2: 0.7, 0.9) against κ 1 (1.0, 1.0): not told apart on 2 seeds; DOWNPOUR's lr 0.2 (0.69,
    # 0.71) against lr 0.05 (0.90, 0.92): told apart
    data = {"name": "digits", "num_classes": 10}
    sweep = _tuning_sweep(tmp_path / "sweep", data=data, downpour=((0.90, 0.92), (0.69, 0.71)))
    assert tune.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in out.splitlines() if "|  " in line}
    assert rows["gem"] == "not told apart from kappa=1 lr=0.05 at 95% (p = 0.32)"
    assert rows["downpour"] == "told apart from lr=0.05 (p = 0.006)"
    assert "told apart from the runner-up at 95% (Welch's t-test over the 2 tuning seeds, val loss on the log " in out
    assert "): 1 of 2 choices (downpour at n = 4)\nnot told apart: gem at n = 4: on these seeds" in out
    import pandas as pd

    t = pd.read_csv(sweep / "tuning.csv").set_index("setting")
    assert t.loc["kappa=2 lr=0.05", "runner_up"] == "kappa=1 lr=0.05" and not t.loc["kappa=2 lr=0.05", "told_apart"]
    assert t.loc["kappa=2 lr=0.05", "p_runner_up"] == pytest.approx(0.32, abs=0.005)
    # a workload where no trial left chance (ln 10 = 2.30) by more than 10%: said, whatever its p
    dull = _tuning_sweep(tmp_path / "dull", data=data, downpour=((2.25, 2.26), (2.10, 2.11)))
    assert tune.main([str(dull)]) == 0
    out = capsys.readouterr().out
    assert "did not learn: mean val loss 2.105, within 10% of chance's (ln 10 = 2.303)" in out
    assert "did not learn: downpour at n = 4: no trial's mean validation loss is below chance's by more than 10%" in out


def test_welch_p_tells_two_settings_seeds_apart_on_the_log_scale():
    from analysis.stats import welch_p

    assert welch_p([0.12, 0.15, 0.11], [0.30, 0.33, 0.28]) == pytest.approx(0.0035, abs=1e-4)
    assert welch_p([1.0, 1.2, 0.9], [0.95, 1.15, 1.0]) > 0.9
    assert welch_p([0.5], [0.6, 0.7]) != welch_p([0.5], [0.6, 0.7])  # NaN: one seed has no spread to test against
    assert welch_p([0.5, 0.5], [0.6, 0.6]) == 0.0 and welch_p([0.5, 0.5], [0.5, 0.5]) == 1.0


def test_the_two_protocols_side_by_side_on_the_held_out_seeds(tmp_path, capsys):
    sweep = _tuning_sweep(tmp_path / "sweep")
    held = tmp_path / "held"
    job = 0
    for algorithm, lr, kappa, losses in [
        ("gem", 0.05, None, (1.1, 1.3, 1.2)),
        ("gem", 0.05, 2, (0.7, 0.8, 0.9)),
        ("downpour", 0.05, None, (0.9, 1.0, 1.1)),
        ("downpour", 0.2, None, (0.6, None, 0.6)),
    ]:
        for seed, loss in zip((0, 1, 2), losses, strict=True):
            knobs = {"kappa": kappa if kappa else 1} if algorithm == "gem" else {}
            _run(
                held / str(job),
                algorithm,
                4,
                seed,
                lr,
                status="completed" if loss else "diverged",
                val_loss=loss,
                experiment="tune_quick_heldout",
                **knobs,
            )
            job += 1
    # a refused command writes nothing, not even the tuning sweep's own files
    assert tune.main([str(sweep), "--heldout", str(held), "--out", str(tmp_path / "p.txt")]) == 2
    assert "--out=" in capsys.readouterr().err and not (sweep / "tuning.csv").exists()
    assert tune.main([str(sweep), "--heldout", str(held), "--out", str(tmp_path / "p.csv")]) == 0
    import pandas as pd

    c = pd.read_csv(tmp_path / "p.csv").set_index("algorithm")
    assert c.loc["gem", "paper setting"] == "kappa=1 lr=0.05" and c.loc["gem", "tuned setting"] == "kappa=2 lr=0.05"
    assert c.loc["gem", "paper_val_loss_mean"] == pytest.approx(1.2)
    assert c.loc["gem", "tuned_val_loss_mean"] == pytest.approx(0.8) and c.loc["gem", "tuned_k"] == 3
    # the held-out result is the test split's (chosen on validation, reported on test)
    assert c.loc["gem", "tuned_test_loss_mean"] == pytest.approx(0.85)
    assert c.loc["downpour", "tuned diverged"] == 1 and c.loc["downpour", "tuned_k"] == 2
    assert "held-out seeds: final test loss and accuracy" in capsys.readouterr().out
    # the targets were announced from the tuning seeds: per workload, the best chosen setting's median final
    # validation loss (gem κ = 2: 0.7 and 0.9, the upper middle value of two: 0.9; downpour lr 0.2: 0.7)
    t = pd.read_csv(sweep / "targets.csv")
    assert t["target"].tolist() == [pytest.approx(0.7)] and t["set_by"].tolist() == ["downpour"]


def test_a_tuning_sweep_refuses_to_select_on_the_test_split(tmp_path, capsys):
    sweep = _tuning_sweep(tmp_path / "sweep")
    assert tune.main([str(sweep), "--select", "test_loss"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --select=test_loss is not allowed; choose one of: val_loss, val_accuracy; the tuning "
        "protocol chooses on the validation split; the test split is kept for the held-out report "
        "(--heldout gives its test loss), and a choice made on it would leak into the result\n"
    )
    assert sorted(p.name for p in sweep.iterdir() if not p.name.isdigit()) == []  # nothing written


# ------------------------------------------------------------------------------------------ grids


def test_grids_sweep_each_grid_in_turn_with_the_params_and_the_command():
    grids = [{"algorithm": "gem", "lr": "0.1,0.2", "algorithm.kappa": [1, 2]}, {"algorithm": "downpour", "lr": 0.1}]
    jobs = jobs_of({"workers": "2,3", "seed": 0}, ["epochs=2"], grids)
    assert jobs[:3] == [
        ["algorithm=gem", "lr=0.1", "algorithm.kappa=1", "workers=2", "seed=0", "epochs=2"],
        ["algorithm=gem", "lr=0.1", "algorithm.kappa=1", "workers=3", "seed=0", "epochs=2"],
        ["algorithm=gem", "lr=0.1", "algorithm.kappa=2", "workers=2", "seed=0", "epochs=2"],
    ]
    assert len(jobs) == 8 + 2 and jobs[-1] == ["algorithm=downpour", "lr=0.1", "workers=3", "seed=0", "epochs=2"]
    # the command line wins, in its place; a job two grids both make runs once
    assert jobs_of({}, ["lr=0.5"], [{"lr": "0.1,0.2"}, {"lr": "0.3"}]) == [["lr=0.5"]]
    with pytest.raises(ConfigError, match=r"hydra.sweeper.grids\[1\]=lr is not allowed; each grid must be a mapping"):
        jobs_of({}, [], [{"lr": 0.1}, "lr"])


def test_the_tuning_experiment_gives_every_algorithm_the_same_trials_the_papers_setting_among_them():
    jobs = expand(["experiment=tune"], multirun=True)
    assert len(jobs) == 9 * 6 * 3 * 2
    by_algorithm = {}
    for job in jobs:
        d = dict(o.split("=", 1) for o in job)
        assert d["seed"] in ("10", "11") and d["workers"] in ("5", "10", "30")
        by_algorithm.setdefault(d["algorithm"], set()).add(
            tuple(sorted((k, v) for k, v in d.items() if k not in ("seed", "workers", "experiment")))
        )
    assert {len(trials) for trials in by_algorithm.values()} == {6} and len(by_algorithm) == 9
    for algorithm, trials in by_algorithm.items():  # η 0.05 at the default knob is always one of them
        assert any(
            dict(t)["lr"] == "0.05"
            and all(k == "algorithm" or k == "lr" or v.lower() in ("1", "10", "0.9", "false", "0.7") for k, v in t)
            for t in trials
        ), algorithm


def test_the_quick_tuning_sweep_runs_long_enough_for_the_algorithms_to_learn_on_digits():
    # at tune's one epoch per worker (23 steps on digits) every algorithm but GEM ended near chance (validation
    # loss 1.8-2.2 against ln 10 = 2.30), and the choices among those runs were noise; at 4 epochs (92 steps) each
    # algorithm's best trial learns (docs/tuning.md, "The quick protocol"), the same trials as tune's
    jobs = expand(["experiment=tune_quick"], multirun=True)
    assert len(jobs) == 9 * 6 * 2 and {dict(o.split("=", 1) for o in j)["seed"] for j in jobs} == {"10", "11"}
    cfg, _ = check_job(jobs[0])
    assert cfg.data.name == "digits" and cfg.workers == 4
    assert cfg.epochs * (1500 // cfg.batch_size) >= 92 and cfg.budget.worker_steps is None


@pytest.mark.slow
def test_the_plan_of_a_tuning_sweep_estimates_its_held_out_stage_too(monkeypatch):
    from experiments import plan

    monkeypatch.setattr(plan, "CALIBRATION_S", 0.05)  # a few timed calls: the numbers are not what is tested
    base = ["data=digits", "epochs=1", "workers=2"]
    jobs = [
        [f"algorithm={a}", f"lr={lr}", f"seed={seed}", *base]
        for a in ("gem", "downpour")
        for lr in (0.05, 0.2)
        for seed in (10, 11)
    ]
    lines = []
    total = plan.show([(j, check_job(j)[1]) for j in jobs], out=lines.append, heldout_seeds=[0, 1, 2])
    assert lines[0].startswith("gem: plan for 8 jobs")
    held = next(line for line in lines if line.startswith("then the held-out stage"))
    # per algorithm and n, two settings at most on three seeds, each at the cost of its costliest trial
    assert "at most 12 jobs" in held and "on seeds 0,1,2" in held and "the whole protocol about" in held
    one = plan.show([(j, check_job(j)[1]) for j in jobs], out=lambda _: None)
    assert total > one


def test_a_sweep_declares_its_held_out_seeds_in_its_sweeper_config():
    from omegaconf import OmegaConf

    from experiments.command import heldout_seeds

    def of(value):
        return heldout_seeds(OmegaConf.create({"hydra": {"sweeper": {"heldout_seeds": value}}}))

    assert of("0,1,2") == [0, 1, 2] and of(7) == [7] and of(None) is None
    with pytest.raises(ConfigError, match="hydra.sweeper.heldout_seeds=a,b is not allowed; it must be seeds"):
        of("a,b")
    from experiments.schema import CONF_DIR

    assert OmegaConf.load(CONF_DIR / "experiment" / "tune.yaml").hydra.sweeper.heldout_seeds == "0,1,2"


def test_held_out_seeds_the_user_did_not_type_are_not_named_as_their_flag(tmp_path, capsys):
    """A sweep whose runs used seed 0, tuned without --seeds, was refused with "--seeds=0,1,2 is not allowed",
    a flag the command did not have. Now the default held-out seeds are fresh ones, said with where they came from;
    seeds the sweep declares that collide are refused, naming the sweep's key, not a flag. And a sweep with nothing
    to choose between (it crashed with KeyError: 'lr') gives the paper's setting alone."""
    sweep = tmp_path / "sweep"
    for job, seed in enumerate((0, 1)):
        _run(sweep / str(job), "gem", 4, seed, 0.05)
    assert tune.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "on seeds 2,3,4 (the 3 smallest seeds the tuning sweep did not use" in out and "--seeds=0,1,2" not in out
    node = yaml.safe_load((sweep / "heldout" / "experiment" / "tune_quick_heldout.yaml").read_text())
    assert node["hydra"]["sweeper"]["grids"] == [{"algorithm": "gem", "workers": "4", "lr": 0.05}]
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"sweeper": {"heldout_seeds": "1,7"}}}))
    assert tune.main([str(sweep), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "hydra.sweeper.heldout_seeds" in err and "--seeds=" not in err.split(";")[0]


def test_a_held_out_sweep_on_tuning_seeds_names_them(tmp_path, capsys):
    """`--heldout` a sweep that shares seeds with the tuning sweep said `<folder> has runs on tuning seeds`: which
    seeds, and what to pass instead, are now in the line."""
    sweep = _tuning_sweep(tmp_path / "sweep")
    held = tmp_path / "held"
    for job, seed in enumerate((11, 12)):
        _run(held / str(job), "gem", 4, seed, 0.05, kappa=1)
    assert tune.main([str(sweep), "--heldout", str(held)]) == 2
    assert capsys.readouterr().err == (
        f"error: --heldout {held} has runs on seed 11, which the tuning sweep {sweep} used: the held-out stage must "
        f"run on new seeds; pass the sweep of the held-out experiment that analysis.tune {sweep} wrote\n"
    )
