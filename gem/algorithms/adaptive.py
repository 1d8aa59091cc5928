"""Staleness-aware SGD (DynSGD, Jiang et al. 2017): DOWNPOUR's workers, and a server that divides each commit
by its staleness plus one (DESIGN §2): θ ← θ + Δ/(τ + 1).

τ is measured by the parameter server under its lock, so the scaling uses the true number of commits the
worker missed. With n equally fast workers τ = n − 1, so each commit counts 1/n: the group moves about as far
per cycle as one worker would, which is stable but slow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Commit, downpour


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9
    window: int = 1  # λ: local steps between commits
    local_momentum: float = 0.0  # the workers' own momentum; 0: plain SGD steps, as downpour

    def __post_init__(self):
        downpour.check_local(self)


init_state = downpour.init_state


def worker_rule(state, x, grad, theta, hp: Params, server=None) -> Commit | None:
    return downpour.local_steps(state, x, grad, hp, normalise=False)


def server_rule(theta: torch.Tensor, commit: Commit, staleness: int, hp: Params, server=None) -> None:
    theta.add_(commit.delta, alpha=1.0 / (staleness + 1))
