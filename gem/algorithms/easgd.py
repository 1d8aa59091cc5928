"""Asynchronous Elastic Averaging SGD (Zhang, Choromanska & LeCun 2015, Algorithm 1); docs/design.md.

Each worker explores with its own variable x, linked to the central variable θ by an elastic force. Between
exchanges it takes plain SGD steps x ← x − η∇L(x). Every `window` (λ) local steps it reads θ and computes the
elastic difference E = α(x − θ), at the same x where this step's gradient was taken. The update is symmetric:
the worker moves towards θ and θ towards the worker by the same amount,

    x ← x − E − η∇L(x)        θ ← θ + E   (commit E; the worker does not pull)

α is `alpha` if set, else η·`rho` if `rho` is set, else β/n with β = `beta` (0.9), as Zhang et al. recommend
so that the total elastic pull β stays fixed as workers are added.

The top-level `momentum` is not used: EASGD's local steps are plain SGD (use `eamsgd` for momentum).
Staleness τ here counts the commits since this worker's previous exchange: E itself uses the live θ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, AtServer, Commit, View, positive, require, runs_at_server, scratch


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9  # unused by easgd; eamsgd's Nesterov momentum δ
    workers: int = 1  # n, filled from the top-level `workers`: the default α = β/n
    window: int = 4  # λ: local steps between elastic exchanges (Zhang et al. use τ = 4 to 64)
    beta: float = 0.9  # β: total elastic strength, α = β/n when alpha and rho are unset
    alpha: float | None = None  # α, the moving rate, set directly
    rho: float | None = None  # ρ, the elastic coefficient: α = η·ρ

    def __post_init__(self):
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window, "an integer >= 1")
        require(
            self.alpha is None or self.rho is None,
            "rho",
            self.rho,
            "unset (null) when algorithm.alpha is set: give alpha, or rho, not both",
        )
        require(positive(self.beta), "beta", self.beta, "a number > 0")
        if self.alpha is not None:
            require(0 < self.alpha <= 1, "alpha", self.alpha, "a number in (0, 1]")
        if self.rho is not None:
            require(positive(self.rho) and self.lr * self.rho <= 1, "rho", self.rho, "a number > 0 with lr*rho <= 1")
        require(
            self.alpha is not None or self.rho is not None or self.beta / max(self.workers, 1) <= 1,
            "beta",
            self.beta,
            "at most workers (alpha = beta/workers must be <= 1)",
        )


def moving_rate(hp) -> float:
    """α, the elastic moving rate."""
    if hp.alpha is not None:
        return hp.alpha
    if hp.rho is not None:
        return hp.lr * hp.rho
    return hp.beta / max(hp.workers, 1)


def init_state(theta: torch.Tensor, hp) -> dict:
    return {}


def commit_every(hp) -> int:
    return hp.window


def elastic(x: torch.Tensor, theta: torch.Tensor, hp) -> torch.Tensor:
    """E = α(x − θ), in a scratch buffer that lives until the server has applied it."""
    e = scratch(x, "elastic")
    torch.sub(x, theta, out=e)
    return e.mul_(moving_rate(hp))


def local_step(state, x, grad, hp: Params, k: int) -> None:
    x.add_(grad, alpha=-hp.lr)


def _variable(state, x, grad, hp: Params) -> dict[str, torch.Tensor]:
    """What a worker sends for the elastic term at the server: its variable x, where this step's gradient was
    taken."""
    return {"x": x}


def _elastic_at_server(kept, sent, view: View, hp: Params) -> Commit:
    """E = α(x − θ) at the server, with the live θ: the commit, which goes back to the worker (it does not pull)."""
    return Commit(delta=elastic(sent["x"], view.theta, hp), pull=False)


def _move(state, x, grad, e, hp: Params) -> None:
    """x ← x − E − η∇L, the rest of the worker rule, with the E that came back."""
    x.sub_(e)
    x.add_(grad, alpha=-hp.lr)


# engine=distributed over the wire: the worker sends x, the server computes E with the θ it is applied to and sends
# it back, one model each way at once (docs/design.md, "Full duplex over the wire")
@runs_at_server(AtServer(keeps=(), sends=_variable, rule=_elastic_at_server, finish=_move))
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    e = elastic(x, view.theta, hp)
    _move(state, x, grad, e, hp)
    return Commit(delta=e, pull=False)


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta)


ALGORITHM = Algorithm(
    "easgd", Params, init_state, worker_rule, server_rule, commit_every=commit_every, local_step=local_step
)
