"""Asynchronous local SGD with delayed Nesterov momentum (Liu et al. 2024, "Asynchronous Local-SGD Training for
Language Modeling", Sec. 5, "Delayed Nesterov"), the outer optimiser of DiLoCo (Douillard et al. 2023, "DiLoCo:
Distributed Low-Communication Training of Language Models") run asynchronously; docs/design.md, "Algorithms".

Inner loop, on each worker: H (`window`) steps of SGD with momentum from the θ it pulled, s, with the top-level
`lr` and `momentum` (the proxy's η and μ; DiLoCo's inner optimiser is AdamW, SGD with momentum stands in for it
here): m ← μm − η∇L(x), x ← x + m. The momentum m is the worker's own and survives its pulls, as DiLoCo keeps its
inner optimiser state. Then it commits the pseudo-gradient Δ = s − x.

Outer step, at the server, on the t-th commit (t = 1, 2, …), however stale; N is `nesterov_every`:

    `outer: delayed_nesterov` (the default; Liu et al.'s delayed Nesterov, their Algorithm 3):
        buffer ← buffer + Δ
        t a multiple of N:  v ← μ_o·v + buffer/N      θ ← θ − η_o·(Δ/N + μ_o·v)      buffer ← 0
        otherwise:                                     θ ← θ − η_o·Δ/N
    `outer: nesterov` (the plain asynchronous form, Nesterov momentum on every commit, as torch.optim.SGD(
    nesterov=True)):
        v ← μ_o·v + Δ        θ ← θ − η_o·(Δ + μ_o·v)

Liu et al. find the plain form unstable: every stale pseudo-gradient enters the momentum, which then pushes θ
along it again on every later commit. Delayed Nesterov applies each Δ once, at η_o/N, and feeds the momentum only
every N commits, with their mean; over N commits θ moves by −η_o·(mean Δ + μ_o·v), one Nesterov step on the mean of
N pseudo-gradients, as synchronous DiLoCo takes on the mean of its N workers' ones. With N = 1 it is the plain
form, bit for bit. N defaults to n, the number of workers (Liu et al.'s default for the momentum activation), so
the momentum sees about one pseudo-gradient per worker per step.

Defaults: η_o = 0.7 and μ_o = 0.9, DiLoCo's outer learning rate and Nesterov momentum (Douillard et al. 2023,
Sec. 3), which Liu et al. keep. H = 10, not DiLoCo's 500 inner steps (which assumes thousands of steps per
worker): AGN's window in the paper's experiments, so that the two windowed methods commit equally often in the
baselines. With η_o = 1, μ_o = 0 and `outer: nesterov` the outer step adds x − s: DOWNPOUR with a window and
worker momentum.

Dynamic local updates (`dynamic_window`; Liu et al.'s DyLU, their Sec. 5): each worker's window follows its speed,
H_w = ⌊H·v_w / max_w' v_w'⌋, so that the fastest worker takes H inner steps between commits and a slower one
proportionally fewer, and every pseudo-gradient stands for about the same time of work. v_w is the worker's speed as
its cycle measures it (`View.pace`): its local steps since its first commit, per unit of its clock (the simulated
clock on sim; the run's seconds elsewhere, the waits for the server's turn included, which every worker pays
alike). Since its first commit, not over its last cycle: one cycle's time is noisy (a Gamma draw on sim, a loaded
machine), and the max over n noisy paces would shrink every window even where the workers are equally fast; nor
from the run's start, which a worker's own start (sim's staggered first cycles, a process loading its data) would
skew. A worker keeps H until its second commit. Liu et al. do not
say how they measure it (their simulator gives each device a fixed speed). The server keeps each worker's last
pace (`pace`, a payload of each commit) and the worker rule sets the next window (`Commit.window`) from them at every
commit. Liu et al.'s formula can give 0 steps; here a window is at least 1 (their toy code floors at 5). Rows add
`window` (the window the commit ends) and `pace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gem.algorithms import (
    Algorithm,
    Commit,
    View,
    or_workers,
    positive,
    reads_central_when,
    reads_server,
    require,
    require_count_or_workers,
)

OUTER = ("delayed_nesterov", "nesterov")


@dataclass(frozen=True)
class Params:
    lr: float = 0.05  # η of the inner SGD
    momentum: float = 0.9  # μ of the inner SGD
    workers: int = 1  # n, filled from the top-level `workers`: the default N
    window: int = 10  # H: inner steps between commits
    outer_lr: float = 0.7  # η_o (DiLoCo)
    outer_momentum: float = 0.9  # μ_o, Nesterov (DiLoCo)
    outer: str = "delayed_nesterov"  # delayed_nesterov (Liu et al. 2024) | nesterov (on every commit)
    nesterov_every: int | None = None  # N, commits between momentum steps (delayed_nesterov); None: n
    dynamic_window: bool = False  # DyLU: each worker's window H·v_w/max v, its pace against the fastest's

    def __post_init__(self):
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window, "an integer >= 1")
        require(positive(self.outer_lr), "outer_lr", self.outer_lr, "a number > 0")
        require(
            isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1,
            "outer_momentum",
            self.outer_momentum,
            "a number in [0, 1)",
        )
        require(self.outer in OUTER, "outer", self.outer, f"one of: {', '.join(OUTER)}")
        require_count_or_workers("nesterov_every", self.nesterov_every)
        require(isinstance(self.dynamic_window, bool), "dynamic_window", self.dynamic_window, "true or false")


def delay(hp: Params) -> int:
    """N: commits between two momentum steps (1: Nesterov on every commit)."""
    if hp.outer == "nesterov":
        return 1
    return or_workers(hp.nesterov_every, hp.workers)


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {
        "m": torch.zeros_like(theta),  # the inner momentum
        "moved": torch.zeros_like(theta),
    }  # x − s over the current window


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    server = {
        "v": torch.zeros_like(theta),  # the outer momentum
        "buffer": torch.zeros_like(theta),  # the sum of the pseudo-gradients since the last momentum step
    }
    if hp.dynamic_window:  # each worker's last pace (0: not known yet)
        server["pace"] = torch.zeros(max(workers, 1), dtype=torch.float64, device=theta.device)
    return server


def payload(theta: torch.Tensor, hp: Params) -> dict:
    return {"pace": torch.zeros(1, dtype=torch.float64)} if hp.dynamic_window else {}


def next_window(view: View, hp: Params) -> int:
    """DyLU: ⌊H·v_w / max v⌋, at least 1; H while this worker's pace is not measured."""
    paces = view.server["pace"].tolist()
    if view.pace > 0:
        paces[view.worker] = view.pace  # its own, measured now: the server notes it with this commit
    own, fastest = paces[view.worker], max(paces)
    if own <= 0:
        return hp.window
    return max(1, math.floor(hp.window * own / fastest))


