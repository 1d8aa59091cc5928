"""Ringmaster ASGD (Maranjyan, Tyurin and Richtárik, ICML 2025, "Ringmaster ASGD: The First Asynchronous SGD with
Optimal Time Complexity"), its Algorithm 4, without calculation stops; docs/design.md, "Algorithms".

Asynchronous SGD that ignores a gradient whose delay has reached a threshold R. The workers are DOWNPOUR's at
λ = 1: each commits Δ = −ηg, g the gradient at the θ it pulled, and pulls θ again after every commit, applied or
not. The server counts the updates it has applied, k, and keeps the k at each worker's last pull; a commit's delay
is the number of updates applied since (δ = k − k_pull: ignored commits do not count, as in the paper, where k
advances only on an update). Then

    δ < R:  θ ← θ + Δ,  k ← k + 1          otherwise: θ unchanged (the commit is dropped)

Every commit still ticks gem's clock t (τ in the rows counts dropped commits too); the row says which were dropped
(`dropped` 1) and their delay (`delay`, δ), and the summary counts them (`dropped_commits`).

R: the paper's theory sets R = max(1, ⌈σ²/ε⌉), which is not known in practice, and its experiments choose R by a
grid search; here it defaults to n, the number of workers: with n equally fast workers δ stays below n and the
rule is DOWNPOUR's, and only a worker more than a round behind is ignored. Calculation stops (Algorithm 5: the
server interrupts a gradient once its delay reaches R) are not built: gem's workers are not interrupted mid-step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, Commit, View, or_workers, reads_server, require_count_or_workers, scratch


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9  # unused: the paper's rule is plain SGD
    workers: int = 1  # n, filled from the top-level `workers`
    threshold: int | None = None  # R: a commit whose delay has reached it is dropped; None: n, the workers

    def __post_init__(self):
        require_count_or_workers("threshold", self.threshold)

    @property
    def R(self) -> int:  # noqa: N802 - the paper's name
        return or_workers(self.threshold, self.workers)


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {}


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    return {
        "applied": torch.zeros(1, dtype=torch.int64, device=theta.device),  # k: the updates applied
        "pulled": torch.zeros(max(workers, 1), dtype=torch.int64, device=theta.device),  # k at each worker's pull
    }


def delay(view: View) -> int:
    """δ: the updates applied since the committing worker last pulled."""
    return int(view.server["applied"][0] - view.server["pulled"][view.worker])


@reads_server("applied", "pulled")  # its delay, from the server's counters (engine=distributed: GO carries them)
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    d = delay(view)
    return Commit(
        delta=torch.mul(grad, -hp.lr, out=scratch(grad, "step")), metrics={"delay": d, "dropped": int(d >= hp.R)}
    )


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    applied = view.server["applied"]
    if delay(view) < hp.R:
        view.theta.add_(commit.delta)
        applied += 1
    view.server["pulled"][view.worker] = applied[0]  # the worker pulls θ now, applied or not


ALGORITHM = Algorithm("ringmaster", Params, init_state, worker_rule, server_rule, init_server=init_server)
