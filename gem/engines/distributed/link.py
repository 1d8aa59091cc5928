"""A worker rank's way to the server, whatever the transport (`RemoteLink`): the worker cycle's Link (gem.engines
.worker) over gloo, with a replica of the server's state. What every transport shares is here: the header that
carries the rows, a request answered GO, WAIT, SAVE or STOP, a checkpoint's state, a barrier's PULL and the run of
the worker cycle. What a turn at the server is, the transport says: link_wire.py (each commit one exchange: ASK,
GO with θ, COMMIT) or link_turn.py (a local launch's workers pass the server's turn among themselves and commit to
θ in rank 0's window, sending only their rows). rank.py starts one or the other, as rank 0's Start says.

A worker waiting for the server (for its turn, or behind a worker that holds the server up) is not silent through
its own fault, and says so on the job's store while it waits (`_Waiting`): the server, stuck on a frozen worker,
cannot hear the others (a worker waiting in line for a local turn need not: rank 0 sees it there). It waits for
the server twice the server's own patience with a worker, which each reply tells it, and exits when the server is
gone (`ServerGone`) or answers BYE or STOP.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import traceback

import torch

from gem import algorithms
from gem.data import load_dataset
from gem.engines import Job
from gem.engines.distributed.bounds import TEXT_BYTES
from gem.engines.distributed.group import BYE_TIMEOUT_S, patience, waiting_key
from gem.engines.distributed.job import Start
from gem.engines.distributed.messages import (
    ASK,
    DIVERGED,
    ERROR,
    FINISHED,
    GO,
    PULL,
    READY,
    SAVE,
    SAVED,
    STOP,
    TAG_ASK,
    TAG_X,
    pack,
    rows_json,
    send_bytes,
    wait,
)
from gem.engines.distributed.window import Window
from gem.engines.server import Server
from gem.engines.worker import ROWS_PER_MESSAGE, ROWS_SECONDS, Diverged, Worker, barrier_pauses

WAIT_S = 0.02  # a worker told to WAIT while a checkpoint is being taken asks again after this long (at a barrier:
# worker.barrier_pauses)
WAITING_S = 0.5  # a worker waiting for the server says so on the store this often


def send_header(pg, kind: int, rows: bytes, count: int, extra: bytes, timeout_s: float) -> None:
    """A header to the server, then the rows and the extra bytes it announces."""
    h = torch.tensor([kind, len(rows), count, len(extra)], dtype=torch.long)
    wait(pg.send([h], 0, TAG_ASK), timeout_s)
    if rows:
        send_bytes(pg, rows, 0, TAG_X, timeout_s)
    if extra:
        send_bytes(pg, extra, 0, TAG_X, timeout_s)


class ServerGone(Exception):
    """A send or receive to rank 0 failed, or rank 0's process is gone: the worker exits."""


class _Stopped(Exception):
    """The server answered STOP: the run is ending."""


class RemoteLink:
    """A worker rank's Link to the server over gloo (the transports, link_wire.WireLink and link_turn.TurnLink,
    say what a turn is), and the replica of the server's state that a GO or a PULL fills."""

    commits_in_window = False  # the worker commits to θ in rank 0's window itself (link_turn.TurnLink)

    def __init__(self, pg, rank: int, job: Job, start: Start, store=None):
        self.pg, self.rank, self.job, self.start = pg, rank, job, start
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
        self.replica: Server | None = None  # its own copy, which a GO or PULL over the wire fills
        self.window: Window | None = None  # rank 0's θ in shared memory, where this worker is on its host

    # --- what each transport adds

    def attach(self, algo) -> None:
        """Once the replica and the window are set up: what the transport needs before READY."""

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
            send_header(self.pg, kind, rows, len(self.buffer) if rows else 0, extra, self.wait_s)
        except RuntimeError as e:
            raise ServerGone() from e
        if rows:
            self.buffer, self.sent_at = [], time.monotonic()

    def _recv(self, tensors: list[torch.Tensor], timeout: float) -> None:
        try:
            for t in tensors:
                wait(self.pg.recv([t], 0, TAG_X), timeout)
        except RuntimeError as e:
            raise ServerGone() from e

    def _send(self, tensors: list[torch.Tensor]) -> None:
        try:
            works = [self.pg.send([t], 0, TAG_X) for t in tensors]
            for work in works:
                wait(work, self.wait_s)
        except RuntimeError as e:
            raise ServerGone() from e

    def request(self, kind: int, extra: bytes, pauses, rows: bool = False) -> tuple[int, int]:
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
                    self.save()
                else:
                    time.sleep(next(pauses))
        finally:
            if self.waiting is not None:
                self.waiting.waiting = False

    def receive_view(self, w: int, t: int, pulled_at: int):
        """θ and the server's tensors as the GO that follows sends them, into this worker's replica."""
        server = self.replica
        self._recv([server.theta, *server.state.values()], self.wait_s)
        return self.view_at(w, t, pulled_at)

    def view_at(self, w: int, t: int, pulled_at: int):
        server = self.replica
        server.clock.fill_(t)
        server.pulled_at[w] = pulled_at
        return server.view(w)

    def save(self) -> None:
        """A checkpoint: our state as of before the gradient in hand (or at the barrier)."""
        spec, tensors = pack(self.worker.state_dict(in_hand=True))
        self.header(SAVED, json.dumps(spec).encode())
        self._send(tensors)

    # --- the Link of the worker cycle (acquire, submit and release: the transport's)

    def await_clock(self, w: int, t: int):
        """A barrier: PULL until the server's clock has reached t; the server then sends θ and its tensors over the
        wire (nothing is committed) and marks the pull."""
        clock, _ = self.request(PULL, str(t).encode(), barrier_pauses())
        return self.receive_view(w, clock, clock)

    def now(self) -> float:
        return time.time() - self.t0_wall

    def rows(self, row: dict, tensors) -> None:
        self.buffer.append((row, tensors))

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
            # a GPU worker that copies θ from it at every commit (pinned.py), which all do but a local turn's
            replica = Server.create(algo, job.hp, worker.x.detach().to("cpu", copy=True), job.workers)
            pin = worker.device.type == "cuda" and not self.commits_in_window
            self.server = self.replica = replica.pin_memory() if pin else replica
            if saved is not None:
                worker.load_state_dict(saved)
            if self.start.window:
                self.window = Window.open(self.start.window, self.w, self.server, writable=self.commits_in_window)
            self.attach(algo)
            self.header(READY, b"1" if self.window is not None else b"")
            while worker.cycle(self):
                pass
        except Diverged as e:
            self.header(DIVERGED, str(e).encode()[:TEXT_BYTES])
            return
        except _Stopped:
            return
        except ServerGone:
            raise
        except Exception as e:  # tell the server why, then stop
            self.header(ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc()}".encode()[:TEXT_BYTES])
            return
        self.header(FINISHED)
        try:  # the server's last word: it has everything; then nobody waits for anybody
            self._recv([self.reply], BYE_TIMEOUT_S)
        except ServerGone:
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
