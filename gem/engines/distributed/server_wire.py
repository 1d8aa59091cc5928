"""Rank 0's server over the wire (`WireServer`): each commit is one exchange, served whole before the next. A worker
asks (ASK); the server answers GO with the clock, τ, θ and its tensors; the worker sends its commit (Δ and the
worker rule's payload) and the server rule applies it. A worker on rank 0's host that maps rank 0's window
(window.py: a launcher's ranks on node 0) reads θ there and leaves Δ in its slot, so only headers cross.

Every worker starts from one θ: an ASK that comes before every worker is ready waits (`early`) until they are.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from gem.algorithms import Commit
from gem.engines.distributed.bounds import ROWS_PENDING
from gem.engines.distributed.messages import GO, STOP, TAG_X, recv_bytes, recv_tensors, wait
from gem.engines.distributed.server import ParameterServer, Standing, StepsLost, all_started


class WireServer(ParameterServer):
    """Exchanges over the wire, one at a time, in the order the workers' headers arrive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.early: deque = deque()  # ASKs that came before every worker was ready: all start from one θ
        self.delta = torch.empty_like(self.server.theta, device="cpu")  # Δ of the commit being applied

    def step(self, started: bool) -> bool:
        if self.early and started:
            self.exchange(self.early.popleft())
            return True
        return False

    def claims(self, src: int, extra: bytes) -> str | None:
        """b"1": `src` maps θ from the window, which it may only where the window gives it a slot; b"": it uses
        the wire."""
        if not extra:
            return None
        if extra != b"1":
            return f"a READY header followed by {extra!r} (b'1', that it maps θ from shared memory, or nothing)"
        window = self.window
        if window is None or not 0 <= src - 1 < window.slots:
            return "a READY header saying that it maps θ from shared memory, where " + (
                "rank 0 keeps none" if window is None else f"only workers 0 to {window.slots - 1} have a slot"
            )
        self.peers[src].maps_window = True
        return None

    def on_ask(self, src: int) -> None:
        """A worker asks for its turn: during a checkpoint it is told to SAVE or WAIT; before every worker is
        ready it waits for them (all start from one θ); else its exchange, now."""
        if self.saving is not None and not self.stopping:
            self.hold(src)
        elif not all_started(self.peers):
            self.early.append(src)
        else:
            self.exchange(src)

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
        with self.lock:
            view = self.server.pull(src - 1)
        self.send_pulled(src, view, self.server.theta, self.server.state)
