"""Rank 0's server over the wire (`WireServer`): commits are applied one at a time, in the order the workers' ASKs
arrive. A worker asks (ASK); the server answers GO with the clock and τ; the worker sends its commit (Δ and the
worker rule's payload) and the server rule applies it. What else crosses depends on the algorithm's worker rule
(job.full_duplex decides, from the job alone, as each worker does):

- it reads no θ nor the server's tensors (`Algorithm.reads_central` False: sgd, downpour, adaptive, agn, dcasgd,
  delay_adaptive, ssgd, async_localsgd without `dynamic_window`): GO carries only t and τ, the worker's rule runs on
  its own state, and once the commit is applied the server sends θ back, the worker's pull, from a copy
  (`Outbox`), and goes on to the next ASK without waiting for it to arrive: θ goes out to one worker while the next
  worker's Δ comes in (full duplex, docs/design.md). The commit is applied to the same θ, at the same t and τ, as
  in the exchange below;
- it reads the live θ and declares the part that does to run at the server (`Algorithm.at_server`: gem, local or
  global proxy, and easgd): full duplex too. The worker sends what the part declares (GEM: its gradient) where it
  would send its commit; the part runs here, under the clock, on that worker's tensors kept here (`kept`: GEM's m
  and s) and the live θ, and its commit is applied; θ goes back as above (or the commit's delta, for a commit that
  does not pull), and after it the commit's metrics and per-tensor statistics, computed here (`statistics`);
- it reads no θ, only some of the server's tensors, which it declares (`Algorithm.reads_server`: ringmaster's and
  rennala's counters, async_localsgd's paces with `dynamic_window`): full duplex too, GO carrying those tensors
  (`go_sends`), as they are when the commit is applied;
- it reads the live θ and declares no part to run here (eamsgd), or `engine.full_duplex=false`: GO carries θ and
  the server's tensors, the worker's rule runs on them and its commit comes back, and the worker replays the server
  step on its replica to pull. The exchange is served whole, so θ's way out and Δ's way back take turns: each
  direction of the link idles half the time (half duplex).

A worker on rank 0's host that maps rank 0's window (window.py: a launcher's ranks on node 0) reads θ there at GO
and leaves Δ in its slot, so only headers cross, whatever its rule reads; it runs its rule itself, on its own state.

Every worker starts from one θ: an ASK that comes before every worker is ready waits (`early`) until they are.
"""

from __future__ import annotations

import json
import time
from collections import deque

import torch

from gem.algorithms import Commit
from gem.engines.distributed.bounds import ROWS_PENDING, sent_buffers
from gem.engines.distributed.job import full_duplex
from gem.engines.distributed.messages import (
    GO,
    STOP,
    TAG_X,
    connection_closed,
    recv_bytes,
    recv_tensors,
    wait,
)
from gem.engines.distributed.server import Fatal, ParameterServer, Standing, StepsLost, all_started

# θ on its way back to workers at once, at most (each from a copy of its own, since θ changes meanwhile): two keep
# the way out busy, one finishing while the next starts; a third would wait for the first, which the commit
# applied in between (its Δ as large as θ, on the other direction of the same link) has let finish by then
SENDS_IN_FLIGHT = 2


def returned(part, commit: Commit | None, theta: torch.Tensor) -> torch.Tensor:
    """What goes back to a worker once its commit is applied (rank 0's and every shard's server): θ, its pull; or,
    where the part of its rule that reads θ ran here (`part`) and its commit does not pull (the part's `finish`),
    the commit's delta, which the worker's `finish` applies (EASGD's E)."""
    return commit.delta if part is not None and part.finish is not None else theta


def statistics(algo, made: Commit, layout, hp) -> bytes:
    """What the worker's row takes of a commit made at a server, as JSON [metrics, per-tensor statistics or null]:
    the commit's metrics, then its diagnostics (GEM's π statistics and energies), in the order a worker that made
    the commit would put them in its row, over the model's tensors as `layout` gives them (all of θ at rank 0 with
    one server; a shard's pieces of them with several, which the worker adds up: shards.combine). The server
    computes them from the tensors the rule left there (π never travels); the worker builds and sends the row, as
    for every commit."""
    metrics, tensors = dict(made.metrics), None
    if algo.diagnostics is not None:
        more, tensors = algo.diagnostics(made, layout, hp)
        metrics.update(more)
    return json.dumps([metrics, tensors or None]).encode()


