"""Rank 0's parameter server: a thread that takes the workers' headers in the order they arrive, and tells the
coordinator (rank 0's main thread, gem.engines.distributed.launch) what happened through a queue of events. This
module holds what every transport shares: the events, where each worker stands (`Peer`), the checkpoint barrier
and the answers (`ParameterServer`). A transport says what a turn at the server is: server_wire.py (each commit an
exchange over the wire) or server_turn.py (a local launch's workers pass the turn among themselves in shared
memory); `placement.Placement.local_turn` chooses.

For a checkpoint the server stops handing out turns: each worker, when it next asks, is answered SAVE and sends its
state (the run directory is rank 0's, perhaps on another machine); asking again, it is told to WAIT and asks again
shortly, until every live worker has sent its state, the coordinator has written the checkpoint, and turns are
handed out again. (A worker is not left waiting on a reply: the server would wait on it while others ask.) A worker
lost mid-exchange, or between two (its connection closes), is recorded and the run goes on: its commits whose rows
never came are marked (`lost_row`).

Headers are taken first come, first served by a thread per worker (headers.Headers), each blocked in a receive from
its own rank, which hands what it gets to the server in arrival order.

A worker is held to what the server expects of it (bounds.Bounds): a header's kind must be one it may send now (SAVED
only while a checkpoint is taken, and only from a worker told SAVE; READY once), and every size it announces must
be within the bounds before anything that follows is received; a commit's payload must be exactly the algorithm's;
its rows are checked by the coordinator, which decodes them. A worker that sends anything else is lost for what it
sent, and banned: the server reads nothing more it sends (its unread messages stay with gloo, addressed from its
rank, where no receive will ever take them) and answers it nothing, so that a peer that breaks the protocol cannot
make the server wait on it either.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import time
from collections import deque

import torch

from gem.engines import Job
from gem.engines import checkpoint as ckpt
from gem.engines.coordinator import POLL_S
from gem.engines.distributed.bounds import ROWS_PENDING, Bounds
from gem.engines.distributed.group import patience
from gem.engines.distributed.headers import Headers
from gem.engines.distributed.messages import (
    ASK,
    BYE,
    DIVERGED,
    ERROR,
    FINISHED,
    GO,
    PULL,
    READY,
    SAVE,
    SAVED,
    STOP,
    TAG_X,
    WAIT,
    Malformed,
    connection_closed,
    recv_bytes,
    recv_tensors,
    wait,
)
from gem.engines.distributed.window import Window
from gem.engines.server import Server
from gem.engines.worker import START_TIMEOUT_S
from gem.files import WriteError

# ------------------------------------------------------------- what the server thread tells the coordinator
# One value an event, on the `events` queue; the coordinator's `handle` (launch.py) has one case for each.


@dataclasses.dataclass(frozen=True)
class RowsCame:
    """Rank `rank`'s rows for its commits `steps`, as it sent them: the coordinator checks and decodes them."""

    rank: int
    data: bytes
    steps: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
    rank: int


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """A worker's loss or θ is no longer finite: the run stops."""

    rank: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Raised:
    rank: int
    text: str  # the worker's error and its traceback


@dataclasses.dataclass(frozen=True)
class Lost:
    rank: int
    why: str


@dataclasses.dataclass(frozen=True)
class StatesSaved:
    """Every live worker's state is in `folder`, θ as of clock `t`: the coordinator writes the checkpoint, then sets
    `written`, and the server hands out turns again."""

    folder: object
    t: int


@dataclasses.dataclass(frozen=True)
class StepsLost:
    """Commits whose rows will never come (their worker was lost)."""

    steps: list[int]


@dataclasses.dataclass(frozen=True)
class Fatal:
    """The run cannot go on (the server thread failed, or the workers wait at a barrier no commit can reach)."""

    why: str


@dataclasses.dataclass(frozen=True)
class WriteFailed:
    reason: str


@dataclasses.dataclass(frozen=True)
class ServerDone:
    """The server thread has ended."""


# ---------------------------------------------------------------------- a worker, as the server sees it


class Standing(enum.Enum):
    JOINING = "joining"  # admitted; its READY has not come
    WORKING = "working"  # ready: its exchanges are served
    DONE = "done"  # finished, stopped, or its connection closed: the server expects nothing more of it
    LOST = "lost"  # the coordinator recorded it lost: what it still sends is read and dropped, and answered STOP
    BANNED = "banned"  # lost for what it sent: nothing more it sends is read or answered


