"""A worker's commits as exchanges over the wire (`WireLink`): ASK; GO with the clock, τ, θ and the server's
tensors; COMMIT with Δ and the worker rule's payload. The worker then replays the server step on its replica. A
launcher's rank on rank 0's host that maps rank 0's window (window.py) reads θ there and leaves Δ in its slot, so
only headers cross (rank 0 applies no other commit while the exchange lasts)."""

from __future__ import annotations

import itertools
import json

import torch

from gem.algorithms import Commit
from gem.engines.distributed.link import WAIT_S, RemoteLink
from gem.engines.distributed.messages import ASK, pack


class WireLink(RemoteLink):
    def acquire(self, w: int):
        t, staleness = self.request(ASK, b"", itertools.repeat(WAIT_S))
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

    def release(self) -> None:
        pass  # the exchange ended with the commit
