"""Sequential momentum SGD: the proxy that GEM's workers try to match (DESIGN §2, `sgd`).

One worker, no staleness. With Δθ = −η∇L(θ), the momentum m ← μm + Δθ is committed and the server adds it:
θ ← θ + m. This is exactly torch.optim.SGD(lr=η, momentum=μ) (its buffer b = −m/η).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Commit

SEQUENTIAL = True  # the proxy: always one worker, whatever `workers` says


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9


def init_state(theta: torch.Tensor, hp: Params, layout=()) -> dict:
    return {"m": torch.zeros_like(theta)}


def worker_rule(state, x, grad, theta, hp: Params, server=None) -> Commit:
    m = state["m"]
    m.mul_(hp.momentum).add_(grad, alpha=-hp.lr)
    return Commit(delta=m)


def server_rule(theta: torch.Tensor, commit: Commit, staleness: int, hp: Params, server=None) -> None:
    theta.add_(commit.delta)
