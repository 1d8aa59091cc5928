"""Synchronous SGD with n workers: the synchronous data-parallel baseline (docs/design.md, `ssgd`).

Training goes in rounds. In each round every worker takes one gradient at the same θ, on its own mini-batch, and
commits Δθᵢ = −η∇L. The server keeps the round's commits, one row per worker; the n-th applies their mean through
the proxy's momentum,

    m ← μm + (1/n) Σᵢ Δθᵢ        θ ← θ + m

and no worker takes its next gradient before that (each commit's `pull_at` is the clock at the end of its round:
a barrier). With per-worker batch b this is sequential momentum SGD (`sgd`) with batch n·b: the mean of the n
batch-mean gradients is the gradient of the n·b examples' mean loss. It is the baseline against which
asynchronous speed-ups should be measured on the same hardware: a round lasts as long as its slowest worker.

The sum is taken in worker order at the round's end, not in the order the commits arrive: float addition is not
associative, and arrival order differs between runs and engines, so a running sum would round differently each
time and a run could not be repeated to the last bit (nor a process run compared with its sim run). The cost: the
server holds n + 1 model-sized tensors, and the `distributed` engine sends a worker every server tensor at each
commit and each barrier pull (as it does DC-ASGD's n backups), (n + 2)/3 times the traffic of a running sum.

The clock still counts commits, so a round is n steps of `step`, and τ counts the commits of the current round
that reached the server before this one (on sim exactly its place in the round), which have not moved θ (θ moves
once per round). A lost worker stalls every round: the run fails (sim and distributed at once, naming the
barrier; process once the waiting workers are lost as silent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.algorithms import Algorithm, Commit, View, reads_nothing_central, scratch


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9  # μ of the server's momentum, the proxy's
    workers: int = 1  # n, filled from the top-level `workers`: commits per round


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {}


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    if max(hp.workers, 1) != max(workers, 1):  # the rounds are hp.workers commits long; a row per running worker
        raise ValueError(
            f"ssgd: algorithm.workers={hp.workers} but {workers} workers run; they must be equal "
            "(the top-level `workers` fills both)"
        )
    return {
        "round": theta.new_zeros((max(workers, 1), theta.numel())),  # Δθᵢ of the round so far, row i: worker i
        "m": torch.zeros_like(theta),
    }  # the momentum, updated once per round


def round_end(t: int, n: int) -> int:
    """The clock once the round of the commit at t is applied."""
    return (t // n + 1) * n


@reads_nothing_central  # (t only)
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    delta = torch.mul(grad, -hp.lr, out=scratch(grad, "step"))
    return Commit(delta=delta, pull_at=round_end(view.t, max(hp.workers, 1)))


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    n, rows = max(hp.workers, 1), view.server["round"]
    rows[view.worker].copy_(commit.delta)
    if view.t + 1 == round_end(view.t, n):  # the round's last commit: apply the mean
        m = view.server["m"].mul_(hp.momentum)
        for row in rows:  # in worker order, whatever order the commits came in
            m.add_(row, alpha=1.0 / n)
        view.theta.add_(m)


ALGORITHM = Algorithm("ssgd", Params, init_state, worker_rule, server_rule, init_server=init_server, barriers=True)