def reads_paces(hp: Params) -> bool:
    """DyLU's worker rule reads the other workers' paces from the server's tensors; the plain rule reads nothing
    central."""
    return hp.dynamic_window


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


@reads_central_when(reads_paces)
@reads_server("pace")  # (engine=distributed: GO carries the paces, and the commit runs in full duplex)
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    m = inner_step(state, grad, hp)
    window = view.window or hp.window  # (a dynamic window may be 1: no local step began it)
    moved = state["moved"].copy_(m) if window == 1 else state["moved"].add_(m)
    commit = Commit(delta=moved.neg_())  # Δ = s − x; x itself is overwritten by the pull
    if hp.dynamic_window:
        commit.window = next_window(view, hp)
        commit.payload = {"pace": torch.tensor([view.pace], dtype=torch.float64, device=x.device)}
        commit.metrics = {"window": window, "pace": view.pace}
    return commit


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    if hp.dynamic_window and float(commit.payload["pace"][0]) > 0:
        view.server["pace"][view.worker] = commit.payload["pace"][0]
    n_delay = delay(hp)
    buffer = view.server["buffer"].add_(commit.delta)
    view.theta.add_(commit.delta, alpha=-hp.outer_lr / n_delay)
    if (view.t + 1) % n_delay == 0:  # view.t commits came before this one: this is the (t + 1)-th
        v = view.server["v"].mul_(hp.outer_momentum).add_(buffer, alpha=1.0 / n_delay)
        view.theta.add_(v, alpha=-hp.outer_lr * hp.outer_momentum)
        buffer.zero_()


ALGORITHM = Algorithm(
    "async_localsgd",
    Params,
    init_state,
    worker_rule,
    server_rule,
    commit_every=commit_every,
    local_step=local_step,
    init_server=init_server,
    payload=payload,
)
