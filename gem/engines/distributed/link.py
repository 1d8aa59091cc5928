"""A worker rank: it joins the group, proves the run's secret, takes the job from rank 0 (importing only what its
own side allows: job.allowed_imports) and runs the shared worker cycle
(gem.engines.worker), whose Link, `_RemoteLink`, makes each commit one exchange with the server (ASK, GO with θ,
COMMIT) and keeps a replica of the server's state, brought up to date by replaying the server step. A worker of
a local launch instead takes the server's turn from the other workers and commits to θ in rank 0's shared-memory
window, as on the process engine, and sends only its rows (`_RemoteLink`'s `turn`).

A worker waiting for the server (for its turn, or behind a worker that holds the server up) is not silent through
its own fault, and says so on the job's store while it waits (`_Waiting`): the server, stuck on a frozen worker,
cannot hear the others (a worker waiting in line for a local turn need not: rank 0 sees it there). It waits for
the server twice the server's own patience with a worker, which each reply tells it, and exits when the server is
gone (`_ServerGone`) or answers BYE or STOP.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from gem import algorithms
from gem.algorithms import Commit
from gem.data import load_dataset
from gem.engines import Job
from gem.engines.distributed.bounds import TEXT_BYTES
from gem.engines.distributed.doors import listening, refuse_newcomers
from gem.engines.distributed.group import (
    BYE_TIMEOUT_S,
    NO_SECRET,
    form_group,
    launched_group,
    leave,
    patience,
    timedelta_of,
    waiting_key,
)
from gem.engines.distributed.job import DONE, Start, allowed_imports, decode_job, decode_start, recv_job
from gem.engines.distributed.messages import (
    ASK,
    DIVERGED,
    ERROR,
    FINISHED,
    GO,
    PULL,
    READY,
    ROWS,
    SAVE,
    SAVED,
    STOP,
    TAG_ASK,
    TAG_JOB,
    TAG_X,
    pack,
    recv_packed,
    rows_json,
    send_bytes,
    wait,
)
from gem.engines.distributed.secret import SECRET_ENV, launched_secret, prove
from gem.engines.distributed.window import Window, log_entry
from gem.engines.server import Server
from gem.engines.turn import SAVE as TURN_SAVE
from gem.engines.turn import Gone, Turn
from gem.engines.worker import (
    ROWS_PER_MESSAGE,
    ROWS_SECONDS,
    START_TIMEOUT_S,
    Diverged,
    Worker,
    barrier_pauses,
    setup_process,
    threads_per_process,
)

WAIT_S = 0.02  # a worker told to WAIT while a checkpoint is being taken asks again after this long (at a barrier:
# worker.barrier_pauses)
WAITING_S = 0.5  # a worker waiting for the server says so on the store this often


def worker_main(timeout_s: float = START_TIMEOUT_S, allowed=()) -> int:
    """A rank > 0 started by torchrun or SLURM: join the group, prove the run's secret, take the job from rank 0,
    work, exit. `allowed`: the import paths its own command line names (job.allowed_imports)."""
    try:
        secret = launched_secret()  # before joining: a worker without it would only be refused
    except ValueError as e:  # rank 0 hears of it at once, and the node's output says it once (group.leave)
        line = f"error: {e}"
        leave(NO_SECRET, lambda: print(line, file=sys.stderr, flush=True))
        return 2
    threads = threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    store, pg, rank, _world = launched_group(timeout_s)
    return _work(pg, rank, threads, secret, allowed_imports(allowed), ignore_sigint=False, store=store)


def local_worker(
    rank: int,
    world: int,
    host: str,
    port: int,
    timeout_s: float,
    threads: int,
    secret: str,
    allowed: tuple[str, ...],
    turn: Turn | None = None,
    alive=None,
    handed: dict | None = None,
) -> None:
    """A worker of a local launch (`python run.py engine=distributed`): rank 0, its parent, hands it the run's
    secret and the import paths of its job as arguments, never over the network; and, where θ is in shared
    memory, the server's turn, which the workers then pass among themselves (window.py), with `alive`, the read
    end of a pipe only rank 0 writes to (end of file once rank 0 is gone: a worker waiting in line exits), and
    `handed`: θ and the server's tensors where they live on the workers' GPU (CUDA IPC handles)."""
    try:
        before = listening()
        store = dist.TCPStore(host, port, world, False, timeout=timedelta_of(timeout_s))
        pg = form_group(store, rank, world, host, timeout_s)
        refuse_newcomers(before)  # gloo's listener: nobody is left to connect to it (doors.py)
        _work(pg, rank, threads, secret, allowed_imports(allowed), store=store, turn=turn, alive=alive, handed=handed)
    finally:
        # rank 0 can free GPU memory it shared only once every process that received it has let go of it; this
        # process ends in os._exit, which runs no finaliser, and its Process object holds `handed` to the end
        if handed is not None:
            handed.clear()
            gc.collect()


def _work(
    pg,
    rank: int,
    threads: int,
    secret: str,
    allowed: frozenset[str],
    ignore_sigint: bool = True,
    store=None,
    turn: Turn | None = None,
    alive=None,
    handed: dict | None = None,
) -> int:
    setup_process(threads, ignore_sigint)
    try:
        prove(pg, rank, secret, START_TIMEOUT_S, getattr(store, "port", None))
        text, tensors = recv_job(pg, START_TIMEOUT_S)
        saved = recv_packed(pg, 0, TAG_JOB, START_TIMEOUT_S)  # this worker's state, when the run resumes
    except RuntimeError as e:
        print(
            f"gem: worker rank {rank}: no job from rank 0 ({str(e).splitlines()[0] if str(e) else e!r}); rank 0 "
            f"sends none to a worker that does not prove the run's secret ({SECRET_ENV})",
            file=sys.stderr,
        )
        return 1
    try:
        job, start = decode_job(text, tensors, allowed), decode_start(text)
        if start is None:
            raise ValueError("rank 0 sent no Start with the job")
    except (ValueError, TypeError, KeyError) as e:  # rank 0 records the worker lost, with this line
        why = f"{type(e).__name__}: {e}"
        print(f"gem: worker rank {rank} refuses its job: {why}", file=sys.stderr, flush=True)
        try:
            _header(pg, ERROR, b"", 0, why.encode()[:TEXT_BYTES], START_TIMEOUT_S)
        except RuntimeError:
            pass
        return 1
    if saved == DONE:  # a resumed run whose checkpoint has this worker finished, or lost: nothing to do
        return 0
    link = _RemoteLink(pg, rank, job, start, store, turn, alive, handed)
    try:
        link.run(saved)
    except _ServerGone:
        return 1
    return 0


def _header(pg, kind: int, rows: bytes, count: int, extra: bytes, timeout_s: float) -> None:
    """A header to the server, then the rows and the extra bytes it announces."""
    h = torch.tensor([kind, len(rows), count, len(extra)], dtype=torch.long)
    wait(pg.send([h], 0, TAG_ASK), timeout_s)
    if rows:
        send_bytes(pg, rows, 0, TAG_X, timeout_s)
    if extra:
        send_bytes(pg, extra, 0, TAG_X, timeout_s)


class _ServerGone(Exception):
    pass


class _Stopped(Exception):
    """The server answered STOP: the run is ending."""


class _RemoteLink:
    """A worker rank's way to the server: ASK, GO with θ, COMMIT, all over gloo; a replica of the server's state
    that the worker brings up to date by replaying the server step.

    With a `turn` (a worker of a local launch, θ in shared memory: window.py) it commits as a `process` worker
    does: it takes the turn from the worker before it, runs its worker rule against the live θ in the window and
    the server step in place, notes the commit in the window's log, and hands the turn on; only its rows, a
    checkpoint's state and the barriers' pulls go over the wire."""

    def __init__(
        self,
        pg,
        rank: int,
        job: Job,
        start: Start,
        store=None,
        turn: Turn | None = None,
        alive=None,
        handed: dict | None = None,
    ):
        self.pg, self.rank, self.job, self.start = pg, rank, job, start
        self.turn, self.alive, self.handed = turn, alive, handed
        self.holding = False  # this worker holds the turn (`turn` only)
        self.w = rank - 1  # the worker's index in metrics.parquet, as in the other engines
        self.waiting = _Waiting(store, rank) if store is not None else None
        if self.waiting is not None:
            self.waiting.start()
        self.timeout = job.engine.timeout_s
        # how long to wait for the server: twice its own patience with a worker, which each reply updates (it may
        # be held up by a silent worker until that one is lost)
        self.wait_s = 2.0 * patience(self.timeout)
        self.t0_wall = start.t0_wall
        self.buffer: list = []
        self.sent_at = time.monotonic()
        self.reply = torch.zeros(4, dtype=torch.long)  # [kind, t, τ, the server's patience in ms]
        self.extra: dict = {}
        self.worker: Worker | None = None
        self.server: Server | None = None  # the server's state this worker commits to: its replica, or the window's
        self.replica: Server | None = None  # its own copy, which a PULL fills (the replica itself, without a turn)
        self.window: Window | None = None  # rank 0's θ in shared memory, where this worker is on its host

    # --- messages to the server; any failure means it is gone
    def header(self, kind: int, extra: bytes = b"", rows: bool = False) -> None:
        """A header to the server, with the commit rows not yet sent: always with the last word (or `rows`), else
        in batches, so that most ASKs are one small message."""
        batch = (
            rows
            or kind != ASK
            or len(self.buffer) >= ROWS_PER_MESSAGE
            or time.monotonic() - self.sent_at > ROWS_SECONDS
        )
        rows = rows_json(self.buffer) if batch and self.buffer else b""
        try:
            _header(self.pg, kind, rows, len(self.buffer) if rows else 0, extra, self.wait_s)
        except RuntimeError as e:
            raise _ServerGone() from e
        if rows:
            self.buffer, self.sent_at = [], time.monotonic()

    def _recv(self, tensors: list[torch.Tensor], timeout: float) -> None:
        try:
            for t in tensors:
                wait(self.pg.recv([t], 0, TAG_X), timeout)
        except RuntimeError as e:
            raise _ServerGone() from e

    def _send(self, tensors: list[torch.Tensor]) -> None:
        try:
            works = [self.pg.send([t], 0, TAG_X) for t in tensors]
            for work in works:
                wait(work, self.wait_s)
        except RuntimeError as e:
            raise _ServerGone() from e

    # --- the Link of the worker cycle
    def acquire(self, w: int):
        if self.turn is not None:
            return self._take_turn(w)
        t, staleness = self._request(ASK, b"", itertools.repeat(WAIT_S))
        return self._receive_view(w, t, t - staleness)

    def _take_turn(self, w: int):
        """The turn, from the worker before this one (never while this worker sends on the wire: rank 0's server
        thread may wait for the turn, and then takes no message). A run that ends stops the turn (Gone): the rows
        this worker holds go with one last ASK, which the server answers STOP. (Rank 0 sees it in line: it need not
        say on the store that it waits.)"""
        asked: list[int] = []  # the clock when it took its place in line (as the process engine's rows say)
        try:
            self.turn.acquire(
                w, self._turn_waiting, self._turn_request, on_queued=lambda: asked.append(int(self.server.clock))
            )
        except Gone:
            self._request(ASK, b"", itertools.repeat(WAIT_S), rows=True)
            raise RuntimeError("the server answered GO to a worker that takes its turn in shared memory") from None
        self.holding = True
        view = self.server.view(w)
        self.extra = {"wait_commits": view.t - asked[0]}  # commits by others between taking its place and the turn
        return view

    def _turn_waiting(self) -> None:
        """About once a second while in line: rank 0 is gone once its end of the `alive` pipe is closed."""
        if self.alive is not None and self.alive.poll():
            raise _ServerGone()

    def _turn_request(self, action: int) -> None:
        """Rank 0 holds the turn and asks for a checkpoint: our state, over the wire, while we wait in line (a
        worker in line that does not answer is to blame: launch._Coordinator.watch)."""
        if action == TURN_SAVE:
            self._save()

    def await_clock(self, w: int, t: int):
        """A barrier: PULL until the server's clock has reached t; the server then sends θ and its tensors (no
        turn is held: nothing is committed) and marks the pull."""
        clock, _ = self._request(PULL, str(t).encode(), barrier_pauses())
        return self._receive_view(w, clock, clock, wire=True)

    def _request(self, kind: int, extra: bytes, pauses, rows: bool = False) -> tuple[int, int]:
        """Ask (ASK or PULL) until the server answers GO; returns its (t, τ). Meanwhile a SAVE is answered with our
        state, and a WAIT (a checkpoint is being taken, or the barrier not reached) with the next of `pauses` before
        asking again: asking keeps the server awake, so that it notices when a worker it waits for has died
        (gloo's wait would not wake). The worker says it is waiting, so it is not blamed for the others' silence."""
        if self.waiting is not None:
            self.waiting.waiting = True
        try:
            while True:
                self.header(kind, extra, rows)
                self._recv([self.reply], self.wait_s)
                answer, t, staleness, patience_ms = (int(v) for v in self.reply)
                self.wait_s = 2.0 * max(patience_ms / 1000, patience(self.timeout))
                if answer == STOP:
                    raise _Stopped()
                if answer == GO:
                    return t, staleness
                if answer == SAVE:  # a checkpoint: our state as of before the gradient in hand, then ask again
                    self._save()
                else:
                    time.sleep(next(pauses))
        finally:
            if self.waiting is not None:
                self.waiting.waiting = False

    def _receive_view(self, w: int, t: int, pulled_at: int, wire: bool = False):
        """θ and the server's tensors as the GO that follows sends them (`wire`: always, as after a PULL), into this
        worker's replica."""
        server, window = self.replica, self.window
        if window is not None and not wire:  # our turn: rank 0 applies no other commit until ours has come
            server.theta.copy_(window.theta)
            for k, v in server.state.items():
                v.copy_(window.state[k])
        else:
            self._recv([server.theta, *server.state.values()], self.wait_s)
        server.clock.fill_(t)
        server.pulled_at[w] = pulled_at
        return server.view(w)

    def _save(self) -> None:
        """A checkpoint: our state as of before the gradient in hand (or at the barrier)."""
        spec, tensors = pack(self.worker.state_dict(in_hand=True))
        self.header(SAVED, json.dumps(spec).encode())
        self._send(tensors)

    def submit(self, view, commit: Commit) -> None:
        if self.turn is not None:  # the server step follows here, in place: rank 0 reads who made it in the log
            log = self.window.log
            log[view.t % log.numel()] = log_entry(view.t, self.w)
            return
        spec, payload = pack(commit.payload)
        spec = json.dumps(spec).encode() if commit.payload else b""
        tensors = [torch.tensor([len(spec), 0], dtype=torch.long)]
        if self.window is not None:  # Δ into our slot, which rank 0 reads once the header has come
            self.window.slot(self.w).copy_(commit.delta)
        else:
            tensors.append(commit.delta.contiguous())
        if spec:
            tensors += [torch.frombuffer(bytearray(spec), dtype=torch.uint8), *payload]
        self._send(tensors)

    def release(self) -> None:
        if self.holding:
            self.holding = False
            self.turn.release(self._turn_waiting)

    def now(self) -> float:
        return time.time() - self.t0_wall

    def rows(self, row: dict, tensors) -> None:
        self.buffer.append((row, tensors))
        if self.turn is not None and (
            len(self.buffer) >= ROWS_PER_MESSAGE or time.monotonic() - self.sent_at > ROWS_SECONDS
        ):
            self.header(ROWS)  # no ASK to carry them: the turn is not rank 0's

    def run(self, saved: dict | None) -> None:
        try:
            job = self.job
            data = job.data if job.data_source is None else load_dataset(**job.data_source)
            job = self.job = dataclasses.replace(job, data=data)
            if len(data.train_y) != self.start.train_examples:
                raise ValueError(
                    f"this rank loaded {len(data.train_y)} training examples of data={data.name}, rank "
                    f"0 has {self.start.train_examples}: every node needs the same data.root"
                )
            algo = algorithms.get(job.algorithm)
            worker = self.worker = Worker(self.w, job, algo)  # its model: θ₀ from the seed, as on every rank
            # the replica of the server's state stays on the host, where gloo sends and receives it; page-locked for
            # a GPU worker that copies θ from it at every commit (pinned.py), which all do but a local launch's
            replica = Server.create(algo, job.hp, worker.x.detach().to("cpu", copy=True), job.workers)
            pin = worker.device.type == "cuda" and self.turn is None
            self.server = self.replica = replica.pin_memory() if pin else replica
            if saved is not None:
                worker.load_state_dict(saved)
            if self.start.window:
                self.window = Window.open(self.start.window, self.w, self.server, writable=self.turn is not None)
            if self.turn is not None:
                if self.window is None:
                    where = (self.start.window or {}).get("path")
                    raise RuntimeError(
                        f"cannot map rank 0's window {where}, where the workers of a local launch take their turn"
                    )
                handed = self.handed
                if (handed is None) == (self.window.theta is None):
                    raise RuntimeError("rank 0's window and the θ it handed this worker disagree on where θ is")
                self.server = self.window.adopt(
                    self.replica
                    if handed is None
                    else Server(
                        algo, job.hp, handed["theta"], handed["state"], self.replica.clock, self.replica.pulled_at
                    )
                )
            self.header(READY, b"1" if self.window is not None else b"")
            while worker.cycle(self):
                pass
        except Diverged as e:
            self.header(DIVERGED, str(e).encode()[:TEXT_BYTES])
            return
        except _Stopped:
            return
        except _ServerGone:
            raise
        except Exception as e:  # tell the server why, then stop
            self.header(ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc()}".encode()[:TEXT_BYTES])
            return
        self.header(FINISHED)
        try:  # the server's last word: it has everything; then nobody waits for anybody
            self._recv([self.reply], BYE_TIMEOUT_S)
        except _ServerGone:
            pass


class _Waiting(threading.Thread):
    """While its worker waits for the server, add 1 to the worker's key on the job's store every WAITING_S: the
    coordinator does not count a wait for the server as the worker's silence (the process engine's line). A frozen
    worker's thread is frozen with it, and a worker hung anywhere else is not waiting: neither says anything."""

    def __init__(self, store, rank: int):
        super().__init__(name="gem-waiting", daemon=True)
        self.store, self.key, self.rank = store, waiting_key(rank), rank
        self.waiting = False

    def run(self) -> None:
        while True:
            time.sleep(WAITING_S)
            if self.waiting:
                try:
                    self.store.add(self.key, 1)
                except Exception as e:  # noqa: BLE001 - the store went with rank 0: the worker finds out itself
                    # or rank 0 cut this connection as a stranger's (doors.cut_strangers: an address translated
                    # on the way). Said once: a long wait for the server may then count as this worker's silence
                    print(
                        f"gem: worker rank {self.rank} can no longer say on the job's store that it waits for the "
                        f"server ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
