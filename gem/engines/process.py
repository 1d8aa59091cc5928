"""The `process` engine: n real worker processes on one machine, θ in shared memory (docs/design.md, "Engines").

Workers are OS processes forked from a forkserver that has imported torch and gem once (gem.engines.worker's
`worker_context`), so each holds only what it computes with, and 100 of them fit on a laptop. Each runs the shared
worker cycle (gem.engines.worker). The parameter server's state (gem.engines.server: θ, the algorithm's server
tensors, the clock, every worker's pull time) and the training set live in shared memory, so no worker holds a
copy of the data. With every worker on one GPU, θ and the server's tensors live there instead (CUDA IPC).

The parameter server is a turn that the workers pass among themselves, first in, first out (`Turn`): a worker at
its commit boundary takes the turn, runs its worker rule against the live θ and the server step in place in
shared memory, pulls, and passes the turn to the worker that asked next. Turns are exclusive, so staleness is
measured under the server's lock; a free turn costs one uncontended lock; a busy one, a single wake-up of the
next worker in line. Nobody is starved: while a worker waits, each other worker gets the turn at most once (the
original code's polling in rank order let low ranks overtake high ones again and again). A windowed algorithm
takes the turn only when it commits.

The coordinating process (the one that calls `run`) holds the turn until every worker has started, so that
all of them copy the same θ at the same clock, and after that holds no lock on the hot path. It reads each
worker's commit rows from that worker's pipe and is the only process that writes files and W&B
(gem.engines.coordinator). It takes the turn itself to read θ for an evaluation, and for a checkpoint, during
which every worker writes its own state. It watches every worker's process: a worker killed mid-run (SIGKILL
included) is recorded, the turn is taken back from it if it held it, the others are asked to send the rows they
hold so that the lost worker's unreported commits can be marked (`lost_row`), and the run goes on. A worker that
is alive but makes no progress (frozen by SIGSTOP, hung in its rule) is lost the same way, and killed, once it is
silent for longer than the limit of `Silence` (gem.engines.coordinator: max(engine.timeout_s, engine.silent_cycles
x the median time between two commits of a worker)). The coordinator sees progress without a message: every commit
sets the worker's `pulled_at` in shared memory, and its row gives the commit's time. A worker waiting in line for
the turn is not silent through its own fault (if the turn's holder is frozen, everyone waits): only the holder and
workers out of the line are blamed. Every wait has a timeout, workers exit when the coordinator disappears, and
the coordinator stops every child on the way out, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from multiprocessing import connection
from pathlib import Path

import torch

from gem import algorithms
from gem.engines import Job, Result
from gem.engines import checkpoint as ckpt
from gem.engines.coordinator import POLL_S, Coordinator, start_server
from gem.engines.core import Evaluator, build_flat_model, central_device
from gem.engines.server import Server
from gem.engines.turn import FLUSH, SAVE, Gone, Ticket, Turn
from gem.engines.worker import (
    EXIT_WAIT_S,
    ROWS_PER_MESSAGE,
    ROWS_SECONDS,
    START_TIMEOUT_S,
    STOP_GRACE_S,
    Diverged,
    Worker,
    barrier_pauses,
    interrupts_held,
    setup_process,
    threads_per_process,
    worker_context,
)
from gem.files import WriteError

TURN_TIMEOUT_S = 120.0  # the coordinator waits for the turn at most this long beyond the silence limit (a frozen
# holder is lost at the limit, and its turn handed on: this bound is a backstop)

_ASKED = {SAVE: "SAVE", FLUSH: "FLUSH"}


# --------------------------------------------------------------- what a worker process tells the coordinator
# One value a message, sent down the worker's pipe (pickled between a parent and the children it started, never
# between peers); the coordinator's `drain` has one case for each.


@dataclasses.dataclass(frozen=True)
class Ready:
    """The worker has built its model from θ₀ (and its saved state): the race may begin."""


@dataclasses.dataclass(frozen=True)
class Rows:
    rows: list  # (row, tensors) of its latest commits, in their order


@dataclasses.dataclass(frozen=True)
class Replied:
    """It has sent its rows (FLUSH), or its rows and its state into the checkpoint's folder (SAVE), as asked."""

    action: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """Its last commit is made and its rows sent."""


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Its loss or θ is no longer finite (gem.engines.worker.Diverged): the run stops."""

    reason: str


@dataclasses.dataclass(frozen=True)
class WriteFailed:
    """Its checkpoint file could not be written: the disk, not the worker, failed, and the run ends."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Raised:
    error: str  # "<type>: <message>"
    traceback: str


