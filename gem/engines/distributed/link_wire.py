"""A worker's commits as exchanges over the wire (`WireLink`): ASK; GO with the clock and τ; COMMIT with Δ and the
worker rule's payload. What else crosses, server_wire.py says: where the worker rule reads the live θ, GO carries θ
and the server's tensors and the worker replays the server step on its replica to pull; where it reads none (full
duplex), the worker's rule runs on its own state and the server sends θ back once it has applied the commit (a rule
that reads a few of the server's tensors and no θ gets those with GO: `go_sends`); where
the part of the rule that reads θ runs at the server (full duplex, `Algorithm.at_server`: GEM), the worker sends
what the part declares in place of its commit, and takes back θ (or the commit's delta) and the commit's metrics
and statistics for its row (`commit_at_server`). A launcher's rank on rank 0's host that maps rank 0's window
(window.py) reads θ there and leaves Δ in its slot, so only headers cross (rank 0 applies no other commit while the
exchange lasts); it runs its whole rule itself."""

from __future__ import annotations

import itertools
import json
import time

import torch

from gem.algorithms import AtServer, Commit
from gem.engines.distributed.job import full_duplex
from gem.engines.distributed.link import WAIT_S, RemoteLink, ServerGone
from gem.engines.distributed.messages import ASK, PUSH, TAG_ASK, TAG_X, pack, wait
from gem.engines.distributed.shards import combine, shard_ranks, slices
from gem.engines.server import Server


