"""The processes a run starts, as /proc shows them: for tests that kill workers or check none is left behind; and a
stranger, a process that connects to a run's port and says when it is cut off."""

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path


def processes() -> dict[int, tuple[int, str, str]]:
    """pid → (parent pid, state, command line) of every process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(d.name)] = (int(fields[1]), fields[0], cmd)
    return out


def workers_of(pid) -> list[int]:
    """The worker processes of the run whose coordinator is pid: the children of its forkserver (or children of
    its own that run spawn_main, where workers are spawned); the forkserver and resource tracker are left out."""
    table = processes()
    servers = {p for p, (ppid, _, cmd) in table.items() if ppid == pid and "forkserver" in cmd}
    return sorted(
        p
        for p, (ppid, state, cmd) in table.items()
        if state != "Z" and (ppid in servers or (ppid == pid and "spawn_main" in cmd))
    )


def descendants(pid) -> list[int]:
    """Every live process below pid: workers, their forkserver, the resource tracker."""
    table, out, todo = processes(), [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (ppid, state, _) in table.items() if ppid == parent and state != "Z"]
        out += kids
        todo += kids
    return sorted(out)


def in_session(sid: int) -> list[int]:
    """Every live process of session `sid` (a run started in a session of its own: its pid), those its processes
    started included, also once their parent has gone."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else []
        except OSError:
            continue
        if fields and fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(d.name))
    return sorted(out)


def is_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def mentioning(text: str) -> list[int]:
    """Every live process whose command line or environment holds `text` (a folder, say): what a launcher started
    for it, and what those started, which inherit the environment."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if not is_alive(int(d.name)):
                continue
            found = text.encode() in (d / "cmdline").read_bytes() or text.encode() in (d / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if found:
            out.append(int(d.name))
    return sorted(out)


_STRANGER = """import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("{}:{}".format(*s.getsockname()), flush=True)
print("end of file" if s.recv(1) == b"" else "data", flush=True)
"""


def stranger(port: int) -> tuple[subprocess.Popen, str]:
    """Another process connected to `port` on loopback, and its end as it sees it ("127.0.0.1:<port>")."""
    p = subprocess.Popen([sys.executable, "-c", _STRANGER, str(port)], stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def is_cut(p: subprocess.Popen, timeout: float = 5.0) -> bool:
    """Whether the stranger `p` reads end of file on its connection within `timeout` seconds."""
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        return bool(sel.select(timeout)) and p.stdout.readline().strip() == "end of file"


def _freeze_inside_meta(turn, named: bool) -> None:
    if named:
        while not turn._take(1.0):
            pass
    else:  # as if stopped between taking meta and writing its pid
        turn.meta.acquire()
    os.kill(os.getpid(), signal.SIGSTOP)


def frozen_inside_meta(ctx, turn, named: bool = True):
    """A participant's process (gem.engines.turn.Turn) that takes the turn's `meta` as every participant does and
    freezes there (`named`: after it has written its pid, else before); returned once it is frozen holding it.
    The caller kills it."""
    p = ctx.Process(target=_freeze_inside_meta, args=(turn, named), daemon=True)
    p.start()
    deadline = time.monotonic() + 60
    while not (is_stopped(p.pid) and (turn.meta_pid.value == p.pid or not named)):
        if time.monotonic() > deadline or not p.is_alive():
            p.kill()
            raise AssertionError("the child never took meta")
        time.sleep(0.05)
    return p


def stopped_process(ctx):
    """A process that stops itself at once (and holds nothing); the caller kills it."""
    p = ctx.Process(target=_stop_self, daemon=True)
    p.start()
    deadline = time.monotonic() + 60
    while not is_stopped(p.pid):
        if time.monotonic() > deadline or not p.is_alive():
            p.kill()
            raise AssertionError("the child never stopped")
        time.sleep(0.05)
    return p


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def is_stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def hold_meta_for(turn, pid: int, named: bool = True) -> None:
    """Make stopped process `pid` the holder of the turn's `meta`, as if it had frozen inside it: taken on its
    behalf (`named`: with its pid written, else as if it froze before writing it, where the engine tells who froze
    by who is stopped: gem.engines.turn.Turn.peek), or held by it already, either way."""
    if turn.meta.acquire(timeout=2.0):
        turn.meta_pid.value = pid if named else 0
    else:
        assert turn.meta_pid.value in (pid, 0), turn.meta_pid.value
