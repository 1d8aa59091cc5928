"""analysis.report on a sweep written by hand (config, summary, commit rows; no run launched): the 95% t intervals
over the completed seeds, the runs left out of the means, and the four formats."""

import json
import re

import numpy as np
import pandas as pd
import pytest

from analysis import load, report

# its module-scoped fixtures are costly runs: under pytest-xdist its tests share one worker
pytestmark = pytest.mark.xdist_group("report")

# t(0.975, 2) = 4.3027: losses 0.1, 0.2, 0.3 have sd 0.1, so the half-width is 4.3027 · 0.1 / √3 = 0.2484
HALF = 4.302652729911275 * 0.1 / np.sqrt(3)


def _run(d, algorithm, n, seed, status="completed", loss=None, accuracy=None, reason="", steps=80, summary=True):
    """A run directory as the runner leaves it: .hydra/config.yaml, metrics.parquet (a loss going from 2 down
    by 5% a worker step) and, unless it was killed, summary.json."""
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(f"algorithm:\n  name: {algorithm}\nworkers: {n}\nseed: {seed}\n")
    step = np.arange(1, steps + 1)
    worker_step = (step - 1) // n + 1
    pd.DataFrame({"step": step, "worker": step % n, "worker_step": worker_step, "staleness": n - 1,
                  "loss": 2.0 * 0.95 ** worker_step, "time_s": 0.1 * step}).to_parquet(d / "metrics.parquet")
    if summary:
        (d / "summary.json").write_text(json.dumps({
            "status": status, "reason": reason, "algorithm": algorithm, "workers": n, "seed": seed, "steps": steps,
            "final_train_loss": loss, "val_accuracy": accuracy, "mean_staleness": n - 1.0}))


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


def test_means_are_over_the_completed_seeds_with_their_t_interval(sweep):
    r = load.runs(sweep)
    m = load.commits(sweep, columns=["algorithm", "workers", "seed", "status"], meta=r)
    s = report.summary(r, m, 0.5).set_index("algorithm")
    gem = s.loc["gem"]
    assert (gem["runs"], gem["completed"], gem["failed"], gem["incomplete"], gem["diverged"]) == (5, 3, 1, 1, 0)
    assert gem["final_train_loss_mean"] == pytest.approx(0.2) and gem["final_train_loss_k"] == 3
    assert (gem["final_train_loss_ci_lo"], gem["final_train_loss_ci_hi"]) == pytest.approx((0.2 - HALF, 0.2 + HALF))
    assert gem["target_runs"] == 3 and gem["reached"] == 3  # the failed and the killed run are not measured
    t = report.table(r, m, 0.5).set_index("algorithm")
    assert t.loc["gem", "final train loss"] == "0.200 ± 0.248 (k=3)"
    assert t.loc["gem", "val accuracy"] == "0.9200 ± 0.0497 (k=3)"
    assert t.loc["gem", "mean staleness"] == "1.00 ± 0.00 (k=3)"
    assert t.loc["gem", "status"] == "3 completed, 1 failed, 1 incomplete"
    assert t.loc["async_localsgd", "final train loss"] == "0.500 (k=1)"  # one seed: no interval
    assert t.loc["gem", "worker steps to 0.5"] == "28 (3/3)"  # 2 · 0.95^28 = 0.476


def test_markdown_report_says_first_which_runs_are_left_out_and_lists_them(sweep, tmp_path):
    text = report.write(sweep, tmp_path / "r.md").read_text()
    paragraphs = text.split("\n\n")
    assert paragraphs[1] == ("**2 of 6 runs are not completed (1 failed, 1 incomplete) and are left out of the "
                             "means: see “Runs left out of the means” below.**")
    assert "Student's t" in paragraphs[2] and "95%" in paragraphs[2] and "left out of the means" in paragraphs[2]
    section = text.split("## Runs left out of the means")[1].split("## Loss curves")[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and "---" not in line][1:]
    cells = [[c.strip() for c in re_split(row)] for row in rows]
    assert [c[:6] for c in cells] == [["3", "gem", "2", "3", "failed", "80"],
                                      ["4", "gem", "2", "4", "incomplete", "48"]]  # a killed run: its last step
    assert cells[0][6] == r"cannot write x: disk \| full"  # a | in a reason does not split the row
    assert "no summary.json" in cells[1][6]
    assert (tmp_path / "r.png").stat().st_size > 5000 and "![loss curves](r.png)" in text


