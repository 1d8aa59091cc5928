"""Staleness-aware SGD (DynSGD, Jiang et al. 2017): DOWNPOUR's workers, and a server that divides each commit
by its staleness plus one (DESIGN §2): θ ← θ + Δ/(τ + 1).

τ is measured by the parameter server under its lock, so the scaling uses the true number of commits the
worker missed. With n equally fast workers τ = n − 1, so each commit counts 1/n: the group moves about as far
per cycle as one worker would, which is stable but slow.
"""

from __future__ import annotations

import torch

from gem.algorithms import Commit, downpour

Params = downpour.Params  # the same keys and defaults: window 1, local_momentum 0


init_state = downpour.init_state


def worker_rule(state, x, grad, theta, hp: Params, server=None) -> Commit | None:
    return downpour.local_steps(state, x, grad, hp, normalise=False)


def server_rule(theta: torch.Tensor, commit: Commit, staleness: int, hp: Params, server=None) -> None:
    theta.add_(commit.delta, alpha=1.0 / (staleness + 1))
