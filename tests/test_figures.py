"""Experiments, plots, paper figures and the baselines report.

Every experiment composes and expands to valid jobs; the plotting helpers compute what they claim on frames made
by hand; every figure type and the report are drawn from a small sweep run here; one `_quick` experiment runs end
to end through `python run.py -m` and `python -m paper_figures`.
"""

import base64
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import warm_run
from omegaconf import OmegaConf

from analysis import from_wandb, load, plots, report, target
from experiments.command import preflight
from experiments.config import CONF_DIR, ConfigError, check_job, compose, expand, options
from experiments.runner import run
from paper_figures import __main__ as cli
from paper_figures.figures import FIGURES, NoRuns

# the tests that share this module's costly fixtures (runs): under pytest-xdist they run in one process
SHARED = pytest.mark.xdist_group("figures")


PAPER = "paper (read off Fig. 3)"

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = options("experiment")


# ------------------------------------------------------------------------------------------ experiments


def test_every_figure_has_a_full_and_a_quick_experiment():
    # a *_heldout experiment is written by analysis.tune from a tuning sweep: its quick twin is what the quick
    # tuning sweep's choice writes, not a file of its own
    full = [e for e in EXPERIMENTS if not e.endswith(("_quick", "_heldout"))]
    assert set(full) >= {"fig1", "fig2", "fig3", "fig4", "fig5", "fig6", "fig7", "fig8", "fig9_10", "baselines"}
    for e in full:
        assert f"{e}_quick" in EXPERIMENTS, f"{e} has no {e}_quick"
    for e in EXPERIMENTS:
        assert (CONF_DIR / "experiment" / f"{e}.yaml").read_text().startswith("# @package _global_\n"), e


# the tuning and baselines sweeps (135-324 jobs) take 4-8 s each to validate: in the whole suite, not the fast tier
@pytest.mark.parametrize(
    "name", [pytest.param(e, marks=pytest.mark.slow) if e.startswith(("tune", "baselines")) else e for e in EXPERIMENTS]
)
def test_experiment_composes_and_every_job_is_valid(name, monkeypatch):
    from gem.engines import memory

    monkeypatch.setattr(memory, "available", lambda: 2**50)  # fig2's 100 processes need a bigger machine than CI
    jobs = expand([f"experiment={name}"], multirun=True)
    assert len(jobs) >= 1
    checked_jobs, bases = set(), {}  # bases: each group choice's config, composed once, as a sweep's check does
    for job in jobs:
        key = tuple(o for o in job if not o.startswith(("seed=", "lr=")))
        # differs from a job already checked only in its seed or its η (> 0 in every grid): valid alike (0.1 s a job)
        if key in checked_jobs:
            continue
        checked_jobs.add(key)
        cfg, checked = check_job(job, bases)  # raises ConfigError on any bad value
        assert cfg.batch_size >= 1 and cfg.epochs >= 1
    if name.endswith("_quick"):  # quick runs need nothing that cannot be had offline here
        assert checked.data.name in ("digits", "synthetic") or "shared" in checked.data.root


def _jobs(name, *extra):
    bases: dict = {}  # as a sweep's check composes them: each group choice once
    return [check_job(j, bases)[0] for j in expand([f"experiment={name}", *extra], multirun=True)]


@pytest.mark.slow  # validates the 36 jobs of fig1: 5 s
def test_fig1_sweeps_three_algorithms_four_n_three_seeds_on_mnist():
    cfgs = _jobs("fig1")
    assert len(cfgs) == 36
    assert {(c.algorithm.name, c.workers, c.seed) for c in cfgs} == {
        (a, n, s) for a in ("gem", "downpour", "adaptive") for n in (5, 10, 20, 30) for s in (0, 1, 2)
    }
    c = cfgs[0]
    assert (c.engine.name, c.data.name, c.model._target_, c.lr, c.momentum, c.batch_size, c.epochs) == (
        "sim",
        "mnist",
        "gem.models.MnistCNN",
        0.05,
        0.9,
        64,
        1,
    )


def _first(name, *extra):
    """The first job of an experiment's sweep, composed (the sweep's parameters do not touch the engine)."""
    return check_job(expand([f"experiment={name}", *extra], multirun=True)[0])[0]


@pytest.mark.parametrize("name", ["fig1", "fig3", "fig6", "fig8", "fig1_quick", "fig8_quick"])
def test_the_paper_figures_run_under_gamma_staleness_and_round_robin_is_one_override_away(name):
    c = _first(name)
    assert (c.engine.name, c.engine.staleness, c.engine.cycle_cv) == ("sim", "gamma", 0.25)
    assert _first(name, "engine.staleness=round_robin").engine.staleness == "round_robin"


def test_fig3_cv_sweeps_the_spread_at_four_n():
    c = _first("fig3_cv")
    assert (c.algorithm.name, c.engine.staleness) == ("gem", "gamma")
    jobs = [dict(o.split("=", 1) for o in j) for j in expand(["experiment=fig3_cv"], multirun=True)]
    assert {(float(j["engine.cycle_cv"]), int(j["workers"]), int(j["seed"])) for j in jobs} == {
        (cv, n, s) for cv in (0, 0.25, 0.5, 1) for n in (5, 10, 20, 30) for s in (0, 1, 2)
    }
    assert {j["algorithm"] for j in jobs} == {"gem"}


def test_fig7_uses_algorithm_1s_default_learning_rate():
    assert _first("fig7").lr == 0.01  # §4.3: "set to their default values, as specified in Algorithm 1"


def test_fig4_keeps_the_effective_batch_and_the_data_fixed():
    cfgs = _jobs("fig4")
    assert {c.engine.name for c in cfgs} == {"process"}
    assert {(c.workers, c.batch_size, c.epochs) for c in cfgs} == {
        (1, 256, 16),
        (2, 128, 8),
        (4, 64, 4),
        (8, 32, 2),
        (16, 16, 1),
    }


def test_fig5_gives_sgd_the_same_data_as_the_gem_workers_together():
    by_alg = {c.algorithm.name: c for c in _jobs("fig5")}
    assert by_alg["gem"].workers * by_alg["gem"].epochs == by_alg["sgd"].epochs == 20


def test_per_worker_refuses_a_split_that_is_not_even():
    with pytest.raises(ConfigError, match=r"per_worker:256 does not split evenly over workers=3"):
        check_job(["experiment=fig4", "workers=3"])


