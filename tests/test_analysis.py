"""analysis.load: a small sweep made here, with a diverged and a killed run, into tidy frames."""

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from analysis.load import commits, find_runs, flatten, runs
from experiments.config import compose
from experiments.runner import run

# its module-scoped fixtures are costly runs: under pytest-xdist its tests share one worker
pytestmark = pytest.mark.xdist_group("analysis")

COMMON = ["engine=sim", "epochs=1", "logger.wandb.mode=disabled", "logger.eval_every=10"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    jobs = [["algorithm=gem", "workers=2"], ["algorithm=downpour", "workers=3"], ["algorithm=sgd", "lr=1e6"]]
    for i, overrides in enumerate(jobs):
        d = root / str(i)
        cfg = compose(overrides + COMMON)
        (d / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, d / ".hydra" / "config.yaml", resolve=True)
        run(cfg, d)
    killed = root / "3"  # killed before it wrote a summary: config and flushed rows only
    (killed / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose(["algorithm=adaptive"] + COMMON), killed / ".hydra" / "config.yaml", resolve=True)
    return root


def test_runs_has_one_row_per_run_with_config_and_status(sweep):
    r = runs(sweep).set_index("algorithm")
    assert sorted(r.index) == ["adaptive", "downpour", "gem", "sgd"]
    assert r.loc["gem", "status"] == "completed" and r.loc["gem", "workers"] == 2
    assert r.loc["sgd", "status"] == "diverged" and r.loc["sgd", "lr"] == 1e6
    assert r.loc["adaptive", "status"] == "incomplete" and pd.isna(r.loc["adaptive", "steps"])
    assert r.loc["gem", "algorithm.kappa"] == 1.0 and r.loc["downpour", "algorithm.window"] == 1
    assert r.loc["gem", "engine"] == "sim" and r.loc["gem", "data"] == "digits"
    assert r.loc["gem", "pi_median"] > 0 and r.loc["downpour", "mean_staleness"] == pytest.approx(2.0, abs=0.2)


def test_commits_joins_each_row_with_its_run(sweep):
    r = runs(sweep)
    m = commits(sweep)
    steps = r.set_index("run_dir")["steps"].dropna()
    assert m.groupby("run_dir").size().to_dict() == {k: int(v) for k, v in steps.items() if v}
    gem_rows = m[m["algorithm"] == "gem"]
    assert gem_rows["pi_median"].notna().all() and (gem_rows["workers"] == 2).all()
    t = commits(sweep, "tensors", columns=["algorithm", "workers"])
    assert set(t["algorithm"]) == {"gem"} and len(t) == 10 * len(gem_rows)
    ev = commits(sweep, "eval", columns=["algorithm", "seed"])
    assert {"step", "val_loss", "algorithm", "seed", "run_dir"} <= set(ev.columns)


def test_find_runs_accepts_runs_sweeps_and_lists(sweep, tmp_path):
    assert len(find_runs(sweep)) == 4
    assert find_runs([sweep / "0", sweep / "1", sweep / "0"]) == sorted(
        {(sweep / "0").resolve(), (sweep / "1").resolve()}
    )
    with pytest.raises(FileNotFoundError, match="no such run or sweep directory"):
        find_runs(tmp_path / "missing")
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "completed"


def test_flatten_names_groups_by_their_choice():
    assert flatten(
        {"algorithm": {"name": "gem", "kappa": 2}, "lr": 0.1, "data": {"name": "mnist", "synthetic": {"seed": 3}}}
    ) == {"algorithm": "gem", "algorithm.kappa": 2, "lr": 0.1, "data": "mnist", "data.synthetic.seed": 3}


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("summary.json", "[1, 2]", "holds a JSON list, not a run's summary (an object)"),
        ("summary.json", "{not json", "cannot be read as JSON (Expecting property name"),
        (".hydra/config.yaml", "a: [1,\n  b: {", "cannot be read as YAML ("),
        (".hydra/config.yaml", "- 1\n- 2\n", "holds a YAML ListConfig, not a run's config"),
        ("metrics.parquet", "PAR1 cut short", "cannot be read as Parquet (Parquet magic bytes not found in footer"),
        ("eval.parts/part-000001.parquet", "", "cannot be read as Parquet ("),
    ],
)
def test_a_damaged_run_file_leaves_that_run_out_naming_it(tmp_path, name, text, says):
    """A damaged file is the run's status (`unreadable`) and its reason, in one line naming the file. It was a
    ValueError that stopped `runs`, and with it the whole sweep's report (a Parquet file cut short: pyarrow's own
    error, without the file's name)."""
    run = tmp_path / "sweep" / "0"
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / ".hydra").mkdir(exist_ok=True)
    if name != "summary.json":
        (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 3}))
    (run / name).write_text(text)
    (row,) = runs(tmp_path / "sweep").to_dict("records")
    assert row["status"] == "unreadable"
    assert row["reason"].startswith(f"{run / name} {says}") and "\n" not in row["reason"], row["reason"]
    assert commits(tmp_path / "sweep").empty  # its rows are not read


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_one_damaged_run_does_not_hide_its_sweep(sweep, tmp_path):
    """`analysis.report` over a sweep with one run's metrics.parquet cut short: the others are reported, the
    damaged run is left out of the means and named with its file (it stopped the report with pyarrow's error)."""
    import shutil
    import subprocess
    import sys

    from helpers.paths import ROOT

    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    cut = copy / "0" / "metrics.parquet"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    out = tmp_path / "report.md"
    r = subprocess.run(
        [sys.executable, "-m", "analysis.report", str(copy), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert "1 unreadable" in page and f"{cut} cannot be read as Parquet" in page
    assert "| downpour" in page  # the others are there


@pytest.mark.slow
def test_analysis_pi_heads_each_table(tmp_path, capsys):
    """`python -m analysis.pi` printed two tables without a word on what each is."""
    from analysis import pi

    for seed in (0, 1):
        run(
            compose(
                [
                    "engine=sim",
                    "workers=2",
                    "epochs=1",
                    f"seed={seed}",
                    "logger.wandb.mode=disabled",
                    "logger.progress=false",
                ]
            ),
            tmp_path / "sweep" / str(seed),
        )
    capsys.readouterr()
    assert pi.main([str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    first, second = out.index("## π by run: per workers"), out.index("## π by each commit's own staleness")
    parts = (out[first:second], out[second:])
    tables = [[line for line in part.splitlines() if line.startswith("|")] for part in parts]
    assert first == 0 and tables[0] and "workers" in tables[0][0] and tables[1] and "tau_rel" in tables[1][0]


def test_many_variants_take_their_algorithm_s_colour_in_lighter_shades():
    """More than 10 variants of a few algorithms: each algorithm keeps one hue, its variants lighter shades of it,
    and no two names share a colour (on the sequential scale, neighbours could not be told apart)."""
    from analysis import plots

    names = ["gem lr=0.05"] + [
        f"{a} lr={lr}" for a in ("downpour", "agn", "easgd", "dcasgd", "ssgd") for lr in (0.025, 0.05)
    ]
    c = plots.colours(names)
    assert len(set(c.values())) == len(names)
    assert c["gem lr=0.05"][:3] == plots.plt.get_cmap("tab10")(0)[:3]
    dark, light = c["agn lr=0.025"], c["agn lr=0.05"]
    assert dark[:3] == plots.plt.get_cmap("tab10")(2)[:3]
    assert all(lv >= dv for lv, dv in zip(light[:3], dark[:3], strict=True)) and light != dark


def test_twelve_algorithms_take_twelve_distinct_named_colours():
    """The twelve algorithms of the baselines (more than tab10 holds) drew as twelve greens of the sequential scale;
    each now has its own colour: tab10's for the first ten, then colours far from all of them."""
    import numpy as np

    from analysis import plots

    names = [f"algo{i}" for i in range(12)]
    c = plots.colours(names)
    tab10 = plots.plt.get_cmap("tab10")
    assert [c[f"algo{i}"][:3] for i in range(10)] == [tab10(i)[:3] for i in range(10)]
    rgb = np.array([c[n][:3] for n in names])
    gaps = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1) + np.eye(12)
    assert gaps.min() > 0.15  # no two close (the sequential scale's neighbours were 0.07 apart)


def test_analysis_pi_refuses_a_missing_or_empty_folder_in_one_line(tmp_path, capsys):
    """`python -m analysis.pi <a folder that does not exist>` ended in a traceback, and one without GEM runs said
    so on stdout with exit code 1; both are now one `error:` line on stderr, exit code 2, as the report's."""
    from analysis import pi

    missing = tmp_path / "missing"
    assert pi.main([str(missing)]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such run or sweep directory\n"
    (tmp_path / "empty").mkdir()
    assert pi.main([str(tmp_path / "empty")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        f"error: no GEM runs under {tmp_path / 'empty'}: π is GEM's (pass the folder of a sweep with algorithm=gem)\n"
    )
