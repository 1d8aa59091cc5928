import os
import signal
import sys

import pytest

# pytest rewrites the asserts of test modules only: the helpers' (check_run_dir's, say) report their values too,
# as they did when the helpers were test modules. Registered before any helper is imported.
pytest.register_assert_rewrite("helpers")

from helpers.paths import ROOT, SHARED_DATA  # noqa: E402

# One torch thread in every test process and every process a test starts (they inherit it). The suite runs its
# tests side by side (pytest-xdist, pyproject.toml), and torch's threads spin while they wait for work: a run of two
# threads per process took 15 s beside another run where it takes 6 s with one. Tests check behaviour, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(ROOT))

# Ctrl-C at its default in every test process, and so in every process a test starts. A shell ignores it for a job
# it runs in the background (`pytest &` in a script, `nohup pytest &`), an ignored signal stays ignored across exec,
# and Python then installs no handler for it: every run.py the Ctrl-C tests started ignored their Ctrl-C, and they
# failed after 180 s, except on a test process where the notebook test (whose Jupyter client sets Ctrl-C's handler)
# had run first. A run started so ignores Ctrl-C as it should; a terminal's Ctrl-C is what these tests are about.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if hasattr(signal, "pthread_sigmask"):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture
def mnist_root():
    if not (SHARED_DATA / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        pytest.skip(f"real MNIST digits not found in {SHARED_DATA}/MNIST/raw (set GEM_SHARED_DATA to their root)")
    return str(SHARED_DATA)


@pytest.fixture(autouse=True)
def _no_wandb_network(monkeypatch):
    # Tests never talk to W&B servers, whatever the developer's environment says.
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
