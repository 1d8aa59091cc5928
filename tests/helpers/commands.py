"""`python run.py <args>` as the tests run it, what its preflight refuses, and a folder's files (to see that a
refused command touched nothing)."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from . import warm_run
from .paths import ROOT


def run_py(*args, timeout=300, **kw):
    """`python run.py <args>` from the warm server (tests/helpers/warm_run.py); a fresh interpreter where a test gives
    subprocess.run's own arguments (preexec_fn)."""
    if kw:
        return subprocess.run(
            [sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw
        )
    return warm_run.run_py(*args, timeout=timeout)


def snapshot(d: Path) -> dict:
    """Every file under `d`, by content and modification time: equal snapshots mean nothing was touched."""
    return {
        str(p.relative_to(d)): (hashlib.sha1(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def refused_line(capsys, *argv) -> str:
    """What `python run.py <argv>` says before Hydra starts (run.py's preflight, in this process): exit code 2
    and one line."""
    from experiments.command import preflight

    with pytest.raises(SystemExit) as e:
        preflight(list(argv))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]