# ----------------------------------------------------------------------------------------------- worker


class _Link:
    """A worker process's way to the server: the shared turn, the server's state in shared memory, a pipe."""

    def __init__(self, w: int, server: Server, turn: Turn, conn, alive, t0_wall: float, run_dir: str | None):
        self.w, self.server, self.turn, self.conn, self.t0_wall, self.run_dir = w, server, turn, conn, t0_wall, run_dir
        self.alive = alive  # the read end of a pipe only the coordinator writes to: end of file once it is gone
        self.extra: dict = {}
        self.buffer: list = []  # rows not yet sent: sent in batches, so the coordinator wakes up less often
        self.sent_at = time.monotonic()
        self.worker: Worker | None = None

    def waiting(self) -> None:  # called about once a second while this worker waits for a lock
        if self.alive.poll():
            raise Gone()

    def acquire(self, w: int):
        asked: list[int] = []  # the clock when this worker took its place in line (not before: a worker
        # delayed on its way into the line would count commits that FIFO order has nothing to do with)
        self.turn.acquire(w, self.waiting, self.on_request, on_queued=lambda: asked.append(int(self.server.clock)))
        view = self.server.view(w)
        self.extra = {"wait_commits": view.t - asked[0]}  # commits by others between taking its place and the turn
        return view

    def submit(self, view, commit) -> None:
        pass  # the server's state is right here, in shared memory

    def await_clock(self, w: int, t: int):
        """A barrier: take the turn until the clock has reached t (in line, so checkpoint and flush requests are
        answered), with worker.barrier_pauses between looks."""
        for pause in barrier_pauses():
            self.turn.acquire(w, self.waiting, self.on_request)
            if int(self.server.clock) >= t:
                return self.server.pull(w)
            self.turn.release(self.waiting)
            self.waiting()
            time.sleep(pause)

    def release(self) -> None:
        self.turn.release(self.waiting)

    def now(self) -> float:
        return time.time() - self.t0_wall

    def rows(self, row: dict, tensors) -> None:
        self.buffer.append((row, tensors))
        if len(self.buffer) >= ROWS_PER_MESSAGE or time.monotonic() - self.sent_at > ROWS_SECONDS:
            self.send_rows()

    def send_rows(self) -> None:
        if self.buffer:
            self.conn.send(Rows(self.buffer))
            self.buffer, self.sent_at = [], time.monotonic()

    def on_request(self, action: int) -> None:
        """The coordinator holds the turn and asks for our rows (FLUSH), or our rows and state (SAVE)."""
        self.send_rows()
        if action == SAVE:
            folder = Path(self.run_dir) / ckpt.CHECKPOINT / "pending"
            ckpt.save_atomic(self.worker.state_dict(in_hand=True), ckpt.worker_file(folder, self.w))
        self.conn.send(Replied(action))


def _worker(w: int, job: Job, tensors: dict, turn: Turn, conn, alive, threads: int, t0_wall: float):
    """One worker process: the shared worker cycle, with the turn and θ in shared memory."""
    try:
        _work(w, job, tensors, turn, conn, alive, threads, t0_wall)
    finally:
        # θ on a GPU came as CUDA IPC handles, whose memory the coordinator can free only once every process that
        # received it has let go of it; this process ends in os._exit, which runs no finaliser, and its Process
        # object holds `tensors` to the end
        tensors.clear()
        gc.collect()


