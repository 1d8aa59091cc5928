"""Asynchronous local SGD with an outer Nesterov momentum, DESIGN §2: the outer optimiser of DiLoCo (Douillard et
al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"), run asynchronously as in Liu et
al. 2024 ("Asynchronous Local-SGD Training for Language Modeling").

Inner loop, on each worker: H (`window`) steps of SGD with momentum from the θ it pulled, s, with the top-level
`lr` and `momentum` (the proxy's η and μ; DiLoCo's inner optimiser is AdamW, SGD with momentum stands in for it
here): m ← μm − η∇L(x), x ← x + m. The momentum m is the worker's own and survives its pulls, as DiLoCo keeps its
inner optimiser state. Then it commits the pseudo-gradient Δ = s − x.

Outer step, at the server, per commit, however stale (Nesterov momentum as torch.optim.SGD(nesterov=True)):

    v ← μ_o·v + Δ        θ ← θ − η_o·(Δ + μ_o·v)

Defaults: η_o = 0.7 and μ_o = 0.9, DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023,
Sec. 3). H = 10, not DiLoCo's 500 inner steps (which assumes thousands of steps per worker): AGN's window in the
paper's experiments, so that the two windowed methods commit equally often in the baselines. With η_o = 1 and
μ_o = 0 the outer step adds x − s: DOWNPOUR with a window and worker momentum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, Commit, View, positive, require


@dataclass(frozen=True)
class Params:
    lr: float = 0.05  # η of the inner SGD
    momentum: float = 0.9  # μ of the inner SGD
    window: int = 10  # H: inner steps between commits
    outer_lr: float = 0.7  # η_o (DiLoCo)
    outer_momentum: float = 0.9  # μ_o, Nesterov (DiLoCo)

    def __post_init__(self):
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window, "an integer >= 1")
        require(positive(self.outer_lr), "outer_lr", self.outer_lr, "a number > 0")
        require(isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1, "outer_momentum",
                self.outer_momentum, "a number in [0, 1)")


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {"m": torch.zeros_like(theta),  # the inner momentum
            "moved": torch.zeros_like(theta)}  # x − s over the current window


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    return {"v": torch.zeros_like(theta)}  # the outer momentum


def commit_every(hp: Params) -> int:
    return hp.window


def inner_step(state, grad, hp: Params) -> torch.Tensor:
    return state["m"].mul_(hp.momentum).add_(grad, alpha=-hp.lr)


def local_step(state, x, grad, hp: Params, k: int) -> None:
    m = inner_step(state, grad, hp)
    if k == 1:
        state["moved"].copy_(m)  # the window's first step, from the θ pulled after the last commit
    else:
        state["moved"].add_(m)
    x.add_(m)


def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    m = inner_step(state, grad, hp)
    moved = state["moved"].copy_(m) if hp.window == 1 else state["moved"].add_(m)
    return Commit(delta=moved.neg_())  # Δ = s − x; x itself is overwritten by the pull


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    v = view.server["v"].mul_(hp.outer_momentum).add_(commit.delta)
    view.theta.add_(commit.delta, alpha=-hp.outer_lr).add_(v, alpha=-hp.outer_lr * hp.outer_momentum)


ALGORITHM = Algorithm("async_localsgd", Params, init_state, worker_rule, server_rule, commit_every=commit_every,
                      local_step=local_step, init_server=init_server)
