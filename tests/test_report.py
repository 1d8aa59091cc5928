"""analysis.report on a sweep written by hand (config, summary, commit and evaluation rows; no run launched): the 95%
t intervals over the completed seeds (on the log and logit scales), the time to a validation target, the runs left
out of the means, and the four formats."""

import json
import re

import numpy as np
import pandas as pd
import pytest

from analysis import load, report, target

# its module-scoped fixtures are costly runs: under pytest-xdist its tests share one worker
pytestmark = pytest.mark.xdist_group("report")

T2 = 4.302652729911275  # t(0.975, 2)


def log_interval(values):
    """The 95% t interval of 3 values on the log scale, mapped back (analysis.stats)."""
    z = np.log(values)
    half = T2 * z.std(ddof=1) / np.sqrt(len(z))
    return np.exp(z.mean() - half), np.exp(z.mean() + half)


def _run(
    d,
    algorithm,
    n,
    seed,
    status="completed",
    loss=None,
    accuracy=None,
    reason="",
    steps=80,
    summary=True,
    engine="process",
    kappa=None,
):
    """A run directory as the runner leaves it: .hydra/config.yaml, metrics.parquet (a loss going from 2 down
    by 5% a worker step), eval.parquet (the validation loss the same, every other commit) and, unless it was
    killed, summary.json."""
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(
        f"algorithm:\n  name: {algorithm}\n"
        + (f"  kappa: {kappa}\n" if kappa is not None else "")
        + f"engine:\n  name: {engine}\nworkers: {n}\nseed: {seed}\n"
    )
    step = np.arange(1, steps + 1)
    worker_step = (step - 1) // n + 1
    pd.DataFrame(
        {
            "step": step,
            "worker": step % n,
            "worker_step": worker_step,
            "staleness": n - 1,
            "loss": 2.0 * 0.95**worker_step,
            "time_s": 1.0 + 0.1 * step,
        }
    ).to_parquet(d / "metrics.parquet")
    at = np.arange(0, steps + 1, 2)
    pd.DataFrame(
        {"step": at, "worker_step": at / n, "time_s": 1.0 + 0.1 * at, "val_loss": 2.0 * 0.95 ** (at / n)}
    ).to_parquet(d / "eval.parquet")
    if summary:
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "status": status,
                    "reason": reason,
                    "algorithm": algorithm,
                    "workers": n,
                    "seed": seed,
                    "steps": steps,
                    "final_train_loss": loss,
                    "val_loss": loss,
                    "val_accuracy": accuracy,
                    "test_loss": loss,
                    "test_accuracy": accuracy,
                    "mean_staleness": n - 1.0,
                }
            )
        )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """GEM at n = 2: three completed seeds (final losses 0.1, 0.2, 0.3), one failed with a loss that would move
    the mean, one killed before its summary; and one async_localsgd run (an underscore for LaTeX)."""
    root = tmp_path_factory.mktemp("cut")
    for seed, (loss, acc) in enumerate([(0.1, 0.90), (0.2, 0.92), (0.3, 0.94)]):
        _run(root / str(seed), "gem", 2, seed, loss=loss, accuracy=acc)
    _run(root / "3", "gem", 2, 3, status="failed", loss=9.0, accuracy=0.1, reason="cannot write x: disk | full")
    _run(root / "4", "gem", 2, 4, steps=48, summary=False)
    _run(root / "5", "async_localsgd", 2, 0, loss=0.5, accuracy=0.8)
    return root


def _hit(sweep, goal=0.5):
    r = load.runs(sweep)
    ev = load.commits(sweep, table="eval", columns=["algorithm", "workers", "seed", "status", "engine"], meta=r)
    return r, target.times(r, ev, goal)