def test_a_command_line_value_overrides_the_experiment():
    cfgs = _jobs("fig8_quick", "seed=5", "epochs=1")
    assert {c.seed for c in cfgs} == {5} and {c.epochs for c in cfgs} == {1}
    assert sorted(c.algorithm.kappa for c in cfgs) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------ plots by hand


def _frame(**cols):
    return pd.DataFrame(cols)


def test_aggregate_averages_each_run_per_step_then_takes_mean_min_max_over_runs():
    # run a: two workers at steps 1, 2; run b: one value per step. Per-run means: a = (1.5, 3.5), b = (3, 5).
    f = _frame(
        run_dir=["a"] * 4 + ["b"] * 2,
        workers=[2] * 6,
        worker_step=[1, 1, 2, 2, 1, 2],
        loss=[1.0, 2.0, 3.0, 4.0, 3.0, 5.0],
    )
    agg = plots.aggregate(f, "worker_step", "loss", "workers").set_index("worker_step")
    assert agg.loc[1.0, "mean"] == pytest.approx(2.25) and agg.loc[2.0, "mean"] == pytest.approx(4.25)
    assert (agg.loc[1.0, "lo"], agg.loc[1.0, "hi"]) == (1.5, 3.0)
    assert agg["runs"].tolist() == [2, 2]


def test_a_diverged_run_only_contributes_its_finite_points():
    f = _frame(run_dir=["a", "a", "b", "b"], workers=[1] * 4, worker_step=[1, 2, 1, 2], loss=[1.0, np.inf, 3.0, 2.0])
    agg = plots.aggregate(f, "worker_step", "loss", "workers").set_index("worker_step")
    assert agg.loc[2.0, "mean"] == 2.0 and agg.loc[2.0, "runs"] == 1


def test_time_to_target_is_the_first_bin_at_or_below_it():
    f = _frame(
        run_dir=["a"] * 4 + ["b"] * 4,
        worker_step=[1, 2, 3, 4] * 2,
        time_s=[0.1, 0.2, 0.3, 0.4] * 2,
        loss=[2.0, 0.9, 0.4, 0.3, 2.0, 1.5, 1.2, 1.1],
    )
    hit = plots.time_to_target(f, 0.5, window=1).set_index("run_dir")
    assert hit.loc["a", "worker_step"] == 3 and hit.loc["a", "time_s"] == pytest.approx(0.3)
    assert np.isnan(hit.loc["b", "worker_step"])
    lucky = _frame(
        run_dir=["c"] * 6, worker_step=range(1, 7), time_s=range(1, 7), loss=[2.0, 0.4, 2.0, 2.0, 0.4, 0.3]
    )  # one lucky batch at step 2 is not arriving
    assert plots.time_to_target(lucky, 0.5, window=1)["worker_step"].iloc[0] == 2
    assert plots.time_to_target(lucky, 0.5, window=3)["worker_step"].iloc[0] == 6
    windowed = _frame(
        run_dir=["d"] * 4, worker_step=[4, 8, 12, 16], time_s=[1.0, 2.0, 3.0, 4.0], loss=[2.0, 2.0, 0.1, 0.1]
    )  # AGN/EASGD commit every 4 local steps: bins in between are empty
    hit = plots.time_to_target(windowed, 0.5, window=1).iloc[0]
    assert (hit["worker_step"], hit["time_s"]) == (12, 3.0)


def test_heatmap_is_tensors_by_binned_updates():
    f = _frame(
        step=[1, 1, 2, 2, 3, 3],
        tensor=["w", "b"] * 3,
        tensor_index=[0, 1] * 3,
        pi_median=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    )
    fig, ax = plots.plt.subplots()
    image = plots.pi_heatmap(f, ax, bins=3)
    assert np.asarray(image.get_array()).tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["w", "b"]
    assert image.norm.vmax == 5.0  # no scale given: 0 to the largest cell
    image = plots.pi_heatmap(f, ax, bins=3, quantile=0.5)
    assert image.norm.vmax == pytest.approx(2.5)  # the median of the six cells drawn


def _statuses_frame():
    """n = 2: runs a and b completed, c failed, d killed (incomplete); n = 4: one incomplete run only."""
    rows = []
    for run_dir, status, n, losses in (
        ("a", "completed", 2, [2.0, 1.0, 0.5, 0.4]),
        ("b", "completed", 2, [2.0, 1.4, 0.7, 0.6]),
        ("c", "failed", 2, [2.0, 9.0]),
        ("d", "incomplete", 2, [2.0, 1.8, 1.7]),
        ("e", "incomplete", 4, [2.0, 1.9]),
    ):
        rows += [
            {"run_dir": run_dir, "status": status, "workers": n, "worker_step": i + 1, "loss": v}
            for i, v in enumerate(losses)
        ]
    return pd.DataFrame(rows)


def test_failed_and_incomplete_runs_are_drawn_dotted_on_their_own_not_averaged():
    f = _statuses_frame()
    agg = plots.aggregate(f, "worker_step", "loss", "workers").set_index("worker_step")
    assert set(agg["workers"]) == {2} and agg["seeds"].tolist() == [2] * 4  # n = 4 has no completed run
    assert agg["mean"].tolist() == pytest.approx([2.0, 1.2, 0.6, 0.5])  # a and b only: not c's 9, not d
    fig, ax = plots.plt.subplots()
    plots.curves(f, ax, x="worker_step", y="loss", hue="workers", log=False)
    solid = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
    assert [ln.get_label() for ln in solid] == ["n = 2 (2 seeds)"] and solid[0].get_ydata().tolist() == pytest.approx(
        [2.0, 1.2, 0.6, 0.5]
    )
    dotted = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":"]
    assert sorted(len(ln.get_xdata()) for ln in dotted) == [2, 2, 3]  # c, e and d, each up to its last point
    ends = {
        ln.get_marker(): (ln.get_xdata()[0], ln.get_ydata()[0]) for ln in ax.get_lines() if ln.get_linestyle() == "None"
    }
    assert ends["s"] == (2, 9.0) and ends["o"] in ((3, 1.7), (2, 1.9))  # failed: a square; killed: an open circle
    # n = 4 has no completed run: its incomplete run gets the legend entry; n = 2's others do not
    assert [ln.get_label() for ln in dotted if not ln.get_label().startswith("_")] == ["n = 4 (incomplete)"]
    fig, ax = plots.plt.subplots()
    plots.curves(f[f["workers"] == 4], ax, x="worker_step", y="loss", hue="workers")
    assert [t.get_text() for t in ax.texts] == ["no completed run"]  # a panel of unfinished runs says so
    plots.plt.close("all")