def post_back(pg, outbox: Outbox, src: int, back: torch.Tensor, text, wait_s: float, failed) -> None:
    """What goes back to `src` once its commit is applied (`back`: θ, or the commit's delta; a server's slice of
    it with several), sent from a copy through the `outbox` while the server goes on; then, where the commit was
    made here, its statistics (`text()`, computed while `back` is on its way). A send that cannot start raises
    RuntimeError (the worker's loss alone); `failed(rank, error)` hears of an earlier send that failed."""
    copy = outbox.free(wait_s, failed)
    copy.copy_(back)
    sends = []
    try:
        sends.append(pg.send([copy], src, TAG_X))
    finally:
        outbox.post(src, sends, [copy])
    if text is not None:
        data = bytearray(text())
        trailing = [torch.tensor([len(data)], dtype=torch.long), torch.frombuffer(data, dtype=torch.uint8)]
        sends = []
        try:
            sends += [pg.send([t], src, TAG_X) for t in trailing]
        finally:
            outbox.trail(src, sends, trailing, wait_s)


class Outbox:
    """Model-sized messages on their way back to workers (θ, or a shard's slice of it), each from a copy of its own
    while the server goes on, at most SENDS_IN_FLIGHT at once: a send is waited for only when its copy is needed
    again (`free`). gloo sends in the background, and sends to one worker arrive in the order they were made. Used
    by rank 0's WireServer and by every shard's server (shards.ShardServer)."""

    def __init__(self, like: torch.Tensor):
        self.like = like
        self.sending: deque = deque()  # (rank, its sends, the tensors they read), oldest first
        # the small messages after them (a commit's statistics), by worker rank: the last ones to each worker, which
        # the server waits for only at that worker's next commit. A worker on several servers takes them only once
        # every server has sent its slice, so a server that waited for them before its next commit (anyone's) could
        # wait on another that waits for it (two servers that took the same commits in different orders); by the
        # worker's next commit, it has taken them (it does before it sends again). One entry per worker: a gloo
        # send says it has completed only once waited for, so they cannot be let go of as they arrive
        self.trailing: dict[int, tuple[list, list]] = {}

    def free(self, wait_s: float, failed) -> torch.Tensor:
        """A copy no send reads any more: a new one while fewer than SENDS_IN_FLIGHT are on their way, else the
        oldest's, once it has arrived. If that send failed, `failed(rank, error)` says so and a new copy is made
        (gloo may still read the old one, for a worker that is that worker's loss alone)."""
        if len(self.sending) < SENDS_IN_FLIGHT:
            return torch.empty_like(self.like, device="cpu")
        src, sends, held = self.sending.popleft()
        try:
            for work in sends:
                wait(work, wait_s)
        except RuntimeError as e:
            failed(src, e)
            return torch.empty_like(self.like, device="cpu")
        return held[0]

    def post(self, src: int, sends: list, held: list) -> None:
        self.sending.append((src, sends, held))

    def trail(self, src: int, sends: list, held: list, wait_s: float) -> None:
        """Small sends to `src` after a post, held until its next ones: the previous ones, which `src` has taken
        by now, are waited for here (one that failed is that worker's loss, known already)."""
        for work in self.trailing.pop(src, ([], []))[0]:
            try:
                wait(work, wait_s)
            except RuntimeError:
                pass
        self.trailing[src] = (sends, held)

    def flush(self, wait_s: float) -> None:
        """Wait for every send on its way (the server's end); a failed one is its worker's loss, already known."""
        pending = [sends for _, sends, _ in self.sending] + [sends for sends, _ in self.trailing.values()]
        for sends in pending:
            for work in sends:
                try:
                    wait(work, wait_s)
                except RuntimeError:
                    pass
        self.sending.clear()
        self.trailing.clear()


