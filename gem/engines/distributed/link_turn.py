"""A local launch's worker in shared memory (`TurnLink`): it commits as a `process` worker does. It takes the
server's turn from the worker before it (turn.Turn), runs its worker rule against the live θ in rank 0's window
and the server step in place, notes the commit in the window's log, and hands the turn on; only its rows, a
checkpoint's state and a barrier's pull go over the wire. θ is in the window, or on the workers' GPU, handed to
them by CUDA IPC (`handed`)."""

from __future__ import annotations

import itertools
import time

from gem.algorithms import Commit
from gem.engines.distributed.link import WAIT_S, RemoteLink, ServerGone
from gem.engines.distributed.messages import ASK, ROWS
from gem.engines.distributed.window import log_entry
from gem.engines.server import Server
from gem.engines.turn import SAVE as TURN_SAVE
from gem.engines.turn import Gone, Turn
from gem.engines.worker import ROWS_PER_MESSAGE, ROWS_SECONDS


class TurnLink(RemoteLink):
    commits_in_window = True

    def __init__(self, *args, turn: Turn, alive=None, handed: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # `alive`: the read end of a pipe only rank 0 writes to (end of file once rank 0 is gone); `handed`: θ and
        # the server's tensors on the workers' GPU (CUDA IPC handles)
        self.turn, self.alive, self.handed = turn, alive, handed
        self.holding = False  # this worker holds the turn

    def attach(self, algo) -> None:
        """Commit to the window's θ (or the θ handed to us), its clock and its pulls."""
        if self.window is None:
            where = (self.start.window or {}).get("path")
            raise RuntimeError(
                f"cannot map rank 0's window {where}, where the workers of a local launch take their turn"
            )
        handed, replica, job = self.handed, self.replica, self.job
        if (handed is None) == (self.window.theta is None):
            raise RuntimeError("rank 0's window and the θ it handed this worker disagree on where θ is")
        self.server = self.window.adopt(
            replica
            if handed is None
            else Server(algo, job.hp, handed["theta"], handed["state"], replica.clock, replica.pulled_at)
        )

    def acquire(self, w: int):
        """The turn, from the worker before this one (never while this worker sends on the wire: rank 0's server
        thread may wait for the turn, and then takes no message). A run that ends stops the turn (Gone): the rows
        this worker holds go with one last ASK, which the server answers STOP. (Rank 0 sees it in line: it need not
        say on the store that it waits.)"""
        asked: list[int] = []  # the clock when it took its place in line (as the process engine's rows say)
        try:
            self.turn.acquire(
                w, self.turn_waiting, self.turn_request, on_queued=lambda: asked.append(int(self.server.clock))
            )
        except Gone:
            self.request(ASK, b"", itertools.repeat(WAIT_S), rows=True)
            raise RuntimeError("the server answered GO to a worker that takes its turn in shared memory") from None
        self.holding = True
        view = self.server.view(w)
        self.extra = {"wait_commits": view.t - asked[0]}  # commits by others between taking its place and the turn
        return view

    def turn_waiting(self) -> None:
        """About once a second while in line: rank 0 is gone once its end of the `alive` pipe is closed."""
        if self.alive is not None and self.alive.poll():
            raise ServerGone()

    def turn_request(self, action: int) -> None:
        """Rank 0 holds the turn and asks for a checkpoint: our state, over the wire, while we wait in line (a
        worker in line that does not answer is to blame: launch._Coordinator.watch)."""
        if action == TURN_SAVE:
            self.save()

    def submit(self, view, commit: Commit) -> None:
        # the server step follows here, in place: rank 0 reads who made it in the log
        log = self.window.log
        log[view.t % log.numel()] = log_entry(view.t, self.w)

    def release(self) -> None:
        if self.holding:
            self.holding = False
            self.turn.release(self.turn_waiting)

    def rows(self, row: dict, tensors) -> None:
        super().rows(row, tensors)
        if len(self.buffer) >= ROWS_PER_MESSAGE or time.monotonic() - self.sent_at > ROWS_SECONDS:
            self.header(ROWS)  # no ASK to carry them: the turn is not rank 0's
