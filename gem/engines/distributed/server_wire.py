"""Rank 0's server over the wire (`WireServer`): commits are applied one at a time, in the order the workers' ASKs
arrive. A worker asks (ASK); the server answers GO with the clock and τ; the worker sends its commit (Δ and the
worker rule's payload) and the server rule applies it. What else crosses depends on the algorithm's worker rule:

- it reads the live θ or the server's tensors (`Algorithm.reads_central`: GEM, EASGD, ...): GO carries θ and the
  server's tensors, the worker's rule runs on them and its commit comes back, and the worker replays the server
  step on its replica to pull. The exchange is served whole, so θ's way out and Δ's way back take turns: each
  direction of the link idles half the time (half duplex);
- it does not (DOWNPOUR, DC-ASGD, ...): GO carries only t and τ, the worker's rule runs on its own state, and once
  the commit is applied the server sends θ back, the worker's pull, from a copy (`sending`), and goes on to the
  next ASK without waiting for it to arrive: θ goes out to one worker while the next worker's Δ comes in (full
  duplex, docs/design.md). The commit is applied to the same θ, at the same t and τ, as in the exchange above.

A worker on rank 0's host that maps rank 0's window (window.py: a launcher's ranks on node 0) reads θ there at GO
and leaves Δ in its slot, so only headers cross, whatever its rule reads.

Every worker starts from one θ: an ASK that comes before every worker is ready waits (`early`) until they are.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from gem.algorithms import Commit
from gem.engines.distributed.bounds import ROWS_PENDING
from gem.engines.distributed.job import full_duplex
from gem.engines.distributed.messages import GO, STOP, TAG_X, connection_closed, recv_bytes, recv_tensors, wait
from gem.engines.distributed.server import ParameterServer, Standing, StepsLost, all_started

# θ on its way back to workers at once, at most (each from a copy of its own, since θ changes meanwhile): two keep
# the way out busy, one finishing while the next starts; a third would wait for the first, which the commit
# applied in between (its Δ as large as θ, on the other direction of the same link) has let finish by then
SENDS_IN_FLIGHT = 2


class WireServer(ParameterServer):
    """Exchanges over the wire, applied one at a time in the order the workers' headers arrive; θ's way back to one
    worker overlaps the next worker's commit where the algorithm's worker rule reads no θ (`duplex`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.early: deque = deque()  # ASKs that came before every worker was ready: all start from one θ
        self.delta = torch.empty_like(self.server.theta, device="cpu")  # Δ of the commit being applied
        # full duplex: the worker rule runs without the live θ, so θ need not go out before the commit comes back
        self.duplex = full_duplex(self.job)
        self.sending: deque = deque()  # (rank, its send, the copy of θ it sends): θ on its way back, oldest first

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
        mapped = self.peers[src].maps_window
        duplex = self.duplex and not mapped
        try:
            payload = self.go_and_commit(src, view, with_theta=not (mapped or duplex))
        except (RuntimeError, ValueError) as e:
            self.gone(src, e)
            return
        self.apply(src, view, payload)
        if duplex and self.peers[src].standing is not Standing.BANNED:
            self.send_back(src)
        self.busy_s += time.perf_counter() - began
        self.served += 1

    def go_and_commit(self, src: int, view, with_theta: bool) -> dict:
        """GO with the clock and τ, and (`with_theta`) the live θ and the server's tensors, all in flight at once;
        then the commit: Δ into self.delta, and the payload it returns. A worker that maps the window gets only GO
        (θ is where it reads it: nothing changes θ until this exchange ends), and leaves Δ in its slot there; so
        does a worker whose rule reads no θ (full duplex), which gets θ after its commit (`send_back`)."""
        server, mapped = self.server, self.peers[src].maps_window
        state = (server.theta, *server.state.values()) if with_theta else ()
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

    def send_back(self, src: int) -> None:
        """Full duplex: θ just after `src`'s commit, its pull, on its way from a copy while the server goes on to
        the next commit. The send is waited for only when its copy is needed again (`free_copy`): gloo sends it in
        the background, and sends to one worker arrive in the order they were made."""
        copy = self.free_copy()
        copy.copy_(self.server.theta)
        try:
            self.sending.append((src, self.pg.send([copy], src, TAG_X), copy))
        except RuntimeError as e:
            self.gone(src, e)

    def free_copy(self) -> torch.Tensor:
        """A copy of θ no send reads any more: a new one while fewer than SENDS_IN_FLIGHT are on their way, else the
        oldest's, once it has arrived (a worker whose connection closed meanwhile is lost, as in an exchange)."""
        if len(self.sending) < SENDS_IN_FLIGHT:
            return torch.empty_like(self.server.theta, device="cpu")
        src, work, copy = self.sending.popleft()
        try:
            wait(work, self.wait_s)
        except RuntimeError as e:
            if self.peers[src].expected or not connection_closed(e):  # (one already lost: as expected)
                self.gone(src, e)
        return copy

    def pull(self, src: int) -> None:
        with self.lock:
            view = self.server.pull(src - 1)
        self.send_pulled(src, view, self.server.theta, self.server.state)
