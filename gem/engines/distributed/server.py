"""Rank 0's parameter server: a thread that serves the workers' exchanges one at a time, in the order their
headers arrive, and tells the coordinator (rank 0's main thread, gem.engines.distributed.launch) what happened
through a queue of events.

For a checkpoint the server stops handing out turns: each worker, when it next asks, is answered SAVE and sends its
state (the run directory is rank 0's, perhaps on another machine); asking again, it is told to WAIT and asks again
shortly, until every live worker has sent its state, the coordinator has written the checkpoint, and turns are
handed out again. (A worker is not left waiting on a reply: the server would wait on it while others ask.) A worker
lost mid-exchange, or between two (its connection closes), is recorded and the run goes on: its commits whose rows
never came are marked (`lost_row`).

Headers are taken first come, first served by a thread per worker (headers.Headers), each blocked in a receive from
its own rank, which hands what it gets to the server in arrival order.

The workers of a local launch take no exchange (`turn`): they pass the turn among themselves and commit to θ in
rank 0's window (window.py), and send only rows (ROWS), a checkpoint's state and a barrier's PULL. This thread is
then one participant in the turn's line: it holds the turn until every worker is ready (all start from one θ),
takes it for a checkpoint (the workers are asked SAVE through the turn, and send their state while they wait in
line) and to pull θ for a barrier, and reads who made each commit from the window's log (`sync_log`). Stopping the
run stops the workers' turns; each sends its last rows with one ASK, answered STOP.

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

from gem.algorithms import Commit
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
from gem.engines.distributed.window import LOG_WORKERS, Window
from gem.engines.server import Server
from gem.engines.turn import SAVE as TURN_SAVE
from gem.engines.turn import Turn
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
    """Rank 0's exchanges with the workers, one at a time, in the order their headers arrive. Talks to the
    coordinator (the main thread) through `events`; `lock` guards the server's state and the bookkeeping."""

    def __init__(
        self,
        pg,
        job: Job,
        server: Server,
        workers: list[int],
        events: queue.Queue,
        bounds: Bounds,
        window: Window | None = None,
        turn: Turn | None = None,
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
        self.early: deque = deque()  # ASKs that came before every worker was ready: all start from one θ
        # a checkpoint being taken: {"folder", "told": ranks told SAVE, "saved": ranks that sent their state}
        self.saving: dict | None = None
        self.written = threading.Event()
        # Δ of a commit over the wire, received on the host (none comes with a local turn, whose θ may be on a GPU)
        self.delta = torch.empty_like(server.theta, device="cpu") if turn is None else None
        self.window = window  # θ in shared memory (window.py), for the workers on rank 0's host
        self.started = time.monotonic()
        self.busy_s, self.served = 0.0, 0  # seconds spent in exchanges that ended in a commit, and how many
        self.headers: Headers | None = None  # started with the server thread
        # a local launch with θ in shared memory: the workers pass the turn among themselves (`turn`), and this
        # thread is participant `me` in its line (the coordinator, me + 1); it holds the turn from the start until
        # every worker is ready, and while a checkpoint is taken. The workers' commits are read from the window's
        # log (`sync_log`): `logged`, the clock up to which they have been
        self.turn, self.me, self.holding = turn, len(workers), turn is not None
        self.logged = server.t
        self.last_header = time.monotonic()

    def stop(self, why: str) -> None:
        self.stopping = self.stopping or why
        if self.turn is not None:  # a worker stopped in line sends its rows with one last ASK, answered STOP
            for r, peer in self.peers.items():
                if peer.expected:
                    self.turn.stop(r - 1)

    def sync_log(self) -> None:
        """(turn) The commits the workers made since the last look, from the window's log: pending until their
        rows come (whose times are the coordinator's progress)."""
        if self.turn is not None:
            with self.lock:
                self._sync_log()

    def _sync_log(self) -> None:
        t, log = self.server.t, self.window.log
        if t - self.logged > log.numel():
            raise RuntimeError(
                f"{t - self.logged} commits since rank 0 last read the commit log, which holds {log.numel()}"
            )
        if t <= self.logged:
            return
        lost = []
        for i, entry in zip(
            range(self.logged, t), log[torch.arange(self.logged, t) % log.numel()].tolist(), strict=True
        ):
            if entry // LOG_WORKERS != i:  # not yet visible here: read it at the next look (its rows come after it)
                t = i
                break
            peer = self.peers.get(entry % LOG_WORKERS + 1)
            pending = peer.pending if peer is not None else None
            if pending is not None:
                pending.append(i + 1)
            else:  # lost: its row will never come
                lost.append(i + 1)
        self.logged = t
        if lost:
            self.events.put(StepsLost(lost))

    def lose(self, rank: int, banned: bool = False) -> list[int]:
        """(coordinator) Expect nothing more from `rank` (`banned`: nor read anything it sends); returns its commits
        whose rows will never come."""
        with self.lock:
            if self.turn is not None:  # its process is gone (launch: lose_rank): its last commits are logged
                self._sync_log()
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
        if self.headers is not None:  # wake the server thread: with a turn, it takes it now
            self.headers.arrived.put((None, None))
        return True

    def run(self) -> None:
        try:
            self.serve()
        except WriteError as e:  # a worker's checkpoint file: the disk failed, and the run ends
            self.events.put(WriteFailed(str(e)))
        except Exception as e:  # noqa: BLE001 - the coordinator reports it
            if self.open():  # (else every worker had finished or was lost: nobody waited on what failed)
                self.events.put(Fatal(f"parameter server: {type(e).__name__}: {e}"))
        finally:
            if self.holding:  # (failed) the coordinator may wait for the turn
                self.release_turn()
            self.events.put(ServerDone())

    def serve(self) -> None:
        self.headers = Headers(self.pg, self.ranks)
        try:
            self.serve_headers()
        finally:
            self.headers.close()

    def settle(self, timeout_s: float) -> None:
        """(rank 0, before it exits) Wait up to `timeout_s` for this thread and the header threads to end, as
        they do once the workers have gone (Headers.join says why that matters)."""
        deadline = time.monotonic() + timeout_s
        if self.ident is not None:  # started
            self.join(timeout_s)
        if self.headers is not None:
            self.headers.join(deadline)

    def serve_headers(self) -> None:
        while self.open():
            started = all_started(self.peers) or time.monotonic() - self.started > START_TIMEOUT_S
            if self.early and started:
                self.exchange(self.early.popleft())
                continue
            if self.holding and started and self.saving is None:  # the race begins: all start from one θ
                self.release_turn()
            if self.saving is not None and self.turn is not None and not self.holding:
                self.take_turn_for_checkpoint()
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
        if self.holding and all_started(self.peers):
            self.release_turn()

    # --- the turn, with the workers of a local launch

    def take_turn(self) -> None:
        """Wait in line for the turn (a frozen holder is lost, killed and its turn handed on by the coordinator)."""
        if not self.turn.acquire(self.me, self._turn_waiting, timeout=self.wait_s):
            raise RuntimeError(f"the server's turn did not come within {self.wait_s:.0f} s")
        self.holding = True

    def _turn_waiting(self) -> None:
        if not threading.main_thread().is_alive():
            raise RuntimeError("rank 0's main thread has ended")

    def release_turn(self) -> None:
        self.holding = False
        self.turn.release()

    def take_turn_for_checkpoint(self) -> None:
        """Hold the turn, so that θ stays as saved, and ask every live worker for its state: one in line sends it
        at once, one computing when it next asks for the turn (link._turn_request)."""
        self.take_turn()
        live = self.expected_ranks()
        self.saving["told"] |= live
        self.turn.ask({r - 1 for r in live}, TURN_SAVE)

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
            if self.turn is not None:  # its commits are in the log, written before their rows were sent
                self._sync_log()
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
        """A worker is ready; b"1": it maps θ from the window, which it may only where the window gives it a slot.
        Once every worker is ready, no other process needs to open the window's file: it is removed."""
        if self.turn is not None and extra != b"1":
            self.ban(
                src, f"a READY header followed by {extra!r}, where every worker takes its turn in shared memory (b'1')"
            )
            return
        if extra:
            window = self.window
            if extra != b"1":
                self.ban(
                    src, f"a READY header followed by {extra!r} (b'1', that it maps θ from shared memory, or nothing)"
                )
                return
            if window is None or not 0 <= src - 1 < window.slots:
                self.ban(
                    src,
                    "a READY header saying that it maps θ from shared memory, where "
                    + ("rank 0 keeps none" if window is None else f"only workers 0 to {window.slots - 1} have a slot"),
                )
                return
            self.peers[src].maps_window = True
        self.peers[src].ready, self.peers[src].standing = True, Standing.WORKING
        if self.window is not None and all_started(self.peers):
            self.window.unlink()

    def on_ask(self, src: int) -> None:
        """A worker asks for its turn: during a checkpoint it is told to SAVE or WAIT; before every worker is
        ready it waits for them (all start from one θ); else its exchange, now."""
        if self.turn is not None and not self.stopping and self.peers[src].standing is not Standing.LOST:
            self.ban(src, "an ASK, where every worker takes its turn in shared memory")
        elif self.saving is not None and not self.stopping:
            self.hold(src)
        elif not all_started(self.peers) and self.turn is None:
            self.early.append(src)
        else:
            self.exchange(src)

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
        if self.turn is not None:  # saved at a barrier (`hold`): the turn's request is answered too
            self.turn.answered(src - 1, TURN_SAVE)

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

    # --- the exchanges

    def exchange(self, src: int) -> None:
        """`src`'s turn: GO with θ, its commit back, applied; timed (busy_s) for the run's summary."""
        standing = self.peers[src].standing
        if standing is Standing.BANNED:
            return  # it asked before it was banned
        if self.stopping or standing is Standing.LOST:
            self.done_with(src)
            self.reply(src, STOP)
            return
        began = time.perf_counter()
        view = self.server.view(src - 1)
        try:
            payload = self.go_and_commit(src, view)
        except (RuntimeError, ValueError) as e:
            self.gone(src, e)
            return
        self.apply(src, view, payload)
        self.busy_s += time.perf_counter() - began
        self.served += 1

    def go_and_commit(self, src: int, view) -> dict:
        """GO with the clock and τ, the live θ and the server's tensors, all in flight at once; then the commit:
        Δ into self.delta, and the payload it returns. A worker that maps the window gets only GO (θ is where it
        reads it: nothing changes θ until this exchange ends), and leaves Δ in its slot there."""
        server, mapped = self.server, self.peers[src].maps_window
        state = () if mapped else (server.theta, *server.state.values())
        header = torch.zeros(2, dtype=torch.long)
        wait_s = self.wait_s
        go = torch.tensor([GO, view.t, view.staleness, int(wait_s * 1000)], dtype=torch.long)
        sends = [self.pg.send([v], src, TAG_X) for v in (go, *state)]
        for s in sends:
            wait(s, wait_s)
        wait(self.pg.recv([header], src, TAG_X), wait_s)
        spec_nbytes = int(header[0])
        self.bounds.commit(spec_nbytes)
        if mapped:  # into rank 0's own memory: the worker can no more change Δ while the server rule reads it
            self.delta.copy_(self.window.slot(src - 1))
        else:
            wait(self.pg.recv([self.delta], src, TAG_X), wait_s)  # Δ: θ's size, always
        if not spec_nbytes:
            return {}
        spec = self.bounds.payload_of(recv_bytes(self.pg, spec_nbytes, src, TAG_X, wait_s))
        return recv_tensors(self.pg, spec, src, TAG_X, wait_s)

    def apply(self, src: int, view, payload: dict) -> None:
        """The server rule on θ; the commit is pending until `src`'s row for it comes."""
        with self.lock:
            t = self.server.apply(view, Commit(delta=self.delta, payload=payload))
            self.commits.append((src - 1, time.monotonic()))  # progress, for the coordinator's Silence
            pending = self.peers[src].pending
            if pending is not None:
                pending.append(t)
            else:  # given up for lost while this exchange ran: its row will never come
                self.events.put(StepsLost([t]))
        if pending is not None and len(pending) > ROWS_PENDING:
            self.ban(src, f"no rows for its last {len(pending)} commits (at most {ROWS_PENDING} may await rows)")

    def pull(self, src: int) -> None:
        """A worker at a barrier that the clock has reached: θ and the server's tensors; no commit follows."""
        if self.turn is not None:  # θ as of a clock, under the turn; sent once the turn is handed on
            held = self.holding
            if not held:
                self.take_turn()
            try:
                with self.lock:
                    view = self.server.pull(src - 1)
                # copies on the host, where gloo sends from (θ may be on the workers' GPU: launch.py)
                theta = self.server.theta.to("cpu", copy=True)
                state = {k: v.to("cpu", copy=True) for k, v in self.server.state.items()}
            finally:
                if not held:
                    self.release_turn()
            self.send_pulled(src, view, theta, state)
            return
        with self.lock:
            view = self.server.pull(src - 1)
        self.send_pulled(src, view, self.server.theta, self.server.state)

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