class WireLink(RemoteLink):
    duplex = False  # θ comes back after the commit (server_wire.py), set at attach
    waited = 0.0  # full duplex: seconds this commit waited for GO
    at_server: AtServer | None = None  # the part of the worker rule that reads θ runs at rank 0 (set at attach)
    back: torch.Tensor | None = None  # where the commit's delta comes back, for a rule at rank 0 that does not pull

    shards: list[tuple[int, int, int]] = []  # several servers: (rank, lo, hi) of each shard, rank 0's first
    go_sends: tuple[str, ...] = ()  # full duplex: the server's tensors GO carries, which the rule reads (set at attach)

    def attach(self, algo) -> None:
        # the same choice rank 0 makes (server_wire.WireServer.duplex), from the same job
        duplex = full_duplex(self.job) if self.window is None else None
        self.duplex = duplex is not None
        self.go_sends = duplex.go_sends if duplex is not None else ()
        if self.duplex:
            r = self.replica
            self.server = self.replica = _Pulled(r.algo, r.hp, r.theta, r.state, r.clock, r.pulled_at)
        if duplex is not None and duplex.at_server is not None:
            self.at_server = duplex.at_server
            for k in self.at_server.keeps:  # they live at rank 0, which puts them into this worker's checkpoints
                del self.worker.state[k]
            if self.at_server.finish is not None:
                self.back = torch.empty_like(self.replica.theta)
        servers = self.job.engine.servers
        if servers > 1:  # (the config's validation has made sure the run is in full duplex)
            cuts = slices(self.replica.theta.numel(), servers)
            ranks = shard_ranks(self.job.workers, servers)
            self.shards = [(r, lo, hi) for r, (lo, hi) in zip(ranks, cuts, strict=True)]

    def acquire(self, w: int):
        asked = time.monotonic()
        t, staleness = self.request(ASK, b"", itertools.repeat(WAIT_S))
        if self.duplex:  # the rule reads no θ: the replica holds the θ this worker last pulled, and stands in
            if self.go_sends:  # with the server's tensors the rule reads, as GO sent them after it
                self._recv([self.replica.state[k] for k in self.go_sends], self.wait_s)
            self.waited = time.monotonic() - asked
            return self.view_at(w, t, t - staleness)
        if self.window is None:
            return self.receive_view(w, t, t - staleness)
        replica, window = self.replica, self.window  # our turn: rank 0 applies no other commit until ours has come
        replica.theta.copy_(window.theta)
        for k, v in replica.state.items():
            v.copy_(window.state[k])
        return self.view_at(w, t, t - staleness)

    def submit(self, view, commit: Commit) -> None:
        if self.shards:
            self.submit_sharded(commit)
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
        if self.duplex:  # θ as the server left it once our commit was applied: the pull
            began = time.monotonic()
            self._recv([self.replica.theta], self.wait_s)
            # the row's wait for the server: for GO, and for θ to come back, as where GO brings θ
            self.extra["wait_s"] = self.waited + time.monotonic() - began

    def commit_at_server(self, view, sent: dict[str, torch.Tensor]) -> tuple[Commit, dict | None]:
        """The part of the worker rule that reads θ runs at rank 0: what it declares (`sent`, on the host) goes up
        as a commit that announces no payload, and back come θ (the pull) or the commit's delta (a commit that does
        not pull), then the commit's metrics and per-tensor statistics, computed there. Returns the commit as the
        worker cycle uses it (its delta, whether it pulls, its metrics) and the statistics."""
        began = time.monotonic()
        pull = self.at_server.finish is None
        into, nbytes = self.replica.theta if pull else self.back, torch.zeros(1, dtype=torch.long)
        if self.shards:  # each shard runs the part on its slice (shards.sliceable): slices up, slices back
            self.exchange_slices([t.contiguous() for t in sent.values()], into)
            metrics, tensors = self.statistics_of_shards()
        else:
            self._send([torch.tensor([0, 0], dtype=torch.long), *(t.contiguous() for t in sent.values())])
            self._recv([into, nbytes], self.wait_s)
            text = torch.empty(int(nbytes[0]), dtype=torch.uint8)
            self._recv([text], self.wait_s)
            metrics, tensors = json.loads(text.numpy().tobytes())
        # the row's wait for the server: for GO, and for θ to come back, as where GO brings θ
        self.extra["wait_s"] = self.waited + time.monotonic() - began
        return Commit(delta=into, pull=pull, metrics=metrics), tensors

    def statistics_of_shards(self) -> tuple[dict, dict | None]:
        """The statistics each shard made of this commit on its slice, which follow its slice of θ, added up into the
        row's as the algorithm says (shards.combine)."""
        sizes = [torch.zeros(1, dtype=torch.long) for _ in self.shards]
        self._each_shard([self.pg.recv([n], r, TAG_X) for n, (r, _, _) in zip(sizes, self.shards, strict=True)])
        texts = [torch.empty(int(n[0]), dtype=torch.uint8) for n in sizes]
        self._each_shard([self.pg.recv([t], r, TAG_X) for t, (r, _, _) in zip(texts, self.shards, strict=True)])
        parts = [json.loads(t.numpy().tobytes()) for t in texts]
        cuts = [(lo, hi) for _, lo, hi in self.shards]
        return combine(self.replica.algo.over_slices, parts, self.worker.layout, cuts)

    def _each_shard(self, works: list) -> None:
        """Wait for one receive from each shard's server, in shard order."""
        for k, ((r, _, _), work) in enumerate(zip(self.shards, works, strict=True)):
            self._wait_shard(k, r, work)

    def _wait_shard(self, k: int, r: int, work) -> None:
        """A shard's server gone ends this worker with an error that names it (rank 0 ends the run: it has lost the
        shard too); rank 0 gone, as with one server."""
        try:
            wait(work, self.wait_s)
        except RuntimeError as e:
            if r == 0:
                raise ServerGone() from e
            raise RuntimeError(f"server of shard {k} (rank {r}) lost: {str(e).splitlines()[0]}") from e

    def submit_sharded(self, commit: Commit) -> None:
        """Several servers: slice 0 of the commit to rank 0 and slice k to shard k, all on their way at once, then
        each slice of θ back, the pull (docs/design.md, "Sharded servers")."""
        began = time.monotonic()
        self.exchange_slices([commit.delta], self.replica.theta)
        self.extra["wait_s"] = self.waited + time.monotonic() - began

    def exchange_slices(self, up: list[torch.Tensor], back: torch.Tensor) -> None:
        """Slice k of each of `up` (θ-shaped) to shard k's server and slice k of `back` from it, for every shard, all
        on their way at once. A shard's server gone ends this worker with an error that names it (rank 0 ends the
        run: it has lost the shard too)."""
        pg = self.pg
        works = []  # (shard, its rank, a send or receive), every one posted before any is waited for
        for k, (r, lo, hi) in enumerate(self.shards):
            # rank 0's slice follows GO as a commit does (a first word announcing no payload); the others' a PUSH
            first, tag = ([0, 0], TAG_X) if r == 0 else ([PUSH, 0, 0, 0], TAG_ASK)
            works.append((k, r, pg.send([torch.tensor(first, dtype=torch.long)], r, tag)))
            works += [(k, r, pg.send([t[lo:hi].contiguous()], r, TAG_X)) for t in up]
        works += [(k, r, pg.recv([back[lo:hi]], r, TAG_X)) for k, (r, lo, hi) in enumerate(self.shards)]
        for k, r, work in works:
            self._wait_shard(k, r, work)

    def release(self) -> None:
        pass  # the exchange ended with the commit


class _Pulled(Server):
    """A full-duplex worker's replica: rank 0 applied the commit, and θ came back with it (`WireLink.submit`), so
    the step here only moves the clock and notes the pull. The server's tensors stay as they were: the rule reads
    none of them but those GO brings (`go_sends`: Ringmaster's counters), and a barrier's PULL brings them all with
    θ."""

    def apply(self, view, commit: Commit) -> int:
        t = view.t + 1
        self.clock.fill_(t)
        self.pulled_at[view.worker] = t
        return t
