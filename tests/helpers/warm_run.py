"""`python run.py <args>` for the tests, started without importing torch again: `run_py` and `Popen` below.

Every new Python process that imports torch spends about 2.4 s of CPU on it, and the suite is CPU-bound on its 2
cores: close to half of its CPU went to the 150 interpreters it started importing torch. So a test process starts
one server (this file, run as a script) that imports torch, Hydra, pandas and gem once, and forks a process for each
`run_py` or `Popen`. That process becomes `python run.py <args>` as typed: its own pid (a new session if asked),
working directory, environment, argv, stdin from /dev/null and stdout and stderr to files; run.py runs as `__main__`
(its worker processes import it by path, as they do under a fresh interpreter); it ends as an interpreter ends
(atexit handlers, exit code, a traceback and 1 on an uncaught exception). A signal sent to its pid (or its group, in
a new session) reaches it as it would reach `python run.py`.

What differs from a fresh interpreter (test_config checks that both answer a refused command alike; the tests that
limit a run's file sizes, and those under torchrun, start a fresh one):
- the modules above are imported before run.py runs (run.py imports them itself, in its `__main__` guard), with
  what gem.engines.preload does on import (every algorithm loaded, GEM's loops compiled, the collector frozen);
- what an interpreter or a module reads from the environment when it starts (PYTHONPATH, PYTHONWARNINGS,
  OMP_NUM_THREADS, NUMBA_*) is the server's: the environment of the test that started it. Each run gets the test's
  own environment in os.environ;
- warnings shown while the server imported are not shown again, and a traceback has runpy's frames on top;
- /proc/<pid>/cmdline of the run reads `python tests/helpers/warm_run.py`, not its arguments;
- numpy's OpenBLAS has one thread, as in gem's worker processes (gem.engines.preload), and pyarrow's allocator
  returns freed memory as it goes rather than on a thread of its own;
- Python's hash seed is the server's, the same for every run it starts.

The server forks as gem's forkserver does: it has imported nothing that starts a thread, and checks that it runs
one thread before it serves."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the checkout (not helpers.paths: the server runs this file as a script, where `helpers` is not importable)
ROOT = Path(__file__).resolve().parents[2]

PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL


class _Server:
    """This test process's server: requests on its stdin; on its stdout `started` (each request's pid, in order)
    and `exited` (a pid and its exit code, as they end)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, stdin=PIPE, stdout=PIPE)
        self.pending = b""  # read from the pipe beyond the last whole line
        self.started: list[int] = []
        self.exits: dict[int, int] = {}
        self.ready = False
        self.files = tempfile.mkdtemp(prefix="warm_run_")  # the runs' stdout and stderr
        atexit.register(self.stop)
        deadline = time.monotonic() + 300
        while not self.ready:
            if not self.read(deadline - time.monotonic()):
                self.proc.kill()
                raise RuntimeError("the warm run.py server did not start within 300 s")

    def read(self, timeout: float) -> bool:
        """Take in what the server says within `timeout` seconds; False if it said nothing. Read from the pipe's
        descriptor itself: a buffered reader could hold a line where select() cannot see it."""
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0))
        if not ready:
            return False
        chunk = os.read(self.proc.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"the warm run.py server exited (code {self.proc.wait()})")
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            said = json.loads(line)
            if "error" in said:
                raise RuntimeError(f"the warm run.py server: {said['error']}")
            self.ready = self.ready or "ready" in said
            if "started" in said:  # a new process: an exit recorded under the same pid was an earlier one's
                self.exits.pop(said["started"], None)
                self.started.append(said["started"])
            if "exited" in said:
                self.exits[said["exited"]] = said["rc"]
        return True

    def start(self, request: dict) -> int:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 60
        while not self.started:
            if not self.read(deadline - time.monotonic()):
                raise RuntimeError("the warm run.py server did not fork within 60 s")
        return self.started.pop(0)

    def stop(self) -> None:
        """The server ends at the end of its input; killed if it has not within 10 s."""
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.files, ignore_errors=True)


_server: _Server | None = None


def _the_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server