def re_split(row: str) -> list[str]:
    """The cells of a Markdown table row (an escaped \\| stays in its cell)."""
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_csv_is_the_tables_numbers_and_reads_back(sweep, tmp_path):
    path = report.write(sweep, tmp_path / "t.csv")
    c = pd.read_csv(path)
    for q in ("final_train_loss", "val_accuracy", "mean_staleness"):
        assert {f"{q}_mean", f"{q}_ci_lo", f"{q}_ci_hi", f"{q}_k"} <= set(c.columns)
        assert pd.api.types.is_float_dtype(c[f"{q}_mean"])
    assert {"algorithm", "n", "runs", "completed", "diverged", "failed", "incomplete", "target_loss", "target_runs",
            "reached", "worker_steps_to_target_median", "seconds_to_target_median"} <= set(c.columns)
    gem = c.set_index("algorithm").loc["gem"]
    assert gem["final_train_loss_ci_hi"] == pytest.approx(0.2 + HALF) and gem["worker_steps_to_target_median"] == 28
    assert np.isnan(c.set_index("algorithm").loc["async_localsgd", "final_train_loss_ci_lo"])  # k = 1


def test_tex_is_a_booktabs_table_with_escaped_text(sweep, tmp_path):
    text = report.write(sweep, tmp_path / "t.tex").read_text()
    lines = text.splitlines()
    assert lines[0] == f"% generated by python -m analysis.report {sweep} --out {tmp_path / 't.tex'}"
    assert lines[1].startswith("% \\caption{") and "95\\% confidence interval (Student's t" in lines[1]
    body = lines[2:]
    assert body[0].startswith(r"\begin{tabular}") and body[-1] == r"\end{tabular}"
    assert [x for x in body if x in (r"\toprule", r"\midrule", r"\bottomrule")] == [r"\toprule", r"\midrule",
                                                                                    r"\bottomrule"]
    assert r"async\_localsgd & 2 & 1 &" in text and "async_localsgd" not in text
    assert r"0.200 $\pm$ 0.248 (k=3)" in text and "±" not in text
    assert report.tex_escape("50% & #1 ~x") == r"50\% \& \#1 \textasciitilde{}x"
    assert not list(tmp_path.glob("*.png"))  # no figure with a table


def test_a_bad_suffix_is_one_line_and_writes_nothing(sweep, tmp_path, capsys):
    assert report.main([str(sweep), "--out", str(tmp_path / "new" / "r.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and ".html, .md, .csv or .tex" in err
    assert list(tmp_path.iterdir()) == []


def test_the_target_line_leaves_the_range_alone_and_the_grid_is_narrow(sweep):
    r = load.runs(sweep)
    m = load.commits(sweep, columns=["algorithm", "workers", "seed", "status"], meta=r)
    fig = report.curves_figure(r, m, target=1e-4)  # far below every curve
    loss_ax, final_ax = fig.axes[0], fig.axes[1]
    assert loss_ax.get_ylim()[0] > 1e-3  # not stretched down to the target
    assert not [ln for ln in loss_ax.get_lines() if list(ln.get_ydata()) == [1e-4, 1e-4]]
    assert [t.get_text() for t in loss_ax.texts] == ["target 0.0001 below the range"]
    assert final_ax.get_legend() is None and loss_ax.get_legend() is None  # one legend, off the data
    assert fig.axes[0].get_subplotspec().get_gridspec().ncols <= 3
    report.plt.close(fig)
    assert report.headline(r[r["status"] == "completed"]) == ("Every run completed (4 of 4): none is left out of the "
                                                               "means.")


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

    from conftest import ROOT

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = ["baselines.html", "baselines.md", "baselines.png", "baselines.csv", "baselines.tex", "figures/fig1.png"]
    r = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == names