def test_means_are_over_the_completed_seeds_with_their_t_interval(sweep):
    r, hit = _hit(sweep)
    s = report.summary(r, hit).set_index("algorithm")
    gem = s.loc["gem"]
    assert (gem["runs"], gem["completed"], gem["failed"], gem["incomplete"], gem["diverged"]) == (5, 3, 1, 1, 0)
    assert gem["final_train_loss_mean"] == pytest.approx(0.2) and gem["final_train_loss_k"] == 3
    lo, hi = log_interval([0.1, 0.2, 0.3])  # a loss's interval: on the log scale, above 0 (plain t: -0.048)
    assert (gem["final_train_loss_ci_lo"], gem["final_train_loss_ci_hi"]) == pytest.approx((lo, hi))
    assert lo > 0 and gem["test_loss_ci_lo"] == pytest.approx(lo)
    assert gem["target_runs"] == 3 and gem["reached"] == 3  # the failed and the killed run are not measured
    t = report.table(r, hit).set_index("algorithm")
    assert t.loc["gem", "final train loss"] == f"0.200 [{lo:.3f}, {hi:.3f}] (k=3)"
    acc = np.log(np.array([0.90, 0.92, 0.94]) / (1 - np.array([0.90, 0.92, 0.94])))  # logit scale: inside (0, 1)
    half = T2 * acc.std(ddof=1) / np.sqrt(3)
    lo_a, hi_a = 1 / (1 + np.exp(-(acc.mean() - half))), 1 / (1 + np.exp(-(acc.mean() + half)))
    assert t.loc["gem", "val accuracy"] == f"0.9200 [{lo_a:.4f}, {hi_a:.4f}] (k=3)" and hi_a < 1
    assert t.loc["gem", "mean staleness"] == "1.00 [1.00, 1.00] (k=3)"
    assert t.loc["gem", "status"] == "3 completed, 1 failed, 1 incomplete"
    assert t.loc["async_localsgd", "final train loss"] == "0.500 (k=1)"  # one seed: no interval
    # the first evaluation at or below 0.5: worker step 28 (2 · 0.95^28 = 0.476), commit 56, 5.5 s after the first
    # commit (time_s 1.1 at commit 1, 6.6 at commit 56)
    assert t.loc["gem", "worker steps to target"] == "28 (3/3)"
    assert t.loc["gem", "time to target"] == "6 s (3/3)"
    assert s.loc["gem", "time_to_target_median"] == pytest.approx(5.5)


def test_a_run_that_never_reaches_the_target_takes_forever_and_a_killed_one_is_not_counted(sweep):
    r, hit = _hit(sweep, goal=0.01)  # below every curve
    h = hit.set_index(hit["run_dir"].map(lambda d: d.rsplit("/", 1)[-1]))
    assert np.isinf(h.loc["0", "time"]) and not h.loc["0", "reached"]
    assert np.isnan(h.loc["3", "time"]) and np.isnan(h.loc["4", "time"])  # failed, killed: might have got there
    t = report.table(r, hit).set_index("algorithm")
    assert t.loc["gem", "worker steps to target"] == "never (0/3)"


def test_the_target_is_the_best_methods_median_final_validation_loss_and_a_diverged_seed_is_infinite(tmp_path):
    for seed, loss in enumerate((0.2, 0.1, 0.3)):
        _run(tmp_path / f"g{seed}", "gem", 2, seed, loss=loss, accuracy=0.9)
    for seed, loss in enumerate((0.05, 0.06)):
        _run(tmp_path / f"d{seed}", "downpour", 2, seed, loss=loss, accuracy=0.9)
    _run(tmp_path / "d2", "downpour", 2, 2, status="diverged")
    t = target.announce(load.runs(tmp_path))
    # gem's median 0.2; downpour's over 0.05, 0.06 and +inf (diverged): 0.06
    assert t["target"].tolist() == [pytest.approx(0.06)] and t["set_by"].tolist() == ["downpour"]
    # two seeds: the higher middle value (both reach it); a method's time: the lower one (half of them got there)
    assert target.upper_median([1.0, 2.0]) == 2.0 and target.lower_median([1.0, np.inf]) == 1.0


def test_markdown_report_says_first_which_runs_are_left_out_and_lists_them(sweep, tmp_path):
    text = report.write(sweep, tmp_path / "r.md").read_text()
    paragraphs = text.split("\n\n")
    assert paragraphs[0] == f"# Report: runs (from {sweep.name})"  # its title names the sweep
    # the targets were set from these runs: said, as not announced in advance
    assert "not announced in advance" in paragraphs[2] and "test split is evaluated once" in paragraphs[2]
    assert paragraphs[1] == (
        "**2 of 6 runs are not completed (1 failed, 1 incomplete) and are left out of the "
        "means: see “Runs left out of the means” below.**"
    )
    assert "Student's t" in paragraphs[2] and "95%" in paragraphs[2] and "left out of the means" in paragraphs[2]
    section = text.split("## Runs left out of the means")[1].split("## Validation loss")[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and "---" not in line][1:]
    cells = [[c.strip() for c in re_split(row)] for row in rows]
    assert [c[:6] for c in cells] == [
        ["3", "gem", "2", "3", "failed", "80"],
        ["4", "gem", "2", "4", "incomplete", "48"],
    ]  # a killed run: its last step
    assert cells[0][6] == r"cannot write x: disk \| full"  # a | in a reason does not split the row
    assert "no summary.json" in cells[1][6]
    assert (tmp_path / "r.png").stat().st_size > 5000 and "![validation loss curves](r.png)" in text
    # set from these runs, the target is GEM's median final validation loss, 0.2, which its curves (down to 0.26)
    # never reach: no profile, and the page says why
    assert "No method reached a target on any workload" in text and not (tmp_path / "r_profile.png").exists()
    text = report.write(sweep, tmp_path / "g.md", given=0.5).read_text()
    assert (tmp_path / "g_profile.png").stat().st_size > 5000 and "![performance profile](g_profile.png)" in text
    assert "the validation loss 0.5, given on the command line" in text


