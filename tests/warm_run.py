"""`python run.py <args>` for the tests, started without importing torch again: `run_py` below.

Every new Python process that imports torch spends about 2.4 s of CPU on it, and the suite is CPU-bound on its 2
cores: a third of its CPU went to interpreters importing torch. So a test process starts one server (this file, run
as a script) that imports torch, numpy, Hydra and gem once, and forks a process for each `run_py`. That process
becomes `python run.py <args>` as typed: its own pid, working directory, environment, argv, stdin from /dev/null and
stdout and stderr to files; run.py runs as `__main__` (its worker processes import it by path, as they do under a
fresh interpreter); it ends as an interpreter ends (atexit handlers, exit code, a traceback and 1 on an uncaught
exception).

What differs from a fresh interpreter (the tests that send a run a signal, kill it, limit its files or launch it
under torchrun start a fresh one, and test_config checks that both answer a refused command alike):
- the modules above are imported before run.py runs (run.py imports them itself, in its `__main__` guard);
- numpy's OpenBLAS has one thread, as in gem's worker processes (gem.engines.preload);
- Python's hash seed is the server's, the same for every run it starts.

The server forks as gem's forkserver does: it has imported nothing that starts a thread (no pandas, no pyarrow:
run.py imports those), and checks that it runs one thread before it serves.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_server: subprocess.Popen | None = None
_pending = b""  # what the server wrote beyond the last line read


def _start() -> subprocess.Popen:
    global _server, _pending
    if _server is None or _server.poll() is not None:
        _server, _pending = subprocess.Popen([sys.executable, __file__], cwd=ROOT, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE), b""
        atexit.register(_stop, _server)
        ready = _reply(_server, 300)
        if ready != {"ready": 1}:
            raise RuntimeError(f"the warm run.py server did not start: {ready}")
    return _server


def _stop(server: subprocess.Popen) -> None:
    """The server ends at end of input; killed if it has not within 10 s."""
    server.stdin.close()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _reply(server: subprocess.Popen, timeout: float) -> dict | None:
    """The server's next line, or None if none came within `timeout` seconds. Read from the pipe's descriptor
    itself: a buffered reader could hold the next line where select() cannot see it."""
    global _pending
    deadline = time.monotonic() + timeout
    while b"\n" not in _pending:
        ready, _, _ = select.select([server.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            return None
        chunk = os.read(server.stdout.fileno(), 4096)
        if not chunk:
            raise RuntimeError(f"the warm run.py server exited (code {server.wait()})")
        _pending += chunk
    line, _pending = _pending.split(b"\n", 1)
    return json.loads(line)


def run_py(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | str = ROOT,
           script: str = "run.py") -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)`, in a process forked from the warm server. On timeout the run is killed, and
    subprocess.TimeoutExpired raised, as subprocess.run does."""
    server = _start()
    with tempfile.TemporaryDirectory(prefix="warm_run_") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        server.stdin.write(json.dumps({"script": script, "argv": list(args), "cwd": str(cwd),
                                       "env": dict(os.environ if env is None else env), "stdout": str(out),
                                       "stderr": str(err)}).encode() + b"\n")
        server.stdin.flush()
        pid = _reply(server, 60)["pid"]
        done = _reply(server, timeout)
        if done is None:  # too long: kill it, as subprocess.run does, and collect its exit
            os.kill(pid, 9)
            _reply(server, 60)
        argv = [sys.executable, script, *args]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if done is None:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(argv, done["rc"], stdout, stderr)


def _serve() -> dict:
    """Fork a process for each request on stdin; in the server, reply its pid, then its exit code. Returns (in the
    forked process only) the request that process runs."""
    while True:
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # as for `python run.py` in ROOT: gem and experiments import from the checkout
    import hydra  # noqa: F401
    import hydra.main  # noqa: F401

    import experiments.config  # noqa: F401 - the schema and validation (not experiments.command: it imports pandas)
    import experiments.plan  # noqa: F401
    import experiments.rundir  # noqa: F401
    import gem.engines.preload  # noqa: F401 - torch, numpy (one OpenBLAS thread), gem's engines and algorithms

    if len(os.listdir("/proc/self/task")) != 1:
        print(json.dumps({"error": f"{len(os.listdir('/proc/self/task'))} threads after the imports"}), flush=True)
        sys.exit(1)
    print(json.dumps({"ready": 1}), flush=True)
    request = _serve()
    # this is now the forked process: become `python <script> <argv>`
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
    script = Path(request["script"]).absolute()  # relative to the run's working directory, set above
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = str(script.parent)
    import runpy

    runpy.run_path(str(script), run_name="__main__")