class Popen:
    """`subprocess.Popen([sys.executable, script, *args], cwd=cwd, env=env, stdout=..., stderr=..., text=True,
    start_new_session=...)` for a process forked from the warm server: pid, poll, wait, send_signal, terminate,
    kill, communicate and returncode as subprocess's. stdout and stderr are PIPE (read by communicate) or
    DEVNULL."""

    def __init__(
        self,
        args,
        cwd: Path | str = ROOT,
        env: dict | None = None,
        stdout=PIPE,
        stderr=PIPE,
        start_new_session: bool = False,
        script: str = "run.py",
    ):
        self.server = _the_server()
        self.args = [sys.executable, script, *args]
        self.returncode: int | None = None
        # PIPE: a named pipe, read to its end as subprocess reads a pipe: until every process that holds it (the
        # run, and the forkserver and resource tracker it starts) has closed it
        names, self._pipes, self._read = {}, {}, {}
        for stream, how in (("stdout", stdout), ("stderr", stderr)):
            names[stream] = os.devnull
            if how == PIPE:
                names[stream] = tempfile.mktemp(prefix=f"{stream}_", dir=self.server.files)  # in our own folder
                os.mkfifo(names[stream])
                self._pipes[stream] = os.open(names[stream], os.O_RDONLY | os.O_NONBLOCK)
                self._read[stream] = []
        self._names = names
        self.pid = self.server.start(
            {
                "script": script,
                "argv": list(args),
                "cwd": str(cwd),
                "env": dict(os.environ if env is None else env),
                "session": start_new_session,
                **names,
            }
        )

    def poll(self) -> int | None:
        while self.server.read(0):  # everything the server has said so far
            pass
        if self.returncode is None and self.pid in self.server.exits:
            self.returncode = self.server.exits.pop(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.read(min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            self.poll()
        except RuntimeError:  # the server is gone (Ctrl-C): signal the run all the same
            pass
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended, and reaped by the server, a moment ago
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """What the run wrote, once every holder of its pipes has closed them, and the run has exited."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pipes:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            ready, _, _ = select.select(list(self._pipes.values()), [], [], left)
            for stream, fd in list(self._pipes.items()):
                if fd in ready:
                    chunk = os.read(fd, 65536)
                    self._read[stream].append(chunk)
                    if not chunk:  # no writer left
                        os.close(self._pipes.pop(stream))
                        os.unlink(self._names[stream])
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        return tuple(b"".join(self._read[s]).decode() if s in self._read else None for s in ("stdout", "stderr"))

    def __del__(self):  # a run whose output nobody read (killed, say): its pipes' ends here
        for fd in getattr(self, "_pipes", {}).values():
            os.close(fd)


def run_py(
    *args: str, timeout: float = 300, env: dict | None = None, cwd: Path | str = ROOT, script: str = "run.py"
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)` from the warm server. On timeout the run is killed, and subprocess.TimeoutExpired raised,
    as subprocess.run does."""
    p = Popen(args, cwd=cwd, env=env, script=script)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(60)
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _say(what: dict) -> None:
    print(json.dumps(what), flush=True)


def _serve() -> dict:
    """Fork a process for each request on stdin; in the server, say its pid, then its exit code when it ends.
    Returns (in the forked process only) the request that process runs."""
    pending, running = b"", {}  # pid: whether it leads a session of its own
    while True:
        # a run's end is seen within 50 ms: the server polls while any runs
        readable, _, _ = select.select([0], [], [], 0.05 if running else None)
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[pid]
                _say({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the test process is gone (ended, or interrupted): so are the runs it started
            for pid, session in running.items():
                with contextlib.suppress(ProcessLookupError):
                    (os.killpg if session else os.kill)(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            sys.exit(0)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            request = json.loads(line)
            # the run's stdout and stderr, opened here so that they are open when the test reads them
            request["fds"] = [os.open(request[s], os.O_WRONLY) for s in ("stdout", "stderr")]
            pid = os.fork()
            if pid == 0:
                return request
            for fd in request["fds"]:
                os.close(fd)
            running[pid] = request["session"]
            _say({"started": pid})


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # as for `python run.py` in ROOT: gem and experiments import from the checkout
    # pyarrow's allocator (jemalloc) starts a thread to return freed memory in the background, unless told not to
    os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
    import gem.engines.preload  # noqa: F401 - first: torch, numpy (one OpenBLAS thread), gem's engines, algorithms

    # isort: split
    import hydra  # noqa: F401
    import hydra.main  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import experiments.command  # noqa: F401 - everything run.py imports: the checks, the runner, pandas

    if gem.engines.preload.threads() != 1:
        _say({"error": f"{gem.engines.preload.threads()} threads after the imports; a fork could hang"})
        sys.exit(1)
    # Ctrl-C in the terminal reaches the server too: it outlives the test process by a moment, to end the runs
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    _say({"ready": 1})
    request = _serve()
    # this is now the forked process: become `python <script> <argv>`
    signal.signal(signal.SIGINT, interrupt)  # what an interpreter started by the test process has
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, f in zip((0, 1, 2), (os.open(os.devnull, os.O_RDONLY), *request["fds"]), strict=True):
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
    script = Path(request["script"]).absolute()  # relative to the run's working directory, set above
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = str(script.parent)
    import runpy

    runpy.run_path(str(script), run_name="__main__")
