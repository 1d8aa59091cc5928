"""The parameter server's state and its one step, the same on every engine (docs/design.md, "Engines").

The server holds the central variable θ, the algorithm's server tensors, the clock t (commits applied) and, for
every worker, the clock at its last pull. All of it is tensors: the `process` engine puts them in shared memory,
the `distributed` engine keeps them on rank 0 (and a worker keeps an exact replica of θ and the server tensors,
which it brings up to date by replaying the same step), and every engine checkpoints them the same way.

One commit, under the server's turn (whoever holds the turn is the only one touching this state):

    view = server.view(w)                 # θ, server tensors, t, τ = t − (t at w's last pull), w
    commit = worker_rule(..., view, ...)  # the worker's rule reads the live θ
    server.apply(view, commit)            # server_rule(view, commit); t ← t + 1; w pulls at t
"""

from __future__ import annotations

import torch

from gem.algorithms import Algorithm, Commit, View


def state_mismatch(saved: dict, theta: torch.Tensor, state: dict[str, torch.Tensor]) -> str | None:
    """What differs between a checkpoint's central state (`saved`: θ and the server tensors) and this run's, as a
    phrase naming the first tensor in name order; None when every tensor is there with the same shape. A checkpoint
    of another version of an algorithm (ssgd's round was θ-sized before it became a row per worker) differs here."""
    mine = {"theta": theta, **{f"server.{k}": v for k, v in state.items()}}
    theirs = {"theta": saved["theta"], **{f"server.{k}": v for k, v in saved.get("server", {}).items()}}
    for k in sorted(mine.keys() | theirs.keys()):
        if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape:
            there, here = (tuple(d[k].shape) if k in d else "absent" for d in (theirs, mine))
            return (
                f"central {k} is {there} there but {here} in this run (a checkpoint of another version of "
                f"the algorithm); start a new run directory"
            )
    return None


class Server:
    def __init__(
        self,
        algo: Algorithm,
        hp,
        theta: torch.Tensor,
        state: dict[str, torch.Tensor],
        clock: torch.Tensor,
        pulled_at: torch.Tensor,
    ):
        self.algo, self.hp = algo, hp
        self.theta, self.state, self.clock, self.pulled_at = theta, state, clock, pulled_at

    @classmethod
    def create(cls, algo: Algorithm, hp, theta: torch.Tensor, workers: int) -> Server:
        """A fresh server at t = 0, from which every worker has pulled θ₀."""
        return cls(
            algo,
            hp,
            theta,
            algo.server_state(theta, hp, workers),
            torch.zeros((), dtype=torch.long),
            torch.zeros(workers, dtype=torch.long),
        )

    def tensors(self) -> dict:
        """What another process needs to rebuild this server around the same (shared) tensors."""
        return {"theta": self.theta, "state": self.state, "clock": self.clock, "pulled_at": self.pulled_at}

    @property
    def t(self) -> int:
        return int(self.clock)

    def share_memory_(self) -> Server:
        for x in (self.theta, *self.state.values(), self.clock, self.pulled_at):
            x.share_memory_()
        return self

    def to(self, device) -> Server:
        """θ and the algorithm's server tensors on `device`; the clock and the pull times stay where they are (read
        on the host at every turn)."""
        return Server(
            self.algo,
            self.hp,
            self.theta.to(device),
            {k: v.to(device) for k, v in self.state.items()},
            self.clock,
            self.pulled_at,
        )

    def pin_memory(self) -> Server:
        """θ and the algorithm's server tensors copied into page-locked host memory (gem/engines/pinned.py); the
        clock and the pull times as they are."""
        return Server(
            self.algo,
            self.hp,
            self.theta.pin_memory(),
            {k: v.pin_memory() for k, v in self.state.items()},
            self.clock,
            self.pulled_at,
        )

    def gather(self) -> None:
        """Bring θ whole up to date where parts of it are served elsewhere (distributed.shards.Sharded); here it is."""

    def view(self, worker: int) -> View:
        t = int(self.clock)
        return View(self.theta, self.state, t, t - int(self.pulled_at[worker]), worker)

    def apply(self, view: View, commit: Commit) -> int:
        """The server step: the server rule applies the commit, the clock advances, the worker pulls now."""
        self.algo.server_rule(view, commit, self.hp)
        t = view.t + 1
        self.clock.fill_(t)
        self.pulled_at[view.worker] = t
        return t

    def pull(self, worker: int) -> View:
        """A worker that waited at a barrier (Commit.pull_at) pulls θ now: τ counts from here."""
        self.pulled_at[worker] = int(self.clock)
        return self.view(worker)

    def state_dict(self) -> dict:
        return {"theta": self.theta, "server": dict(self.state), "clock": self.clock, "pulled_at": self.pulled_at}

    def load_state_dict(self, saved: dict) -> None:
        mismatch = state_mismatch(saved, self.theta, self.state)
        if mismatch:  # checkpoint.verify refuses this before a run starts; copy_ would broadcast it without a word
            raise ValueError(f"checkpoint: {mismatch}")
        self.theta.copy_(saved["theta"])
        for k, v in saved["server"].items():
            self.state[k].copy_(v)
        self.clock.copy_(saved["clock"])
        self.pulled_at.copy_(saved["pulled_at"])