def test_band_ci_is_the_t_interval_over_the_runs_and_minmax_their_range():
    # three runs at steps 1 and 2: at step 2 the losses 1, 2, 3 (mean 2); t(0.975, 2) = 4.302653, on the log scale
    # (a loss's interval stays above 0: analysis.stats), mapped back
    f = _frame(
        run_dir=["a", "b", "c"] * 2, workers=2, worker_step=[1] * 3 + [2] * 3, loss=[4.0, 4.0, 4.0, 1.0, 2.0, 3.0]
    )
    agg = plots.aggregate(f, "worker_step", "loss", "workers").set_index("worker_step")
    z = np.log([1.0, 2.0, 3.0])
    h = 4.302653 * z.std(ddof=1) / np.sqrt(3)
    lo_ci, hi_ci = np.exp(z.mean() - h), np.exp(z.mean() + h)
    assert (agg.loc[2.0, "ci_lo"], agg.loc[2.0, "ci_hi"]) == (pytest.approx(lo_ci), pytest.approx(hi_ci))
    assert 0 < lo_ci < 1
    assert (agg.loc[2.0, "lo"], agg.loc[2.0, "hi"]) == (1.0, 3.0)
    assert (agg.loc[1.0, "ci_lo"], agg.loc[1.0, "ci_hi"]) == (4.0, 4.0)  # no spread: no width
    for band, top in (("ci", hi_ci), ("minmax", 3.0), (True, 3.0)):
        fig, ax = plots.plt.subplots()
        plots.curves(f, ax, x="worker_step", y="loss", hue="workers", log=False, band=band)
        (poly,) = ax.collections
        assert poly.get_paths()[0].vertices[:, 1].max() == pytest.approx(max(top, 4.0))
        assert poly.get_paths()[0].vertices[:, 1].min() == pytest.approx(lo_ci if band == "ci" else 1.0)
    for band in (None, False):
        fig, ax = plots.plt.subplots()
        plots.curves(f, ax, x="worker_step", y="loss", hue="workers", band=band)
        assert not ax.collections
    with pytest.raises(ValueError, match="band must be 'minmax', 'ci' or None, not 'sd'"):
        plots.curves(f, ax, band="sd")
    # the final losses: three seeds, error bars over the same interval, the label says how many
    runs = _frame(
        algorithm="gem", workers=2, status=["completed"] * 3 + ["failed"], final_train_loss=[1.0, 2.0, 3.0, 50.0]
    )
    fig, ax = plots.plt.subplots()
    agg = plots.final_loss(runs, ax, band="ci")
    assert agg[["mean", "count"]].values.tolist() == [[2.0, 3]] and agg["hi"].iloc[0] == pytest.approx(hi_ci)
    assert ax.get_legend_handles_labels()[1] == ["gem (3 seeds)"]
    plots.plt.close("all")


def test_helpers_work_without_a_status_column_and_name_a_missing_column_in_one_line():
    f = _statuses_frame().drop(columns="status")  # every run counts as completed
    fig, ax = plots.plt.subplots()
    agg = plots.curves(f, ax, x="worker_step", y="loss", hue="workers")
    assert set(agg["workers"]) == {2, 4} and agg.loc[agg["workers"] == 2, "seeds"].iloc[0] == 4
    done = plots.final_loss(_frame(algorithm="gem", workers=2, final_train_loss=[1.0, 2.0]), ax)
    assert done["count"].tolist() == [2]
    assert len(plots.speedup(f.assign(time_s=f["worker_step"] * 1.0), 1.5, by="workers", base=2, window=1)) == 2
    ev = _frame(run_dir=["a", "a"], workers=2, step=[0, 25], val_loss=[2.3, 1.0])  # an old sweep's evaluations
    have = "it has: run_dir, workers, step, val_loss"
    calls = {
        "curves": lambda: plots.curves(ev, ax, x="worker_step", y="val_loss"),
        "aggregate": lambda: plots.aggregate(ev, "worker_step", "val_loss", "workers"),
        "time_to_target": lambda: plots.time_to_target(ev, 1.5, x="worker_step", y="val_loss"),
        "speedup": lambda: plots.speedup(ev, 1.5, x="worker_step"),
        "final_loss": lambda: plots.final_loss(ev, ax, x="worker_step"),
        "pi_heatmap": lambda: plots.pi_heatmap(ev, ax),
    }
    for who, call in calls.items():
        with pytest.raises(ValueError) as e:
            call()
        text = str(e.value)
        assert "\n" not in text and text.startswith(f"plots.{who}: the frame has no column '") and text.endswith(have)
    with pytest.raises(ValueError, match=r"^plots.curves: the frame has no column 'worker_step'; " + have):
        plots.curves(ev, ax, x="worker_step", y="val_loss")
    with pytest.raises(ValueError, match=r"^plots.curves: the frame has no column 'seed'"):
        plots.curves(ev, ax, x="step", y="val_loss", hue="seed")
    plots.plt.close("all")


def test_a_narrow_log_range_has_plain_tick_labels():
    # the loss from 0.6 down to 0.25: less than a decade, where matplotlib labels minor ticks as 3×10⁻¹
    f = _frame(run_dir="a", workers=2, worker_step=range(1, 11), loss=np.linspace(0.6, 0.25, 10))
    fig, (ax, ax_final) = plots.plt.subplots(1, 2)
    plots.curves(f, ax, x="worker_step", y="loss", hue="workers")
    plots.final_loss(_frame(algorithm="gem", workers=[2, 4], final_train_loss=[0.31, 0.52]), ax_final)
    fig.canvas.draw()
    for a in (ax, ax_final):
        labels = [t.get_text() for minor in (False, True) for t in a.get_yticklabels(minor=minor) if t.get_text()]
        assert labels and not [t for t in labels if "times" in t or "×" in t or "^" in t], labels
        assert {"0.3", "0.4"} <= set(labels)
    plots.plt.close("all")


# ------------------------------------------------------------------------------------------ a small sweep

