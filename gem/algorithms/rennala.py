"""Rennala SGD (Tyurin and Richtárik, NeurIPS 2023, "Optimal Time Complexities of Parallel Stochastic Optimization
Methods Under a Fixed Computation Model"); docs/design.md, "Algorithms".

Minibatch SGD whose batch is gathered asynchronously: the server collects S gradients taken at its current point
x^k, from whichever workers deliver them (a fast worker may give several), then takes one step with their mean,

    x^{k+1} = x^k − η·(1/S)·Σ_{j=1..S} g_j,

and a gradient taken at an older point is discarded when it arrives. The workers are DOWNPOUR's at λ = 1: each
commits Δ = −ηg at the θ it pulled, and pulls θ after every commit (the current point: it changes only when a batch
is full). The server keeps the batch's sum, its size so far, the point's index k and the k at each worker's last
pull. A commit of an older point is dropped (`dropped` 1 in its row, `delay` the points since, and the summary's
`dropped_commits`); every commit ticks gem's clock t.

S: the paper's theory sets S = max(1, ⌈σ²/ε⌉); its experiments choose it by a grid search. Here it defaults to n,
the number of workers: with equally fast workers each batch then holds about one gradient of each, as synchronous
SGD's round would, without its barrier. The original lets a worker finish a gradient of an old point and discards
it on arrival, as here; stopping the computations at each step (the variant of its later papers) is not built.
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
    batch: int | None = None  # S: gradients per step; None: n, the workers

    def __post_init__(self):
        require_count_or_workers("batch", self.batch)

    @property
    def S(self) -> int:  # noqa: N802 - the paper's name
        return or_workers(self.batch, self.workers)


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {}


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    return {
        "sum": torch.zeros_like(theta),  # Σ Δ of the batch so far
        "count": torch.zeros(1, dtype=torch.int64, device=theta.device),  # its size so far
        "point": torch.zeros(1, dtype=torch.int64, device=theta.device),  # k: the steps taken
        "pulled": torch.zeros(max(workers, 1), dtype=torch.int64, device=theta.device),  # k at each worker's pull
    }


def delay(view: View) -> int:
    """The steps taken since the committing worker pulled: 0 for a gradient of the current point."""
    return int(view.server["point"][0] - view.server["pulled"][view.worker])


@reads_server("point", "pulled")  # its delay, from the server's counters (engine=distributed: GO carries them)
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    d = delay(view)
    return Commit(delta=torch.mul(grad, -hp.lr, out=scratch(grad, "step")), metrics={"delay": d, "dropped": int(d > 0)})


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    s, count, point = view.server["sum"], view.server["count"], view.server["point"]
    if delay(view) == 0:
        s.add_(commit.delta)
        count += 1
        if int(count[0]) == hp.S:
            view.theta.add_(s, alpha=1.0 / hp.S)
            s.zero_()
            count.zero_()
            point += 1
    view.server["pulled"][view.worker] = point[0]  # the worker pulls θ now: the current point


ALGORITHM = Algorithm("rennala", Params, init_state, worker_rule, server_rule, init_server=init_server)
