"""Delay-adaptive asynchronous SGD (Mishchenko, Bach, Even and Woodworth, NeurIPS 2022, "Asynchronous SGD Beats
Minibatch SGD Under Arbitrary Delays"; Koloskova, Stich and Jaggi, NeurIPS 2022, "Sharper Convergence Guarantees
for Asynchronous SGD for Distributed and Federated Learning"); docs/design.md, "Algorithms".

The workers are DOWNPOUR's at λ = 1: each commits Δ = −ηg, g the gradient at the θ it pulled. The server scales
each commit by a factor of its delay τ (the server's clock: every commit counted, as both papers count it) and of
the concurrency τ_C (both papers' n, the number of workers, by default):

    rule=mishchenko   θ ← θ + min(1, τ_C/τ)·Δ
    rule=koloskova    θ ← θ + Δ if τ ≤ τ_C, else θ ← θ + Δ/τ

Up to τ_C both take the whole step; beyond it Mishchenko et al.'s step decays as τ_C/τ, Koloskova et al.'s as 1/τ,
τ_C times smaller. Sources: Mishchenko et al.'s rule as their code has it (konstmish/asynchronous_sgd,
`lr * num_workers / max(num_workers, delay)`: the paper's own statement of it could not be read here); their code
also hands a worker the θ from before its own update, where gem's worker pulls after its commit, as the paper's
algorithm does. Koloskova et al.'s eq. (11) allows any step in [0, min(η, 1/(4Lτ))] beyond τ_C; 1/τ of η is their
advice for practice (L is not known), and 0 would drop the commit.

Unlike GEM, which rescales each element of a commit, and DynSGD (`adaptive`, Δ/(τ + 1) at every τ), this scales
the whole commit by one number, and not at all while τ ≤ τ_C: with n equally fast workers τ is about n − 1 < n,
and the rule is DOWNPOUR's; it acts on the stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import (
    Algorithm,
    Commit,
    View,
    or_workers,
    reads_nothing_central,
    require,
    require_count_or_workers,
    scratch,
)

RULES = ("mishchenko", "koloskova")


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9  # unused: both papers' rule is plain SGD
    workers: int = 1  # n, filled from the top-level `workers`
    rule: str = "mishchenko"  # the factor beyond τ_C: mishchenko (τ_C/τ) or koloskova (1/τ)
    tau_c: int | None = None  # τ_C, the concurrency; None: n, the number of workers (both papers' choice)

    def __post_init__(self):
        require(self.rule in RULES, "rule", self.rule, "one of: " + ", ".join(RULES))
        require_count_or_workers("tau_c", self.tau_c)

    @property
    def concurrency(self) -> int:
        return or_workers(self.tau_c, self.workers)


def factor(tau: int, hp: Params) -> float:
    """The step's share at delay τ."""
    c = hp.concurrency
    if tau <= c:
        return 1.0
    return c / tau if hp.rule == "mishchenko" else 1.0 / tau


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {}


@reads_nothing_central  # (τ only)
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    return Commit(
        delta=torch.mul(grad, -hp.lr, out=scratch(grad, "step")), metrics={"step_share": factor(view.staleness, hp)}
    )


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta, alpha=factor(view.staleness, hp))


ALGORITHM = Algorithm("delay_adaptive", Params, init_state, worker_rule, server_rule)