COMMON = ["engine=sim", "epochs=1", "logger.wandb.mode=disabled", "logger.eval_every=25", "batch_size=32"]
# runs 0-3: GEM at n = 1, 2 with two seeds; then one run each of downpour, adaptive, sgd, and a downpour that
# diverges (lr = 1e6); then, apart, GEM at n = 2 with κ = 2 (mixing it in must be refused: it is not a seed)
JOBS = [["algorithm=gem", f"workers={n}", f"seed={s}"] for n in (1, 2) for s in (0, 1)] + [
    ["algorithm=downpour", "workers=2"],
    ["algorithm=adaptive", "workers=2"],
    ["algorithm=sgd", "workers=2"],
    ["algorithm=downpour", "workers=3", "lr=1e6"],
]
KAPPA = ["algorithm=gem", "workers=2", "algorithm.kappa=2"]


def _run(d, overrides):
    # round robin unless a run asks for a staleness model (the small sweep's runs were written for it)
    rr = [] if any(o.startswith("engine.staleness=") for o in overrides) else ["engine.staleness=round_robin"]
    cfg = compose(overrides + COMMON + rr)
    (d / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, d / ".hydra" / "config.yaml")  # unresolved, as Hydra saves it
    run(cfg, d, experiment="test")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    for i, overrides in enumerate(JOBS):
        _run(root / str(i), overrides)
    return root


@pytest.fixture(scope="module")
def kappa_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("kappa") / "0"
    _run(d, KAPPA)
    return d


@pytest.fixture(scope="module")
def gamma_runs(tmp_path_factory):
    """GEM at n = 2 and 3 under gamma staleness with two CVs: what fig3_cv draws."""
    root = tmp_path_factory.mktemp("gamma")
    for i, (n, cv) in enumerate((n, cv) for n in (2, 3) for cv in (0.0, 0.5)):
        _run(root / str(i), ["algorithm=gem", f"workers={n}", "engine.staleness=gamma", f"engine.cycle_cv={cv}"])
    return root


@pytest.fixture(scope="module")
def dylu_runs(tmp_path_factory):
    """async_localsgd with fixed windows and with DyLU, under sim's stragglers: what the dylu figure draws."""
    root = tmp_path_factory.mktemp("dylu")
    for i, dynamic in enumerate(("false", "true")):
        _run(
            root / str(i),
            [
                "algorithm=async_localsgd",
                "algorithm.window=4",
                f"algorithm.dynamic_window={dynamic}",
                "workers=4",
                "engine.staleness=stragglers",
            ],
        )
    return root


def _as_engine(run_dir, engine):
    """Rewrite a copied run as if it had run on `engine` (its summary and its config say so)."""
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "engine": engine}))
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cfg.engine.name = engine
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")


@pytest.fixture(scope="module")
def process_runs(sweep, tmp_path_factory):
    """The sweep's GEM runs (n = 1, 2, two seeds) relabelled engine=process: what the wall-clock figures draw.
    Their seconds are the simulator's, but the figures only read them."""
    import shutil

    root = tmp_path_factory.mktemp("process")
    for i in range(4):
        shutil.copytree(sweep / str(i), root / str(i))
        _as_engine(root / str(i), "process")
    return root


@pytest.mark.slow
@SHARED
def test_the_sweep_has_what_the_figures_need(sweep):
    r = load.runs(sweep)
    assert len(r) == len(JOBS) and set(r["experiment"]) == {"test"}
    assert r["status"].value_counts().to_dict() == {"completed": len(JOBS) - 1, "diverged": 1}


@pytest.mark.slow
@pytest.mark.parametrize("fig_id", sorted(FIGURES))
@SHARED
def test_every_figure_draws_from_a_small_sweep(sweep, kappa_run, gamma_runs, process_runs, dylu_runs, tmp_path, fig_id):
    if fig_id in ("fig9", "fig10"):  # n = 8 and n = 16: not in this sweep
        # it said "the requested number of workers", which no option of the command requests
        n = 8 if fig_id == "fig9" else 16
        with pytest.raises(NoRuns, match=rf"needs GEM runs with workers={n}, and these have workers=1, 2; fig9_10"):
            FIGURES[fig_id](sweep)
        return
    # fig8 compares κ at one n: GEM at n = 2, seeds 0 and 1 (κ = 1), and the κ = 2 run
    paths = [sweep / "2", sweep / "3", kappa_run] if fig_id == "fig8" else sweep
    if fig_id in ("fig2", "fig4"):  # wall-clock seconds: the sim engine's are refused
        with pytest.raises(NoRuns, match="engine=sim, whose time_s is the simulator's clock"):
            FIGURES[fig_id](sweep)
        paths = process_runs
    if fig_id == "fig3_cv":  # a CV is a setting of gamma runs only: round robin's are refused
        with pytest.raises(NoRuns, match="some of these runs have engine.staleness=round_robin"):
            FIGURES[fig_id](sweep)
        paths = gamma_runs
    if fig_id == "dylu":  # async_localsgd under stragglers, fixed windows and DyLU: not in this sweep
        with pytest.raises(NoRuns, match="dylu needs the runs of a dylu sweep"):
            FIGURES[fig_id](sweep)
        paths = dylu_runs
    fig = FIGURES[fig_id](paths)
    # data only: not the reference lines and the paper's markers, which are drawn whatever the runs hold
    data = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_linestyle() != ":" and ln.get_label() != PAPER]
    assert len(data) + sum(len(ax.get_images()) for ax in fig.axes) >= 2, f"{fig_id} drew almost nothing"
    assert fig.get_size_inches()[0] <= 11  # two panels to a row at most: 1,650 px at 150 dpi
    assert "lines: mean over the completed seeds" in fig._suptitle.get_text() or fig_id.startswith(("fig9", "fig3_"))
    if fig_id == "dylu":  # whether either variant trains depends on η_o: the title names it, and the stragglers
        assert "(η_o 0.7), with stragglers" in fig._suptitle.get_text()
    paths = plots.save(fig, tmp_path, fig_id)
    assert [p.name for p in paths] == [f"{fig_id}.png", f"{fig_id}.pdf"]
    assert all(p.stat().st_size > 5000 for p in paths)


@pytest.mark.slow
@SHARED
def test_a_figure_refuses_to_average_runs_that_differ_in_more_than_the_seed(sweep, kappa_run):
    with pytest.raises(
        NoRuns,
        match=r"fig1 averages the runs with the same algorithm, workers over seeds, but "
        r"these runs also differ in algorithm.kappa = 1.0/2",
    ):
        FIGURES["fig1"]([sweep, kappa_run])
    with pytest.raises(NoRuns, match="differ in workers = 1/2"):  # κ curves at two n
        FIGURES["fig8"]([sweep / "0", sweep / "2", kappa_run])


