"""Every benchmark script runs to its end, briefly: a change cannot break one unseen (issue 26). Their numbers are
not checked here (they mean nothing at these sizes); BENCHMARKS.md records the real runs.

The scripts run one after the other in one Python process (`SMOKE`), each as `python benchmarks/<script>` would
run it (`runpy`, its own argv): torch and gem are imported once rather than once a script, which was a fifth of
this file's time. A script that measures its own process runs in a process of its own (`OWN_PROCESS`). What each
script starts (engine runs, `python run.py`) is still its own processes."""

import json
import os
import runpy
import subprocess
import sys

import pytest
from helpers.paths import ROOT, SHARED_DATA

DATA = SHARED_DATA  # the scripts fall back to the embedded digits where MNIST is absent; data_loading needs MNIST
MNIST = DATA / "MNIST" / "raw" / "train-images-idx3-ubyte"

SCRIPTS = {  # script: arguments that make it brief
    "data_loading.py": ["--root", str(DATA), "--rounds", "1", "--smoke"],
    "distributed_engine.py": ["--root", str(DATA), "--workers", "2", "--epochs", "1", "--rounds", "1", "--smoke"],
    "gem_commit.py": ["--root", str(DATA), "--commits", "4", "--reps", "2", "--smoke"],
    "gpu.py": ["--device", "cpu", "--steps", "1", "--smoke"],
    "multihost.py": ["--smoke"],  # says it skipped, and exits 0, where network namespaces cannot be made
    "process_engine.py": ["--root", str(DATA), "--workers", "1", "--epochs", "1", "--rounds", "1", "--smoke"],
    "sim_commit.py": [
        "--root",
        str(DATA),
        "--workers",
        "2",
        "--epochs",
        "1",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--smoke",
    ],
    "sweep_check.py": ["--smoke"],
    "transport.py": ["--workers", "1", "--seconds", "0.2", "--rounds", "1"],
    "worker_memory.py": ["--workers", "2", "--wait", "0.5", "--smoke"],
}

# scripts that measure their own process (worker_memory: its RSS as it builds virtual workers, which memory freed by
# the scripts before it would hide) run in a process of their own
OWN_PROCESS = {"worker_memory.py"}

# runs each script named in argv[1] (JSON: script -> args) as __main__, and prints one JSON line per script: its exit
# code, and the end of what it printed and of its traceback
SMOKE = r"""
import contextlib, io, json, runpy, sys, traceback
for script, args in json.loads(sys.argv[1]).items():
    out, err, rc = io.StringIO(), io.StringIO(), 0
    sys.argv = [f"benchmarks/{script}", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(f"benchmarks/{script}", run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            rc = 1
            traceback.print_exc()
    print(json.dumps({"script": script, "rc": rc, "stdout": out.getvalue()[-3000:], "stderr": err.getvalue()[-3000:]}),
          file=sys.__stdout__, flush=True)
"""


def test_every_benchmark_script_is_listed():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py") == sorted(SCRIPTS)


@pytest.mark.xdist_group("benchmarks")
def test_tests_of_one_xdist_group_share_one_test_process(request):
    """The suite's costly fixtures (this file's scripts, the figures' sweep, ...) are shared by the tests of an
    xdist_group, which `--dist loadgroup` sends to one test process. pytest 9.2 broke that silently
    (pytest-xdist issue 1386): each fixture then ran once per process, and the suite took a third longer."""
    # a test process of `--dist loadgroup` (xdist sets this option there, and reads it to group)
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@benchmarks"), (
            f"pytest-xdist's loadgroup did not group {request.node.nodeid} (pytest {pytest.__version__}): see the "
            "pin of pytest in pyproject.toml"
        )


