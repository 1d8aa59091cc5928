"""DOWNPOUR (Dean et al. 2012): workers take local SGD steps and commit the difference (docs/design.md).

Each worker moves its local copy by plain SGD steps, x ← x − η∇L(x). Every `window` (λ) local steps it
commits the accumulated difference x − s, where s is the θ it last pulled; the server adds it as it is,
however stale: θ ← θ + Δ. With λ = 1 (the paper's setting) the commit is −η∇L(s): the paper's
θ ← θ − η∇L(θ_{t−τ}).

The top-level `momentum` is the proxy's μ (GEM, sgd) and is not used here. Staleness alone gives the group
implicit momentum of about 1 − 1/n (Mitliagkas et al. 2016), which is why DOWNPOUR breaks down as workers are
added (paper Fig. 1). `local_momentum` > 0 gives the workers their own momentum, m ← μ'm − η∇L(x) and
x ← x + m, which on top of the implicit momentum breaks down much earlier (REPRODUCTION.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, Commit, View, reads_nothing_central, require, scratch


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9
    window: int = 1  # λ: local steps between commits
    local_momentum: float = 0.0  # the workers' own momentum; 0: plain SGD steps, as their papers define them

    def __post_init__(self):  # inherited by adaptive's and agn's Params
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window, "an integer >= 1")
        require(
            isinstance(self.local_momentum, (int, float)) and 0 <= self.local_momentum < 1,
            "local_momentum",
            self.local_momentum,
            "a number in [0, 1)",
        )


def init_state(theta: torch.Tensor, hp) -> dict:
    state = {}
    if hp.local_momentum > 0:
        state["m"] = torch.zeros_like(theta)
    if hp.window > 1:
        state["acc"] = torch.zeros_like(theta)  # x − s over the current window
    return state


def commit_every(hp) -> int:
    return hp.window


def sgd_step(state, grad, hp) -> torch.Tensor:
    """This step's move of the local copy: −η∇L, or the local momentum's m ← μ'm − η∇L."""
    if "m" in state:
        return state["m"].mul_(hp.local_momentum).add_(grad, alpha=-hp.lr)
    # plain SGD: the step lives only until it is added to x, or committed and applied
    return torch.mul(grad, -hp.lr, out=scratch(grad, "step"))


def local_step(state, x, grad, hp, k: int) -> None:
    m = sgd_step(state, grad, hp)
    if k == 1:
        state["acc"].copy_(m)  # the first step of a window (the last commit has been applied by now)
    else:
        state["acc"].add_(m)
    x.add_(m)


def window_commit(state, grad, hp, normalise: bool) -> Commit:
    """The last step of a window: the commit x − s (or (x − s)/λ, AGN)."""
    m = sgd_step(state, grad, hp)
    if hp.window == 1:
        return Commit(delta=m)  # x − s after one step; the server only reads it
    acc = state["acc"].add_(m)
    if normalise:
        acc.div_(hp.window)
    # x itself needs no last step: the worker overwrites it with θ when it pulls after this commit
    return Commit(delta=acc)


@reads_nothing_central
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    return window_commit(state, grad, hp, normalise=False)


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta)


ALGORITHM = Algorithm(
    "downpour", Params, init_state, worker_rule, server_rule, commit_every=commit_every, local_step=local_step
)