@pytest.mark.slow
@SHARED
def test_fig1_draws_one_line_per_n_and_marks_the_diverged_run(sweep):
    fig = FIGURES["fig1"](sweep)
    gem_ax, downpour_ax = fig.axes[0], fig.axes[1]
    assert [t.get_text() for t in gem_ax.get_legend().get_texts()] == ["n = 1 (2 seeds)", "n = 2 (2 seeds)"]
    crosses = [ln for ln in downpour_ax.get_lines() if ln.get_marker() == "x"]
    assert len(crosses) == 1  # the lr = 1e6 run, drawn on its own (dashed), not averaged in
    dashed = [ln for ln in downpour_ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 1 and dashed[0].get_label() == "n = 3 (diverged)"
    solid = [ln for ln in downpour_ax.get_lines() if ln.get_linestyle() == "-"]
    assert len(solid) == 1 and max(solid[0].get_ydata()) < 10  # n = 2's mean; n = 3 has no completed run
    top = downpour_ax.get_ylim()[1]  # its loss of 1e26 is off the scale: the axis stops at 10x the start
    assert 2.3 < top <= 10 * 2.5 and crosses[0].get_ydata()[0] == pytest.approx(top)
    assert gem_ax.get_ylim() == downpour_ax.get_ylim()
    assert gem_ax.get_yscale() == "log"


@pytest.fixture
def interrupted(sweep, tmp_path):
    """The sweep as a killed one leaves it: no adaptive run yet; GEM n = 1 seed 0 killed (no summary, half its
    rows), seed 1 failed, so n = 1 has no completed run; the completed DOWNPOUR run failed, leaving that panel
    only unfinished runs; and a GEM run killed before its first row (its config only)."""
    import json
    import shutil

    root = tmp_path / "interrupted"
    for i in (0, 1, 2, 3, 4, 7):  # not 5 (adaptive) nor 6 (sgd, not in fig1)
        shutil.copytree(sweep / str(i), root / str(i))
    (root / "0" / "summary.json").unlink()
    rows = pd.read_parquet(root / "0" / "metrics.parquet")
    rows[rows["worker_step"] <= rows["worker_step"].max() / 2].to_parquet(root / "0" / "metrics.parquet")
    for i in ("1", "4"):
        summary = json.loads((root / i / "summary.json").read_text())
        (root / i / "summary.json").write_text(json.dumps({**summary, "status": "failed", "reason": "test"}))
    shutil.copytree(sweep / "2" / ".hydra", root / "8" / ".hydra")
    config = root / "8" / ".hydra" / "config.yaml"  # a seed of its own: the same seed twice is refused
    config.write_text(re.sub(r"(?m)^seed: \d+$", "seed: 7", config.read_text()))
    return root


@pytest.mark.slow
@SHARED
def test_fig1_on_an_interrupted_sweep_draws_unfinished_runs_apart_and_names_the_empty_panels(interrupted):
    fig = FIGURES["fig1"](interrupted)
    gem_ax, downpour_ax, adaptive_ax, final_ax = fig.axes
    title = fig._suptitle.get_text().replace("\n", " ")  # lines are wrapped to the width
    assert (
        "left out of the means: 2 incomplete, 2 failed (drawn dotted; 1 without a row yet, not drawn); "
        "1 diverged (drawn dashed, ×)"
    ) in title
    assert "band: min–max over seeds" in title
    assert "not drawn, no rows: downpour at n = 1" in title  # DOWNPOUR was run at n = 2 and 3 only
    assert [t.get_text() for t in adaptive_ax.texts] == ["no adaptive runs in these folders"]
    assert not adaptive_ax.has_data()
    assert [t.get_text() for t in downpour_ax.texts] == ["no completed run"]
    # GEM: n = 2's mean over its two seeds; n = 1's two runs drawn dotted, one legend entry for both
    assert [t.get_text() for t in gem_ax.get_legend().get_texts()] == [
        "n = 2 (2 seeds)",
        "n = 1 (1 incomplete, 1 failed)",
    ]
    assert len([ln for ln in gem_ax.get_lines() if ln.get_linestyle() == ":"]) == 2
    assert sorted(ln.get_marker() for ln in gem_ax.get_lines() if ln.get_linestyle() == "None") == ["o", "s"]
    assert final_ax.get_legend_handles_labels()[1] == ["gem (2 seeds)"]  # n = 2 only: n = 1 has no completed run
    fig = FIGURES["fig1"](interrupted, band="ci")
    assert "band: 95% t interval of the mean over seeds" in fig._suptitle.get_text().replace("\n", " ")
    plots.plt.close("all")


@pytest.mark.slow
@SHARED
def test_the_terminal_says_what_a_figure_left_out(interrupted, tmp_path, capsys):
    """The figure's title counts its runs by status; the command's output now says the same (it printed only the
    figure's paths)."""
    from paper_figures.__main__ import main

    assert main(["fig1", str(interrupted), "--out", str(tmp_path / "figures")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "7 runs: 2 completed, 1 diverged, 2 failed, 2 incomplete; means and final losses are over the 2 completed"
    )
    plots.plt.close("all")


@pytest.mark.slow
@SHARED
def test_fig2_and_fig4_refuse_sim_runs_in_one_line(sweep, process_runs, tmp_path, capsys):
    for fig_id in ("fig2", "fig4"):
        assert cli.main([fig_id, str(sweep), "--out", str(tmp_path)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {fig_id} plots wall-clock seconds, but these runs ran on engine=sim, whose time_s is the "
            "simulator's clock, not wall-clock; pass runs of engine=process or engine=distributed"
        )
    assert cli.main(["fig4", str(process_runs), "--out", str(tmp_path), "--band", "ci"]) == 0
    assert (tmp_path / "fig4.png").stat().st_size > 5000


def test_fig4_keeps_its_k_of_n_labels_inside_the_panel():
    from paper_figures.figures import speedup_panel

    sp = pd.DataFrame(
        {"workers": [1, 2, 4, 8], "speedup": [1.0, 1.9, np.nan, 7.9], "reached": [2, 2, 1, 2], "runs": [2, 2, 2, 2]}
    )  # the last point sits in the top right corner of the data
    fig, ax = plots.plt.subplots(figsize=(5.4, 4.3))
    speedup_panel(ax, sp)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    labels = [t for t in ax.texts if "/" in t.get_text()]
    assert [t.get_text() for t in labels] == ["2/2", "2/2", "1/2: no speedup", "2/2"]
    for t in labels:
        b = t.get_window_extent(renderer)
        assert box.x0 <= b.x0 and b.x1 <= box.x1 and box.y0 <= b.y0 and b.y1 <= box.y1, t.get_text()
    plots.plt.close("all")


@pytest.mark.slow
@SHARED
def test_heatmaps_give_each_panel_its_own_colour_scale(sweep):
    fig = FIGURES["fig9_10"](sweep)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 2  # n = 1 and 2, one above the other
    for im in images:
        cells = np.asarray(im.get_array(), dtype=float)
        cells = cells[np.isfinite(cells)]
        assert im.norm.vmax == pytest.approx(np.quantile(cells, 0.99)) and im.norm.vmin == 0
    assert "each panel its own colour bar" in fig._suptitle.get_text().replace("\n", " ")
    plots.plt.close("all")


@pytest.mark.slow
@SHARED
def test_report_has_a_row_per_algorithm_n_and_setting_and_embeds_its_figure(sweep, kappa_run, tmp_path):
    path = report.write([sweep, kappa_run], tmp_path / "r.html", given=2.0)
    text = path.read_text()
    png = re.search(r'src="data:image/png;base64,([^"]+)"', text)
    assert png and base64.b64decode(png.group(1))[:4] == b"\x89PNG"
    r = load.runs([sweep, kappa_run])
    ev = load.commits([sweep, kappa_run], table="eval", columns=["algorithm", "workers", "seed", "status", "engine"])
    tab = report.table(r, target.times(r, ev, 2.0))
    assert list(tab.columns[:3]) == ["algorithm", "kappa", "n"]  # κ varies among the GEM runs: its own column
    tab = tab.set_index(["algorithm", "kappa", "n"])
    gem = tab.xs("gem")
    assert gem.loc[(1.0, 2), "runs"] == 2 and gem.loc[(2.0, 2), "runs"] == 1 and gem.loc[(1.0, 1), "runs"] == 2
    down = tab.xs("downpour").droplevel(0)
    assert down.loc[2, "status"] == "1 completed" and down.loc[3, "status"] == "1 diverged"
    assert down.loc[3, "final train loss"] == "n/a"  # a diverged run has no final loss to average
    assert re.fullmatch(r"\d+ \(2/2\)", gem.loc[(1.0, 2), "worker steps to target"])  # both seeds get below 2
    assert re.fullmatch(r"\d+\.\d sim time \(2/2\)", gem.loc[(1.0, 2), "time to target"])  # sim: simulated time
    assert down.loc[3, "worker steps to target"] == "never (0/1)"
    for algo in ("gem", "downpour", "adaptive", "sgd"):
        assert f"<td>{algo}</td>" in text
    assert "<h2>Runs left out of the means</h2>" in text and "<td>diverged</td>" in text  # the lr = 1e6 run


@pytest.mark.slow
@SHARED
def test_markdown_report_links_its_png(sweep, tmp_path):
    path = report.write(sweep, tmp_path / "r.md", given=0.5)
    assert "| algorithm" in path.read_text() and "![validation loss curves](r.png)" in path.read_text()
    assert (tmp_path / "r.png").stat().st_size > 5000


def test_a_killed_run_reads_with_its_interpolations_resolved(tmp_path):
    d = tmp_path / "killed"  # Hydra's unresolved config and no summary: what a SIGKILL leaves behind
    (d / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose(["experiment=fig4_quick", "workers=2"]), d / ".hydra" / "config.yaml")
    assert "${per_worker:256}" in (d / ".hydra" / "config.yaml").read_text()
    r = load.runs(tmp_path).iloc[0]
    assert (r["status"], r["batch_size"], r["epochs"], r["workers"]) == ("incomplete", 128, 8, 2)
    assert report.main([str(tmp_path), "--out", str(tmp_path / "r.md")]) == 0  # no rows, but a report
    assert "1 of 1 runs is not completed (1 incomplete)" in (tmp_path / "r.md").read_text()


@pytest.mark.slow
@SHARED
def test_cli_errors_are_one_line(sweep, tmp_path, capsys):
    assert cli.main(["fig1", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such run or sweep directory" in err
    (tmp_path / "empty").mkdir()
    assert cli.main(["fig1", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip() == "error: fig1 needs the runs of a fig1 sweep (gem, downpour, adaptive × n)"
    assert cli.main(["fig2", str(sweep / "4"), str(sweep / "5")]) == 2  # downpour and adaptive: no GEM run
    assert capsys.readouterr().err.strip() == "error: fig2 needs GEM runs (a fig2 sweep)"
    assert report.main([str(tmp_path), "--out", str(tmp_path / "r.txt")]) == 2


def test_speedup_is_the_median_time_to_the_target_relative_to_one_worker():
    rows = []
    # n = 1 reaches 0.5 at 4 s in both seeds; n = 2 at 2 s and 3 s (median 2.5 s); n = 4: one seed never does
    for n, seed, at in [(1, 0, 4), (1, 1, 4), (2, 0, 2), (2, 1, 3), (4, 0, 1), (4, 1, None)]:
        for t in range(1, 9):
            rows.append(
                {
                    "run_dir": f"{n}-{seed}",
                    "workers": n,
                    "time_s": float(t),
                    "loss": 0.1 if at is not None and t >= at else 2.0,
                }
            )
    sp = plots.speedup(pd.DataFrame(rows), 0.5, window=1).set_index("workers")
    assert sp.loc[1, "speedup"] == pytest.approx(1.0)
    assert sp.loc[2, "time"] == pytest.approx(2.5, abs=0.05) and sp.loc[2, "speedup"] == pytest.approx(1.6, abs=0.05)
    assert (sp.loc[4, "reached"], sp.loc[4, "runs"]) == (1, 2) and np.isnan(sp.loc[4, "speedup"])


def test_epochs_of_data_count_examples_not_commits():
    from paper_figures.figures import data_epochs

    ev = pd.DataFrame(
        {"step": [0, 50, 100], "batch_size": 64, "train_examples": 6400, "workers": 10, "epochs": 2, "steps": 100}
    )
    assert data_epochs(ev).tolist() == [0.0, 0.5, 1.0]
    ev["algorithm.window"] = 4.0  # AGN/EASGD: a commit carries 4 local steps
    assert data_epochs(ev).tolist() == [0.0, 2.0, 4.0]


# ------------------------------------------------------------------------------------------ W&B


class _FakeRun:
    def __init__(self, i, status):
        self.path = ["me", "gem", f"run{i}"]
        self.state = "finished"
        self.config = {"algorithm": {"name": "gem", "kappa": 1.0}, "workers": 2, "seed": i, "logger": {"x": 1}}
        self.summary = {"status": status, "final_train_loss": 0.5 + i, "algorithm": "gem", "workers": 2}
        self._rows = [
            {"_step": 10, "train/loss": 2.0 - i, "train/worker_step": 5},
            {"_step": 20, "train/loss": 1.0, "train/worker_step": 10, "eval/val_loss": 1.5},
            {"_step": 25, "eval/val_loss": 1.2},
        ]

    def scan_history(self):
        return iter(self._rows)


class _FakeApi:
    def runs(self, path, filters=None):
        assert path == "me/gem"
        return [_FakeRun(0, "completed"), _FakeRun(1, "diverged")]


def test_wandb_loader_gives_the_local_columns():
    r = from_wandb.runs("me/gem", api=_FakeApi())
    assert r["run_dir"].tolist() == ["me/gem/run0", "me/gem/run1"]
    assert r["status"].tolist() == ["completed", "diverged"] and r["algorithm.kappa"].tolist() == [1.0, 1.0]
    assert "logger.x" not in r.columns
    m = from_wandb.commits("me/gem", api=_FakeApi())
    assert m[m.run_dir == "me/gem/run1"][["step", "loss", "worker_step"]].values.tolist() == [
        [10, 1.0, 5],
        [20, 1.0, 10],
    ]
    ev = from_wandb.commits("me/gem", "eval", api=_FakeApi(), columns=["seed"])
    assert ev[ev.run_dir == "me/gem/run0"][["step", "val_loss"]].values.tolist() == [[20, 1.5], [25, 1.2]]
    with pytest.raises(ValueError, match="table=tensors is not on W&B"):
        from_wandb.commits("me/gem", "tensors", api=_FakeApi())


def test_wandb_logger_holds_an_evaluation_until_the_commits_before_it_are_logged():
    from experiments.wandb_logger import WandbLogger

    class Run:
        logged = []

        def log(self, data, step):
            self.logged.append((step, sorted(data)))

        def finish(self, exit_code=0):
            pass

    w = WandbLogger(Run())
    w("eval", {"step": 0, "val_loss": 2.3})  # before any commit: waits
    w("commit", {"step": 10, "loss": 2.0})
    w("eval", {"step": 25, "val_loss": 1.0})  # the process engine's clock ran ahead of the recorded commits
    w("commit", {"step": 20, "loss": 1.5})  # W&B would drop this row had the evaluation gone first
    w("commit", {"step": 30, "loss": 1.2})
    w("eval", {"step": 40, "val_loss": 0.9})  # the final one: logged by finish
    w.finish()
    assert [step for step, _ in Run.logged] == [0, 10, 20, 25, 30, 40]
    assert Run.logged[3] == (25, ["eval/val_loss"])


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_a_quick_experiment_runs_end_to_end_and_its_figure_is_drawn(tmp_path):
    sweep = tmp_path / "multirun" / "fig8_quick"
    # epochs=1, 3 of its 10 workers and two of its four κ: the end-to-end path is the point (the sweep, its run
    # directories, `paper_figures all`), not the curves; the experiment's own sweep is checked by
    # test_experiment_composes_and_every_job_is_valid
    done = warm_run.run_py(
        "-m",
        "experiment=fig8_quick",
        "epochs=1",
        "workers=3",
        "algorithm.kappa=1,4",
        "logger.wandb.mode=disabled",
        "logger.progress=false",
        f"hydra.sweep.dir={sweep}",
        timeout=420,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    r = load.runs(sweep)
    assert len(r) == 2 and set(r["status"]) == {"completed"} and set(r["experiment"]) == {"fig8_quick"}
    assert sorted(r["algorithm.kappa"]) == [1, 4] and set(r["workers"]) == {3}
    out = tmp_path / "figures"
    done = subprocess.run(
        [sys.executable, "-m", "paper_figures", "all", str(tmp_path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "fig8.png").stat().st_size > 5000 and (out / "fig8.pdf").stat().st_size > 5000
    assert "fig1: skipped, no sweep of experiment=fig1" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["fig8.pdf", "fig8.png"]


def test_an_experiment_without_m_runs_one_job_and_says_so(capsys, tmp_path):
    assert expand(["experiment=fig8_quick"], multirun=False) == [["experiment=fig8_quick"]]
    # a run directory of the test's own: the preflight takes the one it checks (outputs/<now> by default)
    preflight(["experiment=fig8_quick", f"hydra.run.dir={tmp_path / 'a'}"])  # valid: returns, with one line of note
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "algorithm.kappa=1,2,3,4" in err and "Add -m" in err
    preflight(["algorithm=gem", f"hydra.run.dir={tmp_path / 'b'}"])  # no experiment: nothing to say
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):  # bad input: the error line only, no note before it
        preflight(["experiment=fig4", "workers=0"])
    assert capsys.readouterr().err == "error: workers=0 is not allowed; workers must be an integer >= 1\n"


def test_pi_by_run_takes_the_second_half_and_by_staleness_buckets_tau_relative_to_round_robin():
    from analysis import pi

    rows = []
    for run_dir, seed in (("a", 0), ("b", 1)):
        for step in range(1, 101):
            tau = (0, 4, 8)[step % 3]  # n = 5: τ/(n − 1) = 0, 1, 2
            rows.append(
                {
                    "run_dir": run_dir,
                    "seed": seed,
                    "workers": 5,
                    "status": "completed",
                    "step": step,
                    "staleness": tau,
                    "pi_median": (2.0, 0.5, 0.0)[step % 3] + (step > 50) * (seed + 1),
                    "pi_zero_frac": tau / 10,
                }
            )
    rows.append({**rows[-1], "run_dir": "c", "status": "diverged", "pi_median": 1e9})  # left out
    m = pd.DataFrame(rows)
    t = pi.by_run(m, ["workers"])
    late = m[(m["step"] > 50) & (m["run_dir"] != "c")].groupby("run_dir")["pi_median"].mean()
    assert t["seeds"].tolist() == [2] and t["pi_median"].iloc[0] == pytest.approx(late.mean())
    assert t["pi_median_std"].iloc[0] == pytest.approx(late.std())
    s = pi.by_staleness(m).set_index("tau_rel")
    assert s.index.tolist() == [0.0, 1.0, 2.0] and (s["commits"] >= pi.MIN_COMMITS).all()
    assert s["pi_zero_frac"].tolist() == pytest.approx([0.0, 0.4, 0.8])
    assert s.loc[1.0, "pi_median"] == pytest.approx(0.5 + 1.5)  # 0.5 plus the mean of the seeds' late shift


@pytest.mark.slow
@SHARED
def test_an_empty_panel_of_a_sweep_that_has_not_finished_says_its_runs_may_come(interrupted):
    import yaml

    hydra = {
        "sweeper": {
            "_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
            "params": {"seed": ",".join(map(str, range(12)))},
        },
        "overrides": {"task": []},
    }
    (interrupted / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra}))  # 12 jobs planned, 7 found
    fig = FIGURES["fig1"](interrupted)
    adaptive_ax = fig.axes[2]
    assert [t.get_text() for t in adaptive_ax.texts] == ["no adaptive runs yet:\nthe sweep has jobs that have not run"]
    assert "5 of the 12 jobs of sweep interrupted have not run" in fig._suptitle.get_text().replace("\n", " ")


@pytest.mark.slow
@SHARED
def test_momentum_sgd_run_once_per_n_by_a_fig6_sweep_counts_once(sweep, tmp_path):
    """A fig6 sweep runs sgd at every n although it runs one worker: twins, the same computation. Figures and the
    report keep one per seed instead of refusing them as the same seed twice (they did); a real repeat still is."""
    import json
    import shutil

    root = tmp_path / "fig6"
    for i in (2, 3, 4, 6):  # gem n = 2, seeds 0 and 1; downpour n = 2; sgd asked for n = 2
        shutil.copytree(sweep / str(i), root / str(i))
    shutil.copytree(sweep / "6", root / "7")  # the same sgd job, asked for n = 3
    summary = json.loads((root / "7" / "summary.json").read_text())
    (root / "7" / "summary.json").write_text(json.dumps({**summary, "workers_requested": 3}))
    config = root / "7" / ".hydra" / "config.yaml"
    config.write_text(re.sub(r"(?m)^workers: \d+$", "workers: 3", config.read_text()))

    assert len(load.without_twins(load.runs(root))) == 4
    fig = FIGURES["fig6"](root)
    assert "momentum SGD (1 seed)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    out = report.write(root, tmp_path / "r.csv")
    rows = pd.read_csv(out)
    assert rows.loc[rows["algorithm"] == "sgd", "runs"].tolist() == [1]

    shutil.copytree(sweep / "2", root / "8")  # gem n = 2 seed 0 again: the same seed twice
    with pytest.raises(NoRuns, match="the same seed twice"):
        FIGURES["fig6"](root)


@pytest.mark.slow
@SHARED
def test_the_docs_analysis_snippet_runs_and_its_figure_has_a_legend(sweep):
    """docs/analysis.md's first example, run as written on a small sweep (it drew curves without a legend)."""
    text = (ROOT / "docs" / "analysis.md").read_text()
    code = text.split("## A sweep in pandas\n\n```python\n", 1)[1].split("```", 1)[0]
    code = re.sub(r'load\.runs\("[^"]+"\)', f'load.runs(r"{sweep}")', code, count=1)
    namespace: dict = {}
    exec(compile(code, "docs/analysis.md (A sweep in pandas)", "exec"), namespace)
    labels = [t.get_text() for t in namespace["ax"].get_legend().get_texts()]
    assert labels and all(label.startswith("n = ") for label in labels), labels
    plots.plt.close("all")


def test_the_pi_cap_check_counts_what_it_says(capsys):
    """paper_figures.pi_cap (REPRODUCTION.md, Fig. 3): without momentum |m| = |Δθ|, so no element is at the cap;
    with it some are; the printed table has a row per fifth."""
    from gem.data import load_digits
    from paper_figures import pi_cap

    data = load_digits()
    plain = pi_cap.measure(data, steps=5, momentum=0.0)
    assert plain.shape == (5, 6) and (plain[:, 2:4] == 0).all()
    heavy = pi_cap.measure(data, steps=5)
    assert (heavy[0, 2:4] == 0).all() and (heavy[1:, 2:4] > 0).all()
    assert ((heavy[:, 2:] >= 0) & (heavy[:, 2:] <= 1)).all()
    # those at the cap with a gradient ≠ 0 are some of those at the cap: as a share of the nonzero gradients
    assert (heavy[1:, 3] <= heavy[1:, 2] / (1 - heavy[1:, 4]) + 1e-12).all()
    pi_cap.main(["--data", "digits", "--steps", "10"])
    out = capsys.readouterr().out
    assert "on digits: 1500 training examples" in out and out.count("\n| ") == 1 + 5  # the header, a row per fifth


@pytest.mark.slow
@SHARED
def test_fig5_draws_the_proxy_at_each_learning_rate_as_its_own_curve(sweep, tmp_path):
    """REPRODUCTION.md's Fig. 5 puts momentum SGD at a smaller η beside the paper's: one curve per η, each named
    with it (fig5 refused runs that differ in η); runs at one η keep their plain names."""
    import shutil

    root = tmp_path / "fig5"
    for i in (2, 6):  # gem n = 2 seed 0; sgd
        shutil.copytree(sweep / str(i), root / str(i))
    fig = FIGURES["fig5"](root)
    assert sorted(t.get_text() for t in fig.axes[0].get_legend().get_texts()) == [
        "gem, n = 2 (1 seed)",
        "momentum SGD (1 seed)",
    ]
    _run(root / "7", ["algorithm=sgd", "workers=1", "lr=0.01"])
    fig = FIGURES["fig5"](root)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    lr = f"{load.runs(sweep / '6')['lr'].iloc[0]:g}"
    assert sorted(labels) == sorted(
        [f"gem, n = 2, η = {lr} (1 seed)", f"momentum SGD, η = {lr} (1 seed)", "momentum SGD, η = 0.01 (1 seed)"]
    )
    plots.plt.close("all")
