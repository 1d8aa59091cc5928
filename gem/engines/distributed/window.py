"""θ in shared memory for the workers on rank 0's own host (`engine.shared_memory`, on by default).

Over the wire a commit moves θ and the server's tensors out and Δ back, two model-sized messages under the server's
turn, which holds every other worker meanwhile: on one machine that copying through loopback TCP was a large part
of what made `distributed` slower than `process` (BENCHMARKS.md). A worker on rank 0's host need not copy through a
socket. Rank 0 keeps θ and the server's tensors in a file in /dev/shm that such a worker maps, with one slot there per
worker for its Δ. Under its turn the worker copies θ and the tensors from the window into its replica and writes Δ
into its slot; only the headers (and a payload, for the algorithms that have one) travel. So the exchange, the
server step, τ and every row are those of the wire; only where the bytes lie differs.

Rank 0 stays the only writer of θ: a worker maps θ and the server's tensors read-only and only its own slot
writable, and rank 0 copies a slot into memory of its own before it applies it. So a worker harms no more through
its slot than with the Δ it sends over the wire, and a worker lost while frozen, woken later, writes only into its
own slot.

A local launch's workers (rank 0's own children, trusted as a `process` engine's workers are) go further: they pass
the server's turn among themselves (gem.engines.turn) and run the server step in place on θ here, so no thread of
another process needs waking inside a commit. Their window (`turn`) has no slots: the clock and the pull times are
here too, every worker maps it all writable, and the holder of the turn notes in the commit log who made commit t
(`log[t % len(log)]`, with t), which rank 0 reads to know whose rows to expect (server_turn.TurnServer.read_log).
Where every one of them computes on one and the same GPU, θ and the server's tensors live on that GPU instead, shared
by CUDA IPC as on engine=process (`engine.theta_on_gpu`, launch.py), and the window holds only the clock, the pull
times and the log.

A PULL at a barrier (no commit follows, and rank 0 goes on serving the others) still sends θ over the wire: θ as of
the clock the worker is told.

Which workers share rank 0's host: those that can open the file the job names and find in it the nonce the job
names. A worker opens only a file of this module's name pattern in /dev/shm, owned by its own user: the job cannot
make it write anywhere else. The space is reserved when the file is made (a write to a full /dev/shm would kill
the writer with SIGBUS); where it cannot be, every worker uses the wire. The file is removed once every worker has
said READY (the mappings stay), and when rank 0 ends; one left by a rank 0 that was killed before is removed by the
next run on the host (its pid is in its name).
"""

from __future__ import annotations

import hmac
import mmap
import os
import re
import secrets
import stat
import sys
import warnings
from pathlib import Path

import torch

from gem.engines.server import Server

SHM = Path("/dev/shm")
PREFIX = "gem-theta-"
NAME = re.compile(rf"{PREFIX}(\d{{1,10}})-[0-9a-f]{{16}}")  # gem-theta-<rank 0's pid>-<random>
NONCE_BYTES = 32  # the file's own random first bytes, which the job names: a worker maps only its run's window
# (not the admission's challenge, secret.NONCE_BYTES, though of the same size)
PAGE = mmap.ALLOCATIONGRANULARITY  # every part starts on a page: a worker maps its own slot alone, writable
LOG = 1 << 17  # the commit log's entries (at least; 64 per worker), a ring. Rank 0 reads it at each ROWS header,
# and a worker whose rows rank 0 has not taken waits for it after 16 more commits: at most about 33 x n commits come
# between two reads.
# An entry is t x LOG_WORKERS + w (`log_entry`): rank 0 reads commit t's only once it says t, whatever order
# another core makes the worker's stores visible in
LOG_WORKERS = 1 << 24


def log_entry(t: int, w: int) -> int:
    return t * LOG_WORKERS + w


