"""Delay-compensated ASGD (Zheng et al., ICML 2017, "Asynchronous Stochastic Gradient Descent with Delay
Compensation"); docs/design.md, "Algorithms".

A worker's gradient g = ∇L(θ_bak) was taken at θ_bak, the θ it pulled; by the time it reaches the server θ has
moved on. DC-ASGD corrects g to first order in θ − θ_bak with a diagonal approximation of the Hessian, λ·g⊙g:

    θ ← θ − η(g + λ·g⊙g⊙(θ − θ_bak))            then θ_bak(w) ← θ (the worker pulls)

The server keeps one backup θ_bak per worker (n copies of the model: the memory cost of the method). The worker
commits Δ = −ηg, as DOWNPOUR's workers do, and the server recovers g⊙g = Δ⊙Δ/η². So λ = 0 is DOWNPOUR, commit
for commit.

`adaptive_lambda` (DC-ASGD-a): λ_t = λ₀/√(MeanSquare_t + ε), with MeanSquare_t = m·MeanSquare_{t−1} + (1 − m)·g⊙g
kept at the server over every commit, element-wise; m = 0.95 and ε = 1e-7 (the paper's values).
λ (`dc_lambda`): unset, it is the paper's value for the variant: 0.04 (DC-ASGD-c, its CIFAR-10 setting, also
MXNet's default) or λ₀ = 2 (DC-ASGD-a). The top-level `momentum` is not used: the paper's rule is plain SGD.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, Commit, View, reads_nothing_central, require, scratch

LAMBDA, LAMBDA_0 = 0.04, 2.0  # the paper's λ (DC-ASGD-c) and λ₀ (DC-ASGD-a)


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9  # unused: the paper's rule is plain SGD
    workers: int = 1  # n, filled from the top-level `workers` (the server's backups are sized by the engine's n)
    dc_lambda: float | None = None  # λ (or λ₀ when adaptive); None: the paper's value for the variant
    adaptive_lambda: bool = False  # DC-ASGD-a: λ scaled element-wise by 1/√MeanSquare
    ms_momentum: float = 0.95  # m of MeanSquare (DC-ASGD-a)
    ms_eps: float = 1e-7  # ε of √(MeanSquare + ε) (DC-ASGD-a)

    def __post_init__(self):
        require(
            self.dc_lambda is None or (isinstance(self.dc_lambda, (int, float)) and 0 <= self.dc_lambda < 1e6),
            "dc_lambda",
            self.dc_lambda,
            "a number >= 0, or null for the paper's value (0.04; 2 if adaptive)",
        )
        require(isinstance(self.adaptive_lambda, bool), "adaptive_lambda", self.adaptive_lambda, "true or false")
        require(
            isinstance(self.ms_momentum, (int, float)) and 0 <= self.ms_momentum < 1,
            "ms_momentum",
            self.ms_momentum,
            "a number in [0, 1)",
        )
        require(isinstance(self.ms_eps, (int, float)) and self.ms_eps > 0, "ms_eps", self.ms_eps, "a number > 0")

    @property
    def lam(self) -> float:
        if self.dc_lambda is not None:
            return float(self.dc_lambda)
        return LAMBDA_0 if self.adaptive_lambda else LAMBDA


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {}


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    server = {"backup": theta.detach().clone().unsqueeze(0).repeat(max(workers, 1), 1)}  # θ_bak per worker: θ₀
    if hp.adaptive_lambda:
        server["mean_square"] = torch.zeros_like(theta)
    return server


@reads_nothing_central  # θ and the backups: read by its server rule, at the server
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    return Commit(delta=torch.mul(grad, -hp.lr, out=scratch(grad, "step")))  # −ηg, as DOWNPOUR's


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    delta, theta = commit.delta, view.theta
    backup = view.server["backup"][view.worker]
    # −ηλ·g⊙g⊙(θ − θ_bak) = −(λ/η)·Δ⊙Δ⊙(θ − θ_bak)
    correction = torch.sub(theta, backup, out=scratch(theta, "dc_correction")).mul_(delta).mul_(delta)
    if hp.adaptive_lambda:
        ms = view.server["mean_square"]
        ms.mul_(hp.ms_momentum).addcmul_(delta, delta, value=(1 - hp.ms_momentum) / hp.lr**2)  # g⊙g = Δ⊙Δ/η²
        correction.div_(torch.add(ms, hp.ms_eps, out=scratch(theta, "dc_scale")).sqrt_())
    theta.add_(delta).add_(correction, alpha=-hp.lam / hp.lr)
    backup.copy_(theta)  # the worker pulls θ now


ALGORITHM = Algorithm("dcasgd", Params, init_state, worker_rule, server_rule, init_server=init_server)