class WireServer(ParameterServer):
    """Exchanges over the wire, applied one at a time in the order the workers' headers arrive; θ's way back to one
    worker overlaps the next worker's commit where the algorithm's worker rule reads no θ, or runs its part that
    reads θ here (`duplex`; `at_server`)."""

    def __init__(self, *args, layout=(), shards=None, **kwargs):
        super().__init__(*args, **kwargs)
        # several servers: rank 0 serves θ's first slice (`server.theta`), and the others' servers keep their slices
        # of the tensors kept for each worker, which a checkpoint's worker file takes whole (`on_saved`)
        self.shards = shards
        self.early: deque = deque()  # ASKs that came before every worker was ready: all start from one θ
        self.delta = torch.empty_like(self.server.theta, device="cpu")  # Δ of the commit being applied
        # full duplex: the worker rule runs without the live θ, or its part that reads θ runs here, so θ need not go
        # out before the commit comes back
        duplex = full_duplex(self.job)
        self.duplex = duplex is not None
        self.at_server = duplex.at_server if duplex is not None else None
        self.go_sends = duplex.go_sends if duplex is not None else ()  # the server's tensors GO carries
        # where the part runs here: each worker's tensors it keeps (GEM's m and s), made as the worker would make
        # them from θ as it is now, θ₀ (a resumed run's come from the checkpoint: `restore`); what a worker sends
        # for it, into buffers of the sizes the algorithm declares; the model's tensors, for its statistics
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.sent: dict[str, torch.Tensor] = {}
        self.layout = list(layout)  # (of rank 0's slice of θ, where θ is sharded: shards.pieces)
        if self.at_server is not None:
            made = self.server.algo.init_state(self.server.theta, self.job.hp)
            self.kept = {r: {k: made[k].clone() for k in self.at_server.keeps} for r in self.ranks}
            # (of θ's shape, or of rank 0's slice of it where θ is sharded: shards.sliceable)
            self.sent = sent_buffers(self.server.algo, self.server.theta, self.job.hp)
        self.outbox = Outbox(self.server.theta)  # θ on its way back to workers (full duplex)

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
        """`src`'s turn: GO (with θ, in half duplex), its commit back (or what the part of its rule run here takes,
        and the part), applied, and θ back in full duplex; timed (busy_s) for the run's summary."""
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
        at_server = duplex and self.at_server is not None  # (one that maps the window runs its rule itself)
        try:
            if at_server:
                self.go_and_send(src, view)
            else:
                payload = self.go_and_commit(src, view, with_theta=not (mapped or duplex))
        except (RuntimeError, ValueError) as e:
            self.gone(src, e)
            return
        if at_server:  # (what fails in the rule is the server's to report, not the worker's)
            commit = self.at_server.rule(self.kept[src], self.sent, view, self.job.hp)
        else:
            commit = Commit(delta=self.delta, payload=payload)
        self.apply(src, view, commit)
        if duplex and self.peers[src].standing is not Standing.BANNED:
            self.send_back(src, commit if at_server else None)
        self.busy_s += time.perf_counter() - began
        self.served += 1

    def go(self, src: int, view, state: tuple = ()) -> None:
        """GO with the clock, τ and the server's patience, and `state` (θ and the server's tensors) after it, all in
        flight at once."""
        go = torch.tensor([GO, view.t, view.staleness, int(self.wait_s * 1000)], dtype=torch.long)
        sends = [self.pg.send([v], src, TAG_X) for v in (go, *state)]
        for s in sends:
            wait(s, self.wait_s)

    def go_and_send(self, src: int, view) -> None:
        """Where the part of `src`'s worker rule that reads θ runs here (`Algorithm.at_server`): GO with the clock
        and τ; then what the worker sends for the part, exactly the tensors the algorithm declares, into `sent`
        (its commit's first word must announce no payload: the payload is made here)."""
        self.go(src, view)
        header = torch.zeros(2, dtype=torch.long)
        wait(self.pg.recv([header], src, TAG_X), self.wait_s)
        self.bounds.commit(int(header[0]), at_server=True)
        for t in self.sent.values():
            wait(self.pg.recv([t], src, TAG_X), self.wait_s)

    def go_and_commit(self, src: int, view, with_theta: bool) -> dict:
        """GO with the clock and τ, and (`with_theta`) the live θ and the server's tensors (in full duplex, those the
        rule reads: `go_sends`), all in flight at once;
        then the commit: Δ into self.delta, and the payload it returns. A worker that maps the window gets only GO
        (θ is where it reads it: nothing changes θ until this exchange ends), and leaves Δ in its slot there; so
        does a worker whose rule reads no θ (full duplex), which gets θ after its commit (`send_back`)."""
        server, mapped = self.server, self.peers[src].maps_window
        if with_theta:
            state = (server.theta, *server.state.values())
        else:  # full duplex: the server's tensors the rule reads, if any; a worker that maps the window reads them
            state = () if mapped else tuple(server.state[k] for k in self.go_sends)
        self.go(src, view, state)
        header = torch.zeros(2, dtype=torch.long)
        wait_s = self.wait_s
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

    def apply(self, src: int, view, commit: Commit) -> None:
        """The server rule on θ; the commit is pending until `src`'s row for it comes."""
        with self.lock:
            t = self.server.apply(view, commit)
            self.commits.append((src - 1, time.monotonic()))  # progress, for the coordinator's Silence
            pending = self.peers[src].pending
            if pending is not None:
                pending.append(t)
            else:  # given up for lost while this exchange ran: its row will never come
                self.events.put(StepsLost([t]))
        if pending is not None and len(pending) > ROWS_PENDING:
            self.ban(src, f"no rows for its last {len(pending)} commits (at most {ROWS_PENDING} may await rows)")

    def send_back(self, src: int, made: Commit | None = None) -> None:
        """Full duplex: θ just after `src`'s commit, its pull, on its way from a copy while the server goes on to
        the next commit, through the `Outbox`. `made`: the commit that the
        part of the rule run here made; then the commit's delta goes back instead of θ where it does not pull
        (the part's `finish`), and after it the row's metrics and per-tensor statistics, computed here while θ is
        on its way (`statistics`)."""
        back = returned(self.at_server if made is not None else None, made, self.server.theta)
        text = (lambda: statistics(self.server.algo, made, self.layout, self.job.hp)) if made is not None else None
        try:
            post_back(self.pg, self.outbox, src, back, text, self.wait_s, self.failed_back)
        except RuntimeError as e:
            self.gone(src, e)

    def failed_back(self, src: int, e: Exception) -> None:
        """θ's way back to `src` failed: it is lost, as in an exchange (one already lost: as expected)."""
        if self.peers[src].expected or not connection_closed(e):
            self.gone(src, e)

    def on_saved(self, src: int, state: dict) -> None:
        """A worker whose rule runs here holds none of the tensors kept here: they go into its file, as they are
        before the gradient it holds (it was told SAVE at its ASK, before it sent what its rule takes)."""
        if self.at_server is not None and not self.peers[src].maps_window:
            if not isinstance(state.get("state"), dict):
                self.ban(src, "a saved state without its algorithm state (a dict of tensors)")
                return
            kept = self.kept[src]
            if self.shards is not None and kept:  # rank 0's slice, then each other server's
                try:
                    others = self.shards.fetch_kept(src, kept)
                except RuntimeError as e:  # a server lost: the run ends (this checkpoint is not finished)
                    self.events.put(Fatal(str(e)))
                    return
                kept = {k: torch.cat([v, *(o[k] for o in others)]) for k, v in kept.items()}
            state["state"].update(kept)
        super().on_saved(src, state)

    def restore(self, states: dict) -> None:
        """A resumed run: each worker's tensors kept here, from its saved state (`states`, by rank), into which a
        checkpoint put them (`on_saved`)."""
        if self.at_server is None:
            return
        for r, saved in states.items():
            if r in self.kept and isinstance(saved, dict) and "state" in saved:
                for k, v in self.kept[r].items():  # (rank 0's slice, the first, where θ is sharded)
                    v.copy_(saved["state"][k][: v.numel()])

    def pull(self, src: int) -> None:
        with self.lock:
            view = self.server.pull(src - 1)
        self.send_pulled(src, view, self.server.theta, self.server.state)