def _work(w: int, job: Job, tensors: dict, turn: Turn, conn, alive, threads: int, t0_wall: float):
    import traceback

    setup_process(threads)
    link = None
    try:
        algo = algorithms.get(job.algorithm)
        server = Server(algo, job.hp, **tensors)
        worker = Worker(w, job, algo)  # its model: θ₀ from the seed, as in the coordinator and on every engine
        if job.resume is not None:
            worker.load_state_dict(ckpt.load_worker(job.resume, w))
        link = _Link(w, server, turn, conn, alive, t0_wall, job.run_dir)
        link.worker = worker
        conn.send(Ready())
        while worker.cycle(link):
            pass
        link.send_rows()
        conn.send(Finished())
    except Diverged as e:
        link.send_rows()
        conn.send(NonFinite(str(e)))
    except WriteError as e:  # its checkpoint file: the disk, not the worker, failed; the run ends
        conn.send(WriteFailed(str(e)))
    except (Gone, BrokenPipeError, EOFError, ConnectionResetError):
        return
    except Exception as e:  # tell the coordinator why, then die
        try:
            conn.send(Raised(f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ coordinator


@dataclasses.dataclass
class _Child:
    index: int
    process: object
    conn: object
    finished: bool = False
    lost: bool = False


def _share(job: Job) -> Job:
    """The job with its dataset in shared memory: workers map it instead of copying it."""
    data = job.data.for_workers()  # workers never evaluate: no validation or test split
    for k in ("train_x", "train_y"):
        setattr(data, k, getattr(data, k).share_memory_())
    return dataclasses.replace(job, data=data)


def run(job: Job, recorder) -> Result:
    if job.engine.name != "process":
        raise ValueError(f"engine=process cannot run a job for engine={job.engine.name}")
    algo = algorithms.get(job.algorithm)
    n = job.workers
    threads = threads_per_process(n)
    torch.set_num_threads(threads)  # the coordinator evaluates while the workers train
    server, resumed = start_server(job, algo, build_flat_model(job, device="cpu").param.clone())
    server.share_memory_()
    central = central_device(job)
    if central.type == "cuda":
        server = server.to(central)  # the worker processes receive it as CUDA IPC handles (torch.multiprocessing)
    coord = _Coordinator(job, recorder, server, Evaluator(job, job.data), resumed, n)
    if resumed is not None:  # a worker file that cannot be read: say so now, before any process starts
        for w in coord.pending_workers():
            ckpt.load_worker(job.resume, w)
    shared = _share(job)
    ctx = worker_context(job)
    turn = coord.turn = Turn(ctx, n + 1, central)
    turn.state[0] = n  # the coordinator holds the turn until every worker is ready: all start from one θ
    tensors = server.tensors()
    alive, here = ctx.Pipe(duplex=False)  # `here` stays open in this process alone until the end of the run
    try:
        for w in coord.pending_workers():
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                name=f"gem-worker-{w}",
                daemon=True,
                args=(w, shared, tensors, turn, child_conn, alive, threads, coord.t0_wall),
            )
            with interrupts_held():  # a child started is a child recorded, and stopped below
                p.start()
                child_conn.close()
                coord.add(_Child(w, p, parent_conn))
        alive.close()
        return coord.serve()
    finally:
        _stop(coord.children, turn)
        alive.close()
        here.close()
        if central.type == "cuda":  # the GPU memory the workers received by CUDA IPC and have let go of
            torch.cuda.ipc_collect()


def _stop(children: list[_Child], turn: Turn, grace_s: float = STOP_GRACE_S) -> None:
    """Stop every child: ask, then terminate, then kill. Never waits forever."""
    for c in children:
        if c.process.is_alive():
            turn.stop(c.index)
    deadline = time.monotonic() + grace_s
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))
    for c in children:
        if c.process.is_alive():
            c.process.terminate()
    for c in children:
        c.process.join(EXIT_WAIT_S)
        if c.process.is_alive():
            c.process.kill()
            c.process.join(EXIT_WAIT_S)
    for c in children:
        c.conn.close()


