"""Accumulated Gradient Normalisation (Hermans et al. 2017), DESIGN §2.

Each worker takes λ local SGD steps, like DOWNPOUR, and commits the accumulated difference divided
by λ: the average step of the window rather than its sum. The server adds it: θ ← θ + Δ/1. Fewer, smaller,
less noisy commits make the central variable robust to staleness. The authors recommend λ = 10–15.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Commit, downpour


@dataclass(frozen=True)
class Params(downpour.Params):
    window: int = 10  # λ: local steps between commits, and the normaliser of the commit


init_state = downpour.init_state


def worker_rule(state, x, grad, theta, hp: Params, server=None) -> Commit | None:
    return downpour.local_steps(state, x, grad, hp, normalise=True)


def server_rule(theta: torch.Tensor, commit: Commit, staleness: int, hp: Params, server=None) -> None:
    theta.add_(commit.delta)
