"""Sequential momentum SGD: the proxy that GEM's workers try to match (docs/design.md, `sgd`).

One worker, no staleness. With Δθ = −η∇L(θ), the momentum m ← μm + Δθ is committed and the server adds it:
θ ← θ + m. This is exactly torch.optim.SGD(lr=η, momentum=μ) (its buffer b = −m/η).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, Commit, View, reads_nothing_central


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {"m": torch.zeros_like(theta)}


@reads_nothing_central
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    m = state["m"]
    m.mul_(hp.momentum).add_(grad, alpha=-hp.lr)
    return Commit(delta=m)


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta)


ALGORITHM = Algorithm("sgd", Params, init_state, worker_rule, server_rule, sequential=True)