class _Coordinator(Coordinator):
    def __init__(self, job, recorder, server, evaluate, resumed, n: int):
        super().__init__(job, recorder, server, evaluate, resumed)
        self.me = n  # the coordinator's place in the turn
        self.turn: Turn | None = None
        self.children: list[_Child] = []
        self.by_conn: dict = {}
        self.by_sentinel: dict = {}
        self.ready: set[int] = set()
        self.replies: set[int] = set()  # workers that answered the current SAVE or FLUSH request
        self.need_sync = False  # a worker was lost: its unsent rows leave a gap to fill
        self.started = False  # the coordinator holds the turn until every worker is ready
        self.began = time.monotonic()
        self.pulled: list[int] = []  # every worker's pulled_at when the coordinator last looked
        self.watched_at = 0.0

    def add(self, c: _Child) -> None:
        self.children.append(c)
        self.by_conn[c.conn] = c
        self.by_sentinel[c.process.sentinel] = c

    def active(self) -> list[_Child]:
        return [c for c in self.children if not c.finished and not c.lost]

    def lose_child(self, c: _Child, why: str) -> None:
        code = c.process.exitcode
        c.lost = True
        if not self.lose(c.index, why + (f", exit code {code}" if code is not None else "")):
            return
        if c.process.is_alive():
            c.process.kill()
            c.process.join(self.turn.kill_wait_s)
        self.turn.recover(c.index)
        self.need_sync = True

    # --- the engine hooks of Coordinator.serve

    def running(self) -> bool:
        return bool(self.active())

    def poll(self, timeout: float) -> None:
        """Read whatever the workers have sent, for up to `timeout` s; notice the dead."""
        live = self.active()
        events = connection.wait([c.conn for c in live] + [c.process.sentinel for c in live], timeout=timeout)
        for e in events:
            c = self.by_sentinel.get(e) or self.by_conn[e]
            self.drain(c)
            if c.process.exitcode is not None and not c.finished and not c.lost and not self.diverged:
                self.drain(c)
                self.lose_child(c, "process died")
        if self.started:
            return
        if time.monotonic() - self.began > START_TIMEOUT_S:  # the others start without it
            for c in self.active():
                if c.index not in self.ready:
                    self.lose_child(c, f"not ready within {START_TIMEOUT_S:.0f} s of its start")
        if all(c.index in self.ready or c.lost for c in self.children):
            self.started = True  # every worker has copied θ: the race begins, and the silence timers with it
            self.silence.start([c.index for c in self.active()], self.now())
            self.pulled = self.server.pulled_at.tolist()
            self.release_turn()

    def drain(self, c: _Child) -> None:
        while True:
            try:
                if not c.conn.poll():
                    return
                msg = c.conn.recv()
            except (EOFError, OSError):
                return
            match msg:
                case Rows(rows):
                    for row, tensors in rows:
                        self.ledger.add(row, tensors)
                        self.silence.progress(c.index, row["time_s"])  # stamped under the turn, on our clock
                case Ready():
                    self.ready.add(c.index)
                case Replied():
                    self.replies.add(c.index)
                case Finished():
                    c.finished = True
                    self.finish(c.index)
                case NonFinite(reason):
                    self.diverge(reason)
                    c.finished = True  # it has stopped and will send nothing more (not counted as finished)
                case Raised(error):
                    self.lose_child(c, f"raised {error}")
                case WriteFailed(reason):
                    raise WriteError(reason)

    def watch(self) -> None:
        """Lose every worker silent for longer than the limit (`Silence`); poll notices the dead. A worker whose
        `pulled_at` moved has committed; one waiting in line for the turn waits on others (the holder, or the
        coordinator), as does everyone when a worker froze inside the turn's own lock (`Turn.peek`): neither is
        silent through its own fault. The turn's holder is blamed, and a frozen holder is killed and its turn
        handed on (`lose_child`)."""
        if not self.started:
            return
        now = self.now()
        if now - self.watched_at < POLL_S / 2:
            return
        self.watched_at = now
        active = {c.index: c for c in self.active()}
        line, _ = self.turn.peek({w: c.process.pid for w, c in active.items()})
        pulled = self.server.pulled_at.tolist()
        for w in active:
            if pulled[w] != self.pulled[w] or w in line:
                self.silence.seen(w, now)
        self.pulled = pulled
        for w, silent_for in self.silence.silent(now):
            if w in active:
                self.lose_child(active[w], self.silence.why(silent_for))
            else:
                self.silence.forget(w)

    def sync(self) -> None:
        if self.need_sync and self.started and self.active():
            self.flush_all()

    def snapshot(self):
        if not self.take_turn():
            return None
        try:
            return self.server.t, self.server.theta.clone()
        finally:
            self.release_turn()

    def checkpoint(self) -> None:
        folder = ckpt.pending(self.job.run_dir)
        if not self.take_turn():
            return
        try:
            step = self.server.t
            self.collect(SAVE)  # every live worker sends its rows, then writes its state
            if not self.diverged:
                self.ledger.fill_gaps(step)
                self.write_checkpoint(folder, step)
        finally:
            self.release_turn()

    def wrap_up(self) -> Result:
        if self.diverged:  # every live worker sends the rows of its commits, and commits no more, before the end
            self.flush_all(stop_on_divergence=False, keep_turn=True)
        for c in self.children:  # what the last workers sent before they exited
            self.drain(c)
        self.ledger.fill_gaps(self.server.t)
        central = self.server.theta.device
        where = (
            f"θ on {central}, shared with the workers by CUDA IPC"
            if central.type == "cuda"
            else "θ in shared host memory"
        )
        return self.conclude(
            {
                "central_device": str(central),
                "placement": f"{where}; the workers pass the server's turn among themselves",
            }
        )

    # --- the turn, from the coordinator's side

    def take_turn(self) -> bool:
        """Take the server's turn, waiting in line like a worker while reading rows and watching for the
        dead and the silent (`wait_on`; `lose_child` hands a lost holder's turn on). False, out of line again, if
        it did not come in time."""
        ticket = Ticket(self.turn, self.me)
        if self.wait_on(ticket.step, self.silence.limit() + TURN_TIMEOUT_S) is None:
            ticket.cancel()
            return False
        return True

    def release_turn(self) -> None:
        self.wait_on(self.turn.try_release)

    def collect(self, action: int, stop_on_divergence: bool = True) -> None:
        """(holding the turn) Ask every active worker to SAVE or FLUSH and wait for each one's reply; a worker
        that does not answer within the silence limit is lost. (One waiting in line answers at once; one that
        computes, when it reaches its commit boundary and asks for the turn: within a cycle.)"""
        self.replies = set()
        want = {c.index for c in self.active()}
        self.wait_on(lambda: self.turn.try_ask(want, action))
        asked, lost = time.monotonic(), len(self.lost_workers)
        while not (stop_on_divergence and self.diverged):
            if len(self.lost_workers) > lost:
                # lost meanwhile (found frozen below; its silence, found by `watch`; its death): the others may
                # have waited on it (frozen inside the turn's lock, it stalled them), and get their time again
                lost, asked = len(self.lost_workers), time.monotonic()
            missing = [c for c in self.active() if c.index in want and c.index not in self.replies]
            if not missing:
                break
            waited = time.monotonic() - asked
            if waited > self.silence.limit():
                active = {c.index: c for c in self.active()}
                _, frozen = self.turn.peek({w: c.process.pid for w, c in active.items()})
                if frozen is not None:
                    # the others cannot answer before it lets go of the turn's lock: it alone is to blame (and
                    # they get their time again, above)
                    why = f"frozen inside the turn's lock, no answer to a {_ASKED[action]} request"
                    self.lose_child(active[frozen], self.silence.why(waited, why))
                    continue
                for c in missing:
                    self.lose_child(c, self.silence.why(waited, f"no answer to a {_ASKED[action]} request"))
                break
            self.look_after(POLL_S)
        self.poll(0)

    def flush_all(self, stop_on_divergence: bool = True, keep_turn: bool = False) -> None:
        """Every live worker sends the rows it holds; commits with no row left are those of lost workers and
        get a row that says so. Needed after a loss (else recording, and the evaluations and checkpoints
        that follow it, would wait at the first missing row until the end) and before stopping early.
        `keep_turn`: the run ends here, so hold the turn to the end (a commit made after the flush would have
        its row cut off by the stop, and be recorded as lost)."""
        self.need_sync = False
        if not self.take_turn():
            return
        try:
            self.collect(FLUSH, stop_on_divergence)
            self.ledger.fill_gaps(self.server.t)
        finally:
            if not keep_turn:
                self.release_turn()
