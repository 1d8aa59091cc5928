"""DOWNPOUR (Dean et al. 2012): workers take local momentum-SGD steps and commit the difference (DESIGN §2).

Each worker keeps its own momentum m ← μm − η∇L(x) and moves its local copy x ← x + m. Every `window` (λ)
local steps it commits the accumulated difference x − s, where s is the θ it last pulled; the server adds it
as it is, however stale: θ ← θ + Δ. With λ = 1 (the paper's setting) the commit is just m.

Momentum is the top-level `momentum` (0.9, as for every algorithm in the paper's figures); set momentum=0
for plain-SGD workers. Staleness adds implicit momentum on top (Mitliagkas et al. 2016), which is why
DOWNPOUR breaks down as workers are added (paper Fig. 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Commit, require


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9
    window: int = 1  # λ: local steps between commits

    def __post_init__(self):
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window, "an integer >= 1")


def init_state(theta: torch.Tensor, hp, layout=()) -> dict:
    state = {"m": torch.zeros_like(theta), "local_steps": 0}
    if hp.window > 1:
        state["acc"] = torch.zeros_like(theta)  # x − s over the current window
    return state


def local_steps(state, x, grad, hp, normalise: bool) -> Commit | None:
    """One local momentum step; the commit (x − s, or (x − s)/λ) at the end of each window of λ steps."""
    m = state["m"]
    m.mul_(hp.momentum).add_(grad, alpha=-hp.lr)
    state["local_steps"] += 1
    if hp.window == 1:
        return Commit(delta=m)  # x − s after one step; the server only reads it
    acc = state["acc"]
    k = state["local_steps"] % hp.window
    if k == 1:
        acc.copy_(m)  # first step of a window (the last commit has been applied by now)
    else:
        acc.add_(m)
    if k != 0:
        x.add_(m)
        return None
    if normalise:
        acc.div_(hp.window)
    # x itself needs no last step: the engine overwrites it with θ when it pulls after this commit
    return Commit(delta=acc)


def worker_rule(state, x, grad, theta, hp: Params, server=None) -> Commit | None:
    return local_steps(state, x, grad, hp, normalise=False)


def server_rule(theta: torch.Tensor, commit: Commit, staleness: int, hp: Params, server=None) -> None:
    theta.add_(commit.delta)