def _layout(
    server: Server, slots: int, turn: bool, theta: bool = True
) -> tuple[list[tuple[str, int, torch.Tensor]], int]:
    """(name, byte offset, a tensor of its dtype and shape) for θ and each server tensor (`theta`: not where they
    live on the workers' GPU), the clock and the pull times, then (`turn`) the commit log or each worker's slot, and
    the size in all: the same on rank 0 and on a worker, from the same algorithm and model. The nonce is on the
    first page."""
    items = [("theta", server.theta), *((f"state.{k}", v) for k, v in server.state.items())] if theta else []
    items += [("clock", server.clock), ("pulled_at", server.pulled_at)]
    if turn:
        items.append(("log", torch.empty(max(LOG, 64 * slots), dtype=torch.int64)))
    else:
        items += [(f"slot.{w}", server.theta) for w in range(slots)]
    out, at = [], PAGE
    for name, like in items:
        out.append((name, at, like))
        at += -(-like.nbytes // PAGE) * PAGE
    return out, at


def _view(mm, like: torch.Tensor, at: int) -> torch.Tensor:
    if not like.numel():  # nothing to share (frombuffer refuses an empty view)
        return torch.empty_like(like, device="cpu")
    with warnings.catch_warnings():  # a worker's θ is a read-only mapping: it only ever reads it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=like.dtype, count=like.numel(), offset=at).view(like.shape)


class Window:
    """The mapped file: `theta`, `state` (the server's tensors, by name) and `slot(w)`, worker w's Δ (a worker
    has only its own); `slots`, how many workers have one. `views`: name → tensor, named as in _layout."""

    def __init__(
        self, path: Path, views: dict[str, torch.Tensor], nonce: bytes, slots: int, owner: bool, turn: bool = False
    ):
        self.path, self.nonce, self.slots, self.owner, self.turn = path, nonce, slots, owner, turn
        # θ: None where θ and the server's tensors live on the workers' GPU instead (`create`)
        self.theta, self.clock, self.pulled_at = views.get("theta"), views["clock"], views["pulled_at"]
        self.log = views.get("log")  # (turn) who made each commit, by its clock: log[t % len(log)]
        self.state = {k.removeprefix("state."): v for k, v in views.items() if k.startswith("state.")}
        self._slots = {int(k.removeprefix("slot.")): v for k, v in views.items() if k.startswith("slot.")}

    def slot(self, w: int) -> torch.Tensor:
        return self._slots[w]

    # --- rank 0

    @classmethod
    def create(cls, server: Server, slots: int, turn: bool = False, theta: bool = True) -> Window | None:
        """A window holding the server's θ and tensors (their values copied in), with `slots` Δ slots: workers 0 to
        slots − 1 may map it; or (`turn`: a local launch) with the commit log instead, every worker mapping it all
        writable, and (`theta=False`) without θ and the server's tensors, which then live on the workers' GPU,
        shared by CUDA IPC (launch.py). None where there is no /dev/shm, or no room in it (every worker then uses
        the wire)."""
        if slots < 1 or (theta or not turn) and server.theta.device.type != "cpu":
            return None
        if not SHM.is_dir():
            return _no_window(f"this host has no {SHM}")
        _remove_stale()
        layout, size = _layout(server, slots, turn, theta)
        path = SHM / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            return _no_window(f"cannot make {path} ({e.strerror})")
        try:
            os.posix_fallocate(fd, 0, size)  # the space now or never: a write past a full /dev/shm is SIGBUS
            mm = mmap.mmap(fd, size)
            nonce = secrets.token_bytes(NONCE_BYTES)
            mm[:NONCE_BYTES] = nonce
            views = {name: _view(mm, like, at) for name, at, like in layout}
        except (OSError, ValueError, RuntimeError) as e:
            path.unlink(missing_ok=True)
            if isinstance(e, OSError):
                return _no_window(f"no room for θ in {SHM} ({size / 2**20:.0f} MiB: {e.strerror})")
            return _no_window(f"cannot keep θ in {SHM} ({type(e).__name__}: {e})")
        finally:
            os.close(fd)
        window = cls(path, views, nonce, slots, owner=True, turn=turn)
        if theta:
            window.theta.copy_(server.theta)
            for k, v in server.state.items():
                window.state[k].copy_(v)
        window.clock.copy_(server.clock)
        window.pulled_at.copy_(server.pulled_at)
        if window.log is not None:
            window.log.fill_(-1)  # no commit's entry (a zero would be commit 0's, by worker 0)
        return window

    def adopt(self, server: Server) -> Server:
        """The same server, its clock and pull times now the window's, and its θ and tensors too where the window
        holds them (else the server's own: on the workers' GPU)."""
        theta, state = (server.theta, server.state) if self.theta is None else (self.theta, self.state)
        return Server(server.algo, server.hp, theta, state, self.clock, self.pulled_at)

    def described(self) -> dict:
        """What the job tells the workers: where the window is, how to know it is rank 0's, who has a slot, whether
        θ is in it."""
        return {
            "path": str(self.path),
            "nonce": self.nonce.hex(),
            "slots": self.slots,
            "turn": self.turn,
            "theta": self.theta is not None,
        }

    def unlink(self) -> None:
        """Remove the file: the mappings stay, no one else can open it."""
        if self.owner:
            self.path.unlink(missing_ok=True)

    # --- a worker

    @classmethod
    def open(cls, described: dict | None, w: int, replica: Server, writable: bool = False) -> Window | None:
        """Worker w's view of rank 0's window: θ and the server's tensors read-only (`writable`: a worker of a local
        launch, which takes its turn here and applies its own commits), its own slot writable. None where it cannot
        have one (another host, no slot for it, the file gone or not what the job says): it then uses the wire (a
        local launch's worker, which has no exchange to fall back on, says why and is lost)."""
        workers = replica.pulled_at.numel()
        if (
            not isinstance(described, dict)
            or type(described.get("slots")) is not int
            or not 0 <= w < described["slots"] <= workers
        ):
            return None
        path, nonce = Path(str(described.get("path", ""))), str(described.get("nonce", ""))
        theta = described.get("theta", True)
        if (
            path.parent != SHM
            or not NAME.fullmatch(path.name)
            or not re.fullmatch(f"[0-9a-f]{{{2 * NONCE_BYTES}}}", nonce)
            or (described.get("turn") is True) != writable
            or type(theta) is not bool
            or not (theta or writable)
        ):
            return None
        layout, size = _layout(replica, described["slots"], writable, theta)
        parts = {name: (at, like) for name, at, like in layout}
        at, like = parts.get(f"slot.{w}", (0, None))  # its slot (none with the turn: it writes θ itself)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None  # not on rank 0's host (or removed already: a worker that came too late)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size != size or not stat.S_ISREG(st.st_mode):
                return None
            shared_end = size if writable else parts["slot.0"][0]  # θ and the server's tensors: read-only
            ro = mmap.mmap(fd, shared_end, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
            rw = None if writable else mmap.mmap(fd, -(-like.nbytes // PAGE) * PAGE, offset=at)
        except OSError:
            return None
        finally:
            os.close(fd)
        if not hmac.compare_digest(bytes(ro[:NONCE_BYTES]), bytes.fromhex(nonce)):
            return None
        views = {name: _view(ro, lk, a) for name, (a, lk) in parts.items() if not name.startswith("slot.")}
        if rw is not None:
            views[f"slot.{w}"] = _view(rw, like, 0)
        return cls(path, views, bytes.fromhex(nonce), described["slots"], owner=False, turn=writable)


def _no_window(why: str) -> None:
    print(f"gem: {why}; the workers on this host use the wire", file=sys.stderr)
    return None


def _remove_stale() -> None:
    """Windows of this user left by a rank 0 that is gone (killed before it could remove its own). Another user's,
    and anything that is not a plain file, are left as they are."""
    try:
        names = [p for p in SHM.iterdir() if NAME.fullmatch(p.name)]
    except OSError:
        return
    for p in names:
        try:
            st = p.lstat()
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                continue
            os.kill(int(NAME.fullmatch(p.name).group(1)), 0)
        except ProcessLookupError:
            try:
                p.unlink()
            except OSError:
                pass
        except (OSError, OverflowError, ValueError):
            continue  # alive (another user's process), or gone meanwhile
