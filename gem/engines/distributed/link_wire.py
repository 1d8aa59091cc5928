"""A worker's commits as exchanges over the wire (`WireLink`): ASK; GO with the clock and τ; COMMIT with Δ and the
worker rule's payload. What else crosses, server_wire.py says: where the worker rule reads the live θ, GO carries θ
and the server's tensors and the worker replays the server step on its replica to pull; where it reads none (full
duplex), the worker's rule runs on its own state and the server sends θ back once it has applied the commit. A
launcher's rank on rank 0's host that maps rank 0's window (window.py) reads θ there and leaves Δ in its slot, so
only headers cross (rank 0 applies no other commit while the exchange lasts)."""

from __future__ import annotations

import itertools
import json
import time

import torch

from gem.algorithms import Commit
from gem.engines.distributed.job import full_duplex
from gem.engines.distributed.link import WAIT_S, RemoteLink
from gem.engines.distributed.messages import ASK, pack
from gem.engines.server import Server


class WireLink(RemoteLink):
    duplex = False  # θ comes back after the commit (server_wire.py), set at attach
    waited = 0.0  # full duplex: seconds this commit waited for GO

    def attach(self, algo) -> None:
        # the same choice rank 0 makes (server_wire.WireServer.duplex), from the same job
        self.duplex = self.window is None and full_duplex(self.job)
        if self.duplex:
            r = self.replica
            self.server = self.replica = _Pulled(r.algo, r.hp, r.theta, r.state, r.clock, r.pulled_at)

    def acquire(self, w: int):
        asked = time.monotonic()
        t, staleness = self.request(ASK, b"", itertools.repeat(WAIT_S))
        if self.duplex:  # the rule reads no θ: the replica holds the θ this worker last pulled, and stands in
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

    def release(self) -> None:
        pass  # the exchange ended with the commit


class _Pulled(Server):
    """A full-duplex worker's replica: rank 0 applied the commit, and θ came back with it (`WireLink.submit`), so
    the step here only moves the clock and notes the pull. The server's tensors stay as they were: the rule reads
    none of them, and a barrier's PULL brings them with θ."""

    def apply(self, view, commit: Commit) -> int:
        t = view.t + 1
        self.clock.fill_(t)
        self.pulled_at[view.worker] = t
        return t
