"""Elastic Averaging Momentum SGD (Zhang et al. 2015, Algorithm 2): EASGD with local Nesterov momentum.

The worker's variable x̂ takes Nesterov steps, with the gradient at the look-ahead point x̂ + δv, ahead
along the velocity v:

    v ← δv − η∇L(x̂ + δv)        x̂ ← x̂ + v          (δ = the top-level `momentum`)

Every `window` (λ) steps, before the next gradient, the elastic exchange E = α(x̂ − θ): x̂ ← x̂ − E and
θ ← θ + E. Public code (dist-keras) evaluates the gradient at x̂ − δv, behind the worker, which turns the
look-ahead into a look-back.

The engine computes the gradient at the worker's `x`, so the worker stores the look-ahead point itself,
x = x̂ + δv (the usual reformulation of Nesterov momentum). One step is then x ← x − δv; v ← δv − η∇L(x);
x ← x + (1 + δ)v. The elastic difference uses x̂ = x − δv, and E moves x̂ and x alike.
α is chosen as in `easgd`: alpha, else η·rho, else β/n.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gem.algorithms import Commit, View, easgd, scratch

Params = easgd.Params


def init_state(theta: torch.Tensor, hp) -> dict:
    return {"v": torch.zeros_like(theta)}


def local_step(state, x, grad, hp: Params, k: int = 0) -> None:
    v, delta = state["v"], hp.momentum
    x.add_(v, alpha=-delta)  # x̂, where the previous look-ahead started
    v.mul_(delta).add_(grad, alpha=-hp.lr)  # grad was taken at the look-ahead point x̂ + δv
    x.add_(v, alpha=1 + delta)  # x̂ + v, plus the next look-ahead δv


def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    local_step(state, x, grad, hp)
    e = scratch(x, "elastic")
    torch.sub(x, view.theta, out=e).sub_(state["v"], alpha=hp.momentum)  # x̂ − θ
    e.mul_(easgd.moving_rate(hp))
    x.sub_(e)  # before the next gradient, as in Algorithm 2
    return Commit(delta=e, pull=False)


ALGORITHM = replace(
    easgd.ALGORITHM, name="eamsgd", init_state=init_state, local_step=local_step, worker_rule=worker_rule
)