@dataclasses.dataclass
class Peer:
    """One worker at the server: where it stands, and what the server keeps of it."""

    heard: float  # when its last header came: it asked, it waits
    standing: Standing = Standing.JOINING
    ready: bool = False  # its READY came
    maps_window: bool = False  # it said at READY that it maps θ from rank 0's window: it exchanges only headers
    barrier: int | None = None  # the barrier it last waited at (PULL), until it pulls
    # its commits whose rows have not come; None once the coordinator has lost it (their rows will never come)
    pending: deque | None = dataclasses.field(default_factory=deque)

    @property
    def expected(self) -> bool:
        """The server expects more of it (it has not finished, stopped, gone or been lost)."""
        return self.standing in (Standing.JOINING, Standing.WORKING)


def all_started(peers: dict[int, Peer]) -> bool:
    """Every worker is ready, or expected no more: the race may begin (all start from one θ)."""
    return all(p.ready or not p.expected for p in peers.values())


class ParameterServer(threading.Thread):
    """Rank 0's server thread, whatever the transport: the workers' headers, first come, first served; where each
    worker stands (`peers`); the checkpoint barrier; the answers. What a turn at the server is, the transport
    says: `WireServer` (server_wire.py) serves each commit as an exchange over the wire, `TurnServer`
    (server_turn.py) lets the workers of a local launch pass the turn among themselves in rank 0's window. Talks
    to the coordinator (the main thread) through `events`; `lock` guards the server's state and the bookkeeping."""

    def __init__(
        self,
        pg,
        job: Job,
        server: Server,
        workers: list[int],
        events: queue.Queue,
        bounds: Bounds,
        window: Window | None = None,
    ):
        super().__init__(name="gem-parameter-server", daemon=True)
        self.pg, self.job, self.server, self.events, self.bounds = pg, job, server, events, bounds
        # how long a wait on one worker may last (the coordinator keeps it at group.patience of the silence limit)
        self.wait_s = patience(job.engine.timeout_s)
        self.lock = threading.Lock()
        self.ranks = workers  # ranks 1..n
        self.peers = {r: Peer(heard=time.monotonic()) for r in workers}  # each worker, by rank
        self.commits: list[tuple[int, float]] = []  # (worker, time) of the commits applied since the coordinator looked
        self.stopping = ""  # once set, every ASK is answered STOP
        # a checkpoint being taken: {"folder", "told": ranks told SAVE, "saved": ranks that sent their state}
        self.saving: dict | None = None
        self.written = threading.Event()
        self.window = window  # θ in shared memory (window.py), for the workers on rank 0's host
        self.started = time.monotonic()
        self.busy_s, self.served = 0.0, 0  # seconds spent in exchanges that ended in a commit, and how many
        self.headers: Headers | None = None  # started with the server thread
        self.last_header = time.monotonic()

    # --- what each transport adds

    def step(self, started: bool) -> bool:
        """Before the next header: act on what the loop waits for (`started`: the race may begin); True to look
        again before waiting for a header."""
        return False

    def read_log(self) -> None:
        """(under `lock`) Note the commits made since the last look that this thread did not apply itself."""

    def sync_log(self) -> None:
        """(coordinator) `read_log` now."""
        with self.lock:
            self.read_log()

    def claims(self, src: int, extra: bytes) -> str | None:
        """What `src` said at READY about rank 0's window (`extra`), checked: None if allowed, else what it sent
        that is not (it is banned for it)."""
        raise NotImplementedError

    def on_ask(self, src: int) -> None:
        raise NotImplementedError

    def pull(self, src: int) -> None:
        """A worker at a barrier that the clock has reached: θ and the server's tensors; no commit follows."""
        raise NotImplementedError

    def restore(self, states: dict) -> None:
        """A resumed run, before the thread starts: what the server keeps of each worker's saved state (`states`, by
        rank: its state, DONE or None)."""

    def checkpoint_written(self) -> None:
        """The coordinator has written the checkpoint: θ may change again."""

    def ended(self) -> None:
        """The server thread ends (perhaps failed): let go of whatever the coordinator may wait for."""

    # --- the coordinator's side

    def stop(self, why: str) -> None:
        self.stopping = self.stopping or why

    def lose(self, rank: int, banned: bool = False) -> list[int]:
        """(coordinator) Expect nothing more from `rank` (`banned`: nor read anything it sends); returns its commits
        whose rows will never come."""
        with self.lock:
            self.read_log()  # (its process is gone: its last commits, if it made any here, are noted)
            peer = self.peers[rank]
            if banned or peer.standing is not Standing.BANNED:
                peer.standing = Standing.BANNED if banned else Standing.LOST
            pending, peer.pending = list(peer.pending or ()), None
        if self.headers is not None:  # the server may wait for a header: it sees at once whether the run is over
            self.headers.arrived.put((rank, None))
        return pending

    def open(self) -> bool:
        return any(p.expected for p in self.peers.values())

    def done_before(self, rank: int) -> None:
        """(coordinator) A worker the checkpoint has finished (or lost): nothing is expected of it in this run."""
        peer = self.peers[rank]
        peer.standing, peer.ready = Standing.DONE, True

    def expected_ranks(self) -> set[int]:
        return {r for r, p in self.peers.items() if p.expected}

    def request_save(self, run_dir) -> bool:
        """(coordinator) Stop handing out turns and collect every live worker's state; False while a checkpoint
        is still being taken."""
        with self.lock:
            if self.saving is not None or self.stopping:
                return False
            self.written.clear()
            self.saving = {"folder": ckpt.pending(run_dir), "told": set(), "saved": set()}
        if self.headers is not None:  # wake the server thread (with a turn, it takes it now)
            self.headers.arrived.put((None, None))
        return True

    def settle(self, timeout_s: float) -> None:
        """(rank 0, before it exits) Wait up to `timeout_s` for this thread and the header threads to end, as
        they do once the workers have gone (Headers.join says why that matters)."""
        deadline = time.monotonic() + timeout_s
        if self.ident is not None:  # started
            self.join(timeout_s)
        if self.headers is not None:
            self.headers.join(deadline)

    # --- the thread

    def run(self) -> None:
        try:
            self.serve()
        except WriteError as e:  # a worker's checkpoint file: the disk failed, and the run ends
            self.events.put(WriteFailed(str(e)))
        except Exception as e:  # noqa: BLE001 - the coordinator reports it
            if self.open():  # (else every worker had finished or was lost: nobody waited on what failed)
                self.events.put(Fatal(f"parameter server: {type(e).__name__}: {e}"))
        finally:
            self.ended()
            self.events.put(ServerDone())

    def serve(self) -> None:
        self.headers = Headers(self.pg, self.ranks)
        try:
            self.serve_headers()
        finally:
            self.headers.close()

    def serve_headers(self) -> None:
        while self.open():
            started = all_started(self.peers) or time.monotonic() - self.started > START_TIMEOUT_S
            if self.step(started):
                continue
            if self.saving is not None and self.saving["saved"] >= self.expected_ranks():
                self.finish_checkpoint()
                continue
            src, header = self.next_header()
            if src is None:
                continue
            if header is not None:
                self.take(src, *(int(v) for v in header))
            if self.peers[src].standing is Standing.BANNED:
                self.headers.drop(src)
            elif header is not None:
                self.headers.next(src)

    def finish_checkpoint(self) -> None:
        """Every live worker has sent its state: hand the checkpoint to the coordinator, and hand out no turn
        until it is written."""
        # the clock now, not when the save was asked for: an exchange in flight then has committed since
        self.events.put(StatesSaved(self.saving["folder"], self.server.t))
        while not self.written.wait(POLL_S) and threading.main_thread().is_alive():
            pass  # the coordinator writes the checkpoint; θ must stay as saved until it is on disk
        self.saving = None  # the waiting workers are served as they ask again
        self.checkpoint_written()

    def next_header(self) -> tuple[int, torch.Tensor | None]:
        """(rank, its header): the next header to arrive, first come, first served; (rank, None) when there is
        none to act on: that rank's connection closed (it died: lost, unless the server expected nothing more
        from it), or the coordinator has just lost it (`lose`)."""
        try:
            src, got = self.headers.get(POLL_S)
        except queue.Empty:
            if time.monotonic() - self.last_header > self.wait_s:
                raise RuntimeError(
                    f"no worker sent anything for {self.wait_s:.0f} s (twice the silence limit + 10 s)"
                ) from None
            return None, None  # look again at what the loop waits for (a start, a checkpoint)
        self.last_header = time.monotonic()
        if got is None or isinstance(got, torch.Tensor):
            return src, got
        if not connection_closed(got):
            raise RuntimeError(f"worker rank {src}'s header: {got}")
        if self.peers[src].expected:
            self.gone(src, got)
        return src, None

    # --- a header and what follows it, by kind

    def take(self, src: int, kind: int, rows_nbytes: int, rows_count: int, extra_nbytes: int) -> None:
        """Act on a header from `src`, with the rows and message that follow it, once checked (`admit`). The rows
        are decoded by the coordinator: this thread's time is every worker's wait."""
        peer = self.peers[src]
        peer.heard = time.monotonic()
        if peer.standing in (Standing.BANNED, Standing.DONE):
            return  # banned, or finished or stopped (it exits): what it sends now is no message of the protocol
        try:
            self.admit(src, kind, rows_nbytes, rows_count, extra_nbytes)
            rows = recv_bytes(self.pg, rows_nbytes, src, TAG_X, self.wait_s) if rows_nbytes else b""
            extra = recv_bytes(self.pg, extra_nbytes, src, TAG_X, self.wait_s) if extra_nbytes else b""
            barrier = self.bounds.clock(extra) if kind == PULL else None
            state = None
            if kind == SAVED:
                state = recv_tensors(self.pg, self.bounds.state(extra), src, TAG_X, self.wait_s)
        except (RuntimeError, ValueError) as e:
            self.gone(src, e)
            return
        steps = self.rows_came(src, rows_count)
        if steps is None:
            # given up for lost (silent too long) and back: its commits are marked already; it stops
            if kind in (ASK, PULL):
                self.reply(src, STOP)
            return
        if rows:
            self.events.put(RowsCame(src, rows, steps))
        if kind == READY:
            self.on_ready(src, extra)
        elif kind == ASK:
            self.on_ask(src)
        elif kind == PULL:
            self.on_pull(src, barrier)
        elif kind == SAVED:
            self.on_saved(src, state)
        elif kind == FINISHED:
            self.on_finished(src)
        elif kind in (DIVERGED, ERROR):
            self.on_end(src, kind, extra.decode("utf-8", errors="replace"))

    def admit(self, src: int, kind: int, rows_nbytes: int, rows_count: int, extra_nbytes: int) -> None:
        """Malformed unless `src` may send a header of this kind now, of these sizes (bounds.Bounds). A worker given
        up for lost and back may still send the rows it holds, which are read and dropped."""
        peer = self.peers[src]
        if kind == READY and peer.ready:
            raise Malformed("READY a second time")
        saving = self.saving
        if kind == SAVED and (saving is None or src not in saving["told"] or src in saving["saved"]):
            raise Malformed("its state (SAVED) though no checkpoint asked it for its state")
        with self.lock:
            self.read_log()  # (commits made in rank 0's window are logged before their rows are sent)
            pending = len(peer.pending) if peer.pending is not None else ROWS_PENDING
        self.bounds.header(kind, rows_nbytes, rows_count, extra_nbytes, pending)

    def rows_came(self, src: int, count: int) -> list[int] | None:
        """The rows of `src`'s first `count` pending commits came: those are pending no more; returns their
        steps. None, and nothing done, if `src` was given up for lost."""
        with self.lock:
            pending = self.peers[src].pending
            if pending is None:
                return None
            return [pending.popleft() for _ in range(count)]

    def on_ready(self, src: int, extra: bytes) -> None:
        """A worker is ready, and says whether it maps θ from rank 0's window (`claims`). Once every worker is
        ready, no other process needs to open the window's file: it is removed."""
        refused = self.claims(src, extra)
        if refused is not None:
            self.ban(src, refused)
            return
        peer = self.peers[src]
        peer.ready, peer.standing = True, Standing.WORKING
        if self.window is not None and all_started(self.peers):
            self.window.unlink()

    def on_pull(self, src: int, barrier: int) -> None:
        """A worker waits at a barrier: θ once the server's clock has reached it; until then WAIT, or STOP when no
        commit can reach it."""
        if self.saving is not None:
            self.hold(src)
        elif self.stopping:
            self.done_with(src)
            self.reply(src, STOP)
        elif self.server.t < barrier:
            self.peers[src].barrier = barrier
            if self.unreachable():  # the others are told STOP when they next ask
                self.done_with(src)
                self.reply(src, STOP)
            else:
                self.reply(src, WAIT)
        else:
            self.peers[src].barrier = None
            self.pull(src)

    def on_saved(self, src: int, state: dict) -> None:
        """A worker's state for the checkpoint being taken: into the checkpoint's folder at once."""
        ckpt.save_atomic(state, ckpt.worker_file(self.saving["folder"], src - 1))
        self.saving["saved"].add(src)

    def on_finished(self, src: int) -> None:
        self.done_with(src)
        self.events.put(Finished(src))
        self.reply(src, BYE)

    def on_end(self, src: int, kind: int, text: str) -> None:
        """A worker diverged (the run stops: every worker that asks is told STOP) or raised (`text` says what)."""
        self.done_with(src)
        if kind == DIVERGED:
            self.stop(text)
            self.events.put(NonFinite(src, text))
        else:
            self.events.put(Raised(src, text))

    def send_pulled(self, src: int, view, theta: torch.Tensor, state: dict) -> None:
        try:
            # over the wire even to a worker that maps the window: no commit follows, and the others' commits go
            # on, so θ must be taken as of this clock, which the sends' completion ensures
            go = torch.tensor([GO, view.t, 0, int(self.wait_s * 1000)], dtype=torch.long)
            sends = [self.pg.send([v], src, TAG_X) for v in (go, theta, *state.values())]
            for s in sends:
                wait(s, self.wait_s)
        except RuntimeError as e:
            self.gone(src, e)

    # --- answers, and workers the server expects nothing more from

    def reply(self, src: int, kind: int, t: int = 0, staleness: int = 0) -> bool:
        if self.peers[src].standing is Standing.BANNED:  # it may never take the answer: a send not taken times out
            return False
        try:
            reply = torch.tensor([kind, t, staleness, int(self.wait_s * 1000)], dtype=torch.long)
            wait(self.pg.send([reply], src, TAG_X), self.wait_s)
            return True
        except RuntimeError as e:
            self.gone(src, e)
            return False

    def hold(self, src: int) -> None:
        """During a checkpoint: SAVE to a worker that has not sent its state, else WAIT (it asks again)."""
        if src in self.saving["saved"]:
            self.reply(src, WAIT)
        else:
            self.saving["told"].add(src)
            self.reply(src, SAVE)

    def done_with(self, src: int) -> None:
        """Expect nothing more from `src`: finished, stopped, or its connection closed (one lost stays lost)."""
        with self.lock:
            peer = self.peers[src]
            if peer.expected:
                peer.standing = Standing.DONE

    def gone(self, src: int, e: Exception) -> None:
        """`src` closed its connection (a RuntimeError from gloo): it is lost; or sent what the server does not
        accept (Malformed, a ValueError): it is banned. Any other gloo error is a timeout, and gloo has dropped the
        group."""
        if isinstance(e, ValueError):
            self.ban(src, str(e) if isinstance(e, Malformed) else f"what cannot be read ({e})")
            return
        if not connection_closed(e):
            raise RuntimeError(
                f"worker rank {src} did not answer for {self.wait_s:.0f} s (twice the silence limit "
                "+ 10 s); gloo gives up on the whole group after such a wait"
            ) from None
        self.done_with(src)  # now: a checkpoint in progress must not wait for it
        self.events.put(Lost(src, "its connection closed"))

    def ban(self, src: int, sent: str) -> None:
        """`src` sent what the server does not accept: lost, and nothing more it sends is read or answered."""
        with self.lock:
            self.peers[src].standing = Standing.BANNED  # now: a checkpoint in progress must not wait for it
        self.events.put(Lost(src, f"it sent {sent}"))

    def unreachable(self) -> bool:
        """Every worker still expected waits at a barrier that only their own commits could reach (a lost worker
        stalls synchronous rounds): end the run now, with the reason, rather than let them ask forever."""
        live = self.expected_ranks()
        barriers = {r: self.peers[r].barrier for r in live}
        if not live or any(b is None or b <= self.server.t for b in barriers.values()):
            return False
        why = (
            f"workers {sorted(r - 1 for r in live)} wait at a barrier (t={min(barriers.values())}) "
            f"that no commit can reach (t={self.server.t}, the other workers are lost or finished)"
        )
        self.stop(why)
        self.events.put(Fatal(why))
        return True
