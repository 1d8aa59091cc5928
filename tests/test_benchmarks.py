"""Every benchmark script runs to its end, briefly: a change cannot break one unseen (issue 26). Their numbers are
not checked here (they mean nothing at these sizes); BENCHMARKS.md records the real runs."""

import subprocess
import sys

import pytest
from conftest import ROOT, SHARED_DATA

DATA = SHARED_DATA  # the scripts fall back to the embedded digits where MNIST is absent; data_loading needs MNIST
MNIST = DATA / "MNIST" / "raw" / "train-images-idx3-ubyte"

SCRIPTS = {  # script: arguments that make it brief
    "data_loading.py": ["--root", str(DATA), "--rounds", "1", "--smoke"],
    "distributed_engine.py": ["--root", str(DATA), "--workers", "2", "--epochs", "1", "--rounds", "1", "--smoke"],
    "gem_commit.py": ["--root", str(DATA), "--commits", "4", "--reps", "2", "--smoke"],
    "gpu.py": ["--device", "cpu", "--steps", "2", "--smoke"],
    "multihost.py": ["--smoke"],  # says it skipped, and exits 0, where network namespaces cannot be made
    "process_engine.py": ["--root", str(DATA), "--workers", "1", "--epochs", "1", "--rounds", "1", "--smoke"],
    "sim_commit.py": ["--root", str(DATA), "--workers", "2", "--epochs", "1", "--rounds", "1", "--threads", "1",
                      "--smoke"],
    "transport.py": ["--workers", "1", "--seconds", "0.2", "--rounds", "1"],
    "worker_memory.py": ["--workers", "2", "--wait", "0.5", "--smoke"],
}


def test_every_benchmark_script_is_listed():
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py") == \
        sorted(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_runs_to_its_end(script):
    if script == "data_loading.py" and not MNIST.exists():
        pytest.skip(f"needs the MNIST files in {MNIST.parent}")
    r = subprocess.run([sys.executable, f"benchmarks/{script}", *SCRIPTS[script]], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "it printed nothing"