def re_split(row: str) -> list[str]:
    """The cells of a Markdown table row (an escaped \\| stays in its cell)."""
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_csv_is_the_tables_numbers_and_reads_back(sweep, tmp_path):
    path = report.write(sweep, tmp_path / "t.csv", given=0.5)
    c = pd.read_csv(path)
    for q in (
        "final_train_loss",
        "val_loss",
        "val_accuracy",
        "test_loss",
        "test_accuracy",
        "mean_staleness",
        "wall_time_s",
    ):
        assert {f"{q}_mean", f"{q}_ci_lo", f"{q}_ci_hi", f"{q}_k"} <= set(c.columns)
        assert pd.api.types.is_float_dtype(c[f"{q}_mean"])
    assert {
        "algorithm",
        "n",
        "runs",
        "completed",
        "diverged",
        "failed",
        "incomplete",
        "target",
        "target_runs",
        "reached",
        "worker_steps_to_target_median",
        "time_to_target_median",
        "clock",
    } <= set(c.columns)
    gem = c.set_index("algorithm").loc["gem"]
    assert gem["final_train_loss_ci_hi"] == pytest.approx(log_interval([0.1, 0.2, 0.3])[1])
    assert gem["worker_steps_to_target_median"] == 28 and gem["clock"] == "seconds" and gem["target"] == 0.5
    assert np.isnan(c.set_index("algorithm").loc["async_localsgd", "final_train_loss_ci_lo"])  # k = 1


def test_tex_is_a_booktabs_table_with_escaped_text(sweep, tmp_path):
    text = report.write(sweep, tmp_path / "t.tex").read_text()
    lines = text.splitlines()
    assert lines[0] == f"% generated by python -m analysis.report {sweep} --out {tmp_path / 't.tex'}"
    assert lines[1].startswith("% \\caption{") and "95\\% confidence interval (Student's t" in lines[1]
    body = lines[2:]
    assert body[0].startswith(r"\begin{tabular}") and body[-1] == r"\end{tabular}"
    assert [x for x in body if x in (r"\toprule", r"\midrule", r"\bottomrule")] == [
        r"\toprule",
        r"\midrule",
        r"\bottomrule",
    ]
    assert r"async\_localsgd & 2 & 1 &" in text and "async_localsgd" not in text
    lo, hi = log_interval([0.1, 0.2, 0.3])
    assert f"0.200 [{lo:.3f}, {hi:.3f}] (k=3)" in text
    assert report.tex_escape("50% & #1 ~x") == r"50\% \& \#1 \textasciitilde{}x"
    assert not list(tmp_path.glob("*.png"))  # no figure with a table