@pytest.fixture(scope="module")
def smoked(tmp_path_factory):
    """Every script's run: script -> {rc, stdout, stderr}; multihost.py's also "json", the file its rows went to."""
    rows = tmp_path_factory.mktemp("multihost") / "rows.json"
    scripts = {**SCRIPTS, "multihost.py": [*SCRIPTS["multihost.py"], "--json", str(rows)]}
    scripts = {s: a for s, a in scripts.items() if s != "data_loading.py" or MNIST.exists()}
    shared = {s: a for s, a in scripts.items() if s not in OWN_PROCESS}
    runs = {}
    for batch in [shared, *({s: a} for s, a in scripts.items() if s in OWN_PROCESS)]:
        r = subprocess.run(
            [sys.executable, "-c", SMOKE, json.dumps(batch)], cwd=ROOT, capture_output=True, text=True, timeout=1200
        )
        for line in r.stdout.splitlines():
            if line.startswith('{"script": '):
                run = json.loads(line)
                runs[run.pop("script")] = run
        assert r.returncode == 0 and batch.keys() <= runs.keys(), (
            f"the scripts' process ended (exit code {r.returncode}) after {list(runs)}: {r.stderr[-3000:]}"
        )
    runs["multihost.py"]["json"] = rows
    return runs


@pytest.mark.slow
@pytest.mark.xdist_group("benchmarks")  # one process runs every script (the fixture): its tests on one test worker
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_runs_to_its_end(script, smoked):
    if script == "data_loading.py" and not MNIST.exists():
        pytest.skip(f"needs the MNIST files in {MNIST.parent}")
    run = smoked[script]
    assert run["rc"] == 0, run["stderr"]
    assert run["stdout"].strip(), "it printed nothing"


# what a row of `multihost.py --json` holds at least (issue 47, item 4), and the paces its rule may name
MULTIHOST_KEYS = {
    "model",
    "servers",
    "duplex",
    "rate_mbit",
    "commits_per_s",
    "limit_per_s",
    "ratio",
    "pace",
    "compute_s",
    "server_busy",
    "bytes_per_commit",
    "workers",
    "device",
}


@pytest.mark.slow
@pytest.mark.xdist_group("benchmarks")
def test_multihost_writes_its_rows_as_records(smoked):
    """`--smoke --json FILE`: a record per measured row, here one: full duplex with two servers (several servers
    run in full duplex only: the script says so and skips the other); none where namespaces cannot be made."""
    run = smoked["multihost.py"]
    assert run["rc"] == 0, run["stderr"]
    rows = json.loads(run["json"].read_text())
    if "skipped: no network namespaces" in run["stdout"]:
        assert rows == []
        pytest.skip("no network namespaces here: multihost.py measured nothing")
    for row in rows:
        assert MULTIHOST_KEYS <= row.keys(), sorted(MULTIHOST_KEYS - row.keys())
        assert row["pace"] in ("link", "server CPU", "worker steps", "unclear"), row["pace"]
        assert row["ratio"] == pytest.approx(row["commits_per_s"] / row["limit_per_s"])
        theta = row["theta_bytes"]
        assert row["limit_per_s"] == pytest.approx(row["servers"] * row["rate_mbit"] * 1e6 / 8 / theta)
    assert [(r["servers"], r["duplex"]) for r in rows] == [(2, "full")]
    assert "S = 2, half duplex: skipped, the engine refuses it: engine.servers=2" in run["stdout"]


def test_multihost_half_duplex_limit_is_half_the_link_less_the_bucket_in_flight():
    """The smoke runs full duplex only (one run: its hosts' interpreters are most of this file's time), so the half
    duplex limit is checked here: a commit's two transfers take turns on the link, except for what tbf's bucket lets
    through at once; a θ the bucket holds whole crosses as fast as in full duplex."""
    multihost = runpy.run_path(str(ROOT / "benchmarks" / "multihost.py"))  # its functions, not its __main__
    link_limit, bucket = multihost["link_limit"], multihost["bucket_bytes"](1000)
    rate = 1000e6 / 8
    theta = 30_000_000  # AlexNet's θ, many buckets
    assert link_limit(1000, theta, 1, "full") == pytest.approx(rate / theta)
    assert link_limit(1000, theta, 1, "half") == pytest.approx(rate / (2 * (theta - bucket)))
    assert link_limit(1000, theta, 2, "half") == pytest.approx(rate / (2 * (theta / 2 - bucket)))
    assert link_limit(1000, bucket // 2, 1, "half") == link_limit(1000, bucket // 2, 1, "full")