def test_a_bad_suffix_is_one_line_and_writes_nothing(sweep, tmp_path, capsys):
    assert report.main([str(sweep), "--out", str(tmp_path / "new" / "r.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and ".html, .md, .csv or .tex" in err
    assert list(tmp_path.iterdir()) == []
    assert report.main([str(sweep), "--target", "-1", "--out", str(tmp_path / "r.md")]) == 2
    assert capsys.readouterr().err == "error: --target=-1 is not allowed; it must be a validation loss > 0\n"
    assert list(tmp_path.iterdir()) == []


def test_the_target_line_leaves_the_range_alone_and_the_grid_is_narrow(sweep):
    r, hit = _hit(sweep, goal=1e-4)  # far below every curve
    ev = load.commits(sweep, table="eval", columns=["algorithm", "workers", "seed", "status"], meta=r)
    fig = report.curves_figure(r, ev, hit)
    loss_ax, final_ax = fig.axes[0], fig.axes[1]
    assert loss_ax.get_ylim()[0] > 1e-3  # not stretched down to the target
    assert not [ln for ln in loss_ax.get_lines() if list(ln.get_ydata()) == [1e-4, 1e-4]]
    assert [t.get_text() for t in loss_ax.texts] == ["target 0.0001 below the range"]
    assert final_ax.get_legend() is None and loss_ax.get_legend() is None  # one legend, off the data
    assert fig.axes[0].get_subplotspec().get_gridspec().ncols <= 3
    report.plt.close(fig)
    assert report.headline(r[r["status"] == "completed"]) == (
        "Every run completed (4 of 4): none is left out of the means."
    )


def test_the_same_seed_twice_is_refused_not_counted_as_two(tmp_path, capsys):
    for copy in ("a", "b"):  # one sweep and its copy: the same two seeds, twice
        for seed in (0, 1):
            _run(tmp_path / copy / str(seed), "gem", 2, seed, loss=0.1 + seed, accuracy=0.9)
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "t.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 2 runs share algorithm=gem, workers=2, seed=0 (") and "not two seeds" in err
    assert not (tmp_path / "t.csv").exists()
    capsys.readouterr()
    assert report.main([str(tmp_path / "a"), "--out", str(tmp_path / "t.csv")]) == 0  # each seed once: fine
    # the terminal says what the report says of its runs (it printed only the report's path)
    assert capsys.readouterr().out == f"report: {tmp_path / 't.csv'}\n2 runs: 2 completed\n"


def test_the_report_s_files_at_the_root_are_ignored_by_git():
    """`python -m analysis.report <sweep> --out baselines.md` at the checkout's root left two untracked files."""
    import shutil
    import subprocess

    from helpers.paths import ROOT

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = ["baselines.html", "baselines.md", "baselines.png", "baselines.csv", "baselines.tex", "figures/fig1.png"]
    r = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == names


def test_the_performance_profile_is_the_share_of_workloads_within_tau_of_the_fastest():
    """Dolan and Moré on hand-made times: on workload n = 5 gem takes 10 and downpour 20; on n = 10 gem 30 and
    downpour 15; on n = 30 gem 40 and downpour never gets there; on n = 50 nobody does (left out, and said)."""
    methods = pd.DataFrame(
        {
            "workers": [5, 5, 10, 10, 30, 30, 50, 50],
            "method": ["gem", "downpour"] * 4,
            "time": [10.0, 20.0, 30.0, 15.0, 40.0, np.inf, np.inf, np.inf],
        }
    )
    prof, dropped = target.profile(methods, at=[1.0, 1.5, 2.0, 4.0])
    rho = prof.pivot(index="r", columns="method", values="rho")
    # gem: best on n = 5 and 30, 2x on n = 10; downpour: best on n = 10, 2x on n = 5, never on n = 30
    assert rho["gem"].tolist() == pytest.approx([2 / 3, 2 / 3, 1.0, 1.0])
    assert rho["downpour"].tolist() == pytest.approx([1 / 3, 1 / 3, 2 / 3, 2 / 3])
    assert dropped == ["n = 50"] and set(prof["workloads"]) == {3}


def test_a_profile_of_many_methods_keeps_each_line_at_its_value_and_its_legend_on_the_figure():
    """27 methods tied at ρ = 1 (the twelve methods' variants at two n): each line is nudged apart by a hair, all
    within 0.015 of 1 (a nudge that grew with the count drew the best method at 0.95), and the legend takes two
    columns rather than running off the figure's foot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"m{i:02d}" for i in range(27)]
    methods = pd.DataFrame({"workers": [5] * 27, "method": names, "time": [10.0] * 27})
    prof, _ = target.profile(methods, at=[1.0, 2.0, 4.0])
    fig, ax = plt.subplots()
    try:
        target.profile_figure(prof, ax)
        ys = np.concatenate([line.get_ydata() for line in ax.get_lines()])
        assert len(ax.get_lines()) == 27 and np.all(np.abs(ys - 1.0) <= 0.015) and len(set(ys.round(6))) == 27
        fig.canvas.draw()  # the legend's names in two columns: two left edges
        lefts = {round(t.get_window_extent().x0) for t in ax.get_legend().get_texts()}
        assert len(lefts) == 2 and target.legend_columns(16) == 1
    finally:
        plt.close(fig)


def test_the_report_sets_its_targets_per_setting_and_says_where_none_was_announced(tmp_path, sweep):
    """gem at κ = 1 (0.10, 0.11) and κ = 4 (1.0, 1.1) are two methods: κ = 1 sets the target, not a pool of both
    (whose median, 1.0, would let downpour's 0.30 set it)."""
    for seed, (kappa, loss) in enumerate([(1, 0.10), (1, 0.11), (4, 1.0), (4, 1.1)]):
        _run(tmp_path / f"g{seed}", "gem", 2, seed % 2, loss=loss, accuracy=0.9, kappa=kappa)
    for seed, loss in enumerate((0.30, 0.31)):
        _run(tmp_path / f"d{seed}", "downpour", 2, seed, loss=loss, accuracy=0.9)
    goals, _ = report.targets_for(load.runs(tmp_path))
    assert goals["set_by"].tolist() == ["gem kappa=1"] and goals["target"].tolist() == [pytest.approx(0.11)]
    # targets announced for n = 5 only: the n = 2 runs have no target, which is not "never reached"
    r, hit = _hit(sweep, goal=pd.DataFrame({"workers": [5], "target": [0.5]}))
    assert hit["time"].isna().all() and not hit["reached"].any()
    t = report.table(r, hit).set_index("algorithm")
    assert t.loc["gem", "time to target"] == "n/a (no target announced for this workload)"


def test_a_final_loss_panel_of_one_run_has_a_range_around_its_point():
    """One run (one n, one seed): no spread, and the panel spans a decade around its point instead of an empty
    range, which matplotlib warned of and widened on its own."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis import plots

    runs = pd.DataFrame({"workers": [10], "algorithm": ["gem"], "final_train_loss": [0.1], "status": ["completed"]})
    fig, ax = plt.subplots()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plots.final_loss(runs, ax, x="workers", hue="algorithm")
            fig.canvas.draw()
        assert ax.get_ylim() == pytest.approx((0.1 / 3, 0.3))
    finally:
        plt.close(fig)


def test_targets_announced_by_several_tuning_sweeps_are_put_together(tmp_path, capsys):
    """`--target-from` with one tuning sweep per n: their workloads together; the same workload announced twice
    with two targets is refused in one line naming both."""
    head = "data,engine,staleness_model,workers,target,set_by,from_runs\n"
    for name, rows in {
        "n5": "mnist,sim,gamma (CV 0.25),5,0.0628,gem,18\n",
        "n10": "mnist,sim,gamma (CV 0.25),10,0.0575,gem,18\n",
        "n10again": "mnist,sim,gamma (CV 0.25),10,0.0518,gem,18\n",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "targets.csv").write_text(head + rows)
    t = target.read_targets([tmp_path / "n5", tmp_path / "n10", tmp_path / "n10" / "targets.csv"])
    assert t.sort_values("workers")[["workers", "target"]].values.tolist() == [[5, 0.0628], [10, 0.0575]]
    with pytest.raises(ValueError, match=r"^--target-from: the workload .*n = 10.* has different announced targets"):
        target.read_targets([tmp_path / "n10", tmp_path / "n10again"])
    (tmp_path / "bare.csv").write_text("workers,target\n30,0.1\n")  # a workload told by other columns: refused
    with pytest.raises(ValueError, match=r"^--target-from: the files describe their workloads by different columns"):
        target.read_targets([tmp_path / "n5", tmp_path / "bare.csv"])
    _run(tmp_path / "runs" / "g0", "gem", 10, 0, loss=0.1, accuracy=0.9)
    out = tmp_path / "r.md"
    argv = [
        str(tmp_path / "runs"),
        "--out",
        str(out),
        "--target-from",
        str(tmp_path / "n10"),
        str(tmp_path / "n10again"),
    ]
    assert report.main(argv) == 2 and not out.exists()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --target-from: the workload") and "0.0518" in line
    assert report.main([*argv[:-1], str(tmp_path / "n5")]) == 0 and out.is_file()
    assert "announced before these runs: " + str(tmp_path / "n10") in out.read_text()


def test_a_folder_without_runs_is_named_as_typed(tmp_path, capsys):
    """The report said `no runs found under ['<folder>']`, a Python list; it names the folders as typed, and what
    it looked for."""
    from analysis import report

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r.md")]) == 2
    assert capsys.readouterr().err == (
        f"error: no runs under {tmp_path / 'a'} {tmp_path / 'b'}: a run's folder holds its summary.json or "
        ".hydra/config.yaml\n"
    )
    assert not (tmp_path / "r.md").exists()
