"""Gradient Energy Matching (Hermans & Louppe 2018), DESIGN §1.

Each worker keeps the proxy, its own estimate of sequential momentum SGD, m ← μm + Δθ with Δθ = −η∇L,
and rescales its update element by element so that the kinetic energy of the central variable matches the
proxy's (paper eq. 27):

    π = (κ|m| − |θ − s|) / (|Δθ| + ε),   clamped to [0, π_max]        commit πΔθ;   server: θ ← θ + πΔθ

θ − s is how far the central variable moved since this worker's previous commit, its own commit included:
s is a copy of θ taken just before the server applies this worker's commit (worker_rule runs exactly then).
With one worker and κ = 1, θ − s is the worker's previous commit and GEM reduces to matching momentum SGD.

`proxy=global` (beyond the paper, its future work): the parameter server estimates the proxy from all
workers. Each commit carries the worker's m, and the server keeps their running average M, over all commits
until n have arrived, then an exponential average with weight 1/n (about the last n commits, one per
worker). Workers use κ|M| in place of κ|m|: the same scale, with the noise of n workers averaged out.

Per-commit diagnostics (DESIGN §2): the median, mean and fraction-zero of π over all elements and per
parameter tensor, the fraction clamped at π_max, the proxy energy ½‖κm‖² (κM with the global proxy), and
the central energy ½‖θ − s + πΔθ‖². The median is the lower median (torch.median's convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gem.algorithms import Algorithm, Commit, View, positive, require, scratch

PROXIES = ("local", "global")


@dataclass(frozen=True)
class Params:
    lr: float = 0.05
    momentum: float = 0.9
    workers: int = 1  # n, filled from the top-level `workers`: the global proxy's averaging window
    kappa: float = 1.0  # κ: proxy energy amplification (paper App. B; fig8 sweeps 1 to 4)
    pi_max: float = 5.0  # upper clamp of π; the authors' code uses 5 "for numerical stability"
    eps: float = 1e-12  # ε in |Δθ| + ε, as in the authors' code
    proxy: str = "local"  # local: each worker's momentum (the paper); global: estimated at the server

    def __post_init__(self):
        require(positive(self.kappa), "kappa", self.kappa, "a number > 0 (the paper uses kappa >= 1)")
        require(positive(self.pi_max), "pi_max", self.pi_max, "a number > 0")
        require(positive(self.eps), "eps", self.eps, "a number > 0")
        require(self.proxy in PROXIES, "proxy", self.proxy, f"one of: {', '.join(PROXIES)}")


def init_state(theta: torch.Tensor, hp: Params) -> dict:
    return {"m": torch.zeros_like(theta),  # the worker's proxy momentum
            "stale": theta.clone()}  # s: θ just before this worker's previous commit (at start: θ₀)


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    if hp.proxy != "global":
        return {}
    return {"proxy": torch.zeros_like(theta), "proxy_commits": torch.zeros((), dtype=torch.long)}


def prepare(state, x, grad, hp: Params) -> None:
    """The part of the commit that does not read θ, run before the worker takes the turn: Δθ, the proxy's next
    value μm + Δθ, and π's numerator κ|μm + Δθ| (local proxy) and denominator |Δθ| + ε. In scratch buffers only:
    the worker's state must stay as it was until its turn (a checkpoint taken while it waits saves it)."""
    update = torch.mul(grad, -hp.lr, out=scratch(grad, "update"))  # Δθ
    m_next = torch.mul(state["m"], hp.momentum, out=scratch(grad, "m_next")).add_(update)
    torch.abs(update, out=scratch(grad, "denominator")).add_(hp.eps)
    if hp.proxy == "local":
        _numerator(m_next, hp)


def _numerator(proxy: torch.Tensor, hp: Params) -> torch.Tensor:
    pi = torch.abs(proxy, out=scratch(proxy, "pi"))
    if hp.kappa != 1:  # x·1 is x exactly: skip a pass over the model for the default κ
        pi.mul_(hp.kappa)
    return pi


def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    """Under the server's turn, after `prepare`: only what reads θ. The statistics wait for `diagnostics`,
    which the worker runs once it has handed the turn on."""
    m, stale, theta = state["m"].copy_(scratch(grad, "m_next")), state["stale"], view.theta  # m ← μm + Δθ
    central = torch.sub(theta, stale, out=scratch(theta, "central"))  # θ − s
    stale.copy_(theta)  # the next commit's s: θ as it is now, before this commit lands
    if hp.proxy == "global":  # the server's proxy, as it is now
        proxy = view.server["proxy"]
        pi = _numerator(proxy, hp)
    else:  # κ|m|, from prepare
        proxy, pi = m, scratch(m, "pi")
    pi.sub_(torch.abs(central, out=scratch(m, "tmp")))
    pi.div_(scratch(m, "denominator")).clamp_(0.0, hp.pi_max)
    delta = scratch(grad, "update").mul_(pi)  # πΔθ, the commit
    # the global proxy moves with every commit: its energy is read now, while it is the one π used
    metrics = {"proxy_energy": 0.5 * hp.kappa**2 * float(proxy.dot(proxy))}
    payload = {"m": m} if hp.proxy == "global" else {}
    return Commit(delta=delta, payload=payload, metrics=metrics, aux={"pi": pi, "central": central})


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta)
    if hp.proxy == "global":
        server = view.server
        server["proxy_commits"] += 1
        k = min(int(server["proxy_commits"]), max(hp.workers, 1))
        server["proxy"].mul_(1 - 1 / k).add_(commit.payload["m"], alpha=1 / k)


def diagnostics(commit: Commit, layout, hp: Params) -> tuple[dict[str, float], dict[str, list[float]]]:
    """π's median, mean and clamped fractions, over all elements and per tensor, and the central energy."""
    central = commit.aux["central"].add_(commit.delta)  # θ − s + πΔθ: the central variable's move over the cycle
    metrics, tensors = pi_stats(commit.aux["pi"], layout, hp.pi_max)
    metrics["central_energy"] = 0.5 * float(central.dot(central))
    return metrics, tensors


def _clamped_median(n: int, z: int, c: int, inner, pi_max: float) -> float:
    """Lower median of n values of π clamped to [0, pi_max], z of them at 0 and c at pi_max, given the others
    (`inner`, strictly between the clamps, in any order; partially sorted in place).

    Sorted, π is its zeros, then the inner values, then the values at pi_max, so the median is a clamp or the
    inner value of rank k − z. Selecting among the inner values only is what keeps this cheap: late in training
    most of π sits at a clamp, and those ties slow numpy's introselect down about 4x (torch.median costs about
    10x more on CPU).
    """
    k = (n - 1) // 2
    if k < z:
        return 0.0
    if k >= n - c:
        return float(pi_max)
    inner.partition(k - z)
    return float(inner[k - z])


def pi_stats(pi: torch.Tensor, layout, pi_max: float) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(overall metrics, per-tensor lists in layout order) of π.

    One copy of the inner values, tensor after tensor (a model's layout is contiguous and in order), serves every
    median: each tensor's is a selection in its own segment, the overall one a selection in all of it.
    """
    if pi.device.type != "cpu":  # the GPU does the selection itself; one transfer of the results
        return _pi_stats_torch(pi, layout, pi_max)
    a = pi.numpy()  # numpy selection is much faster than torch.median on CPU
    zero, top = a == 0, a == pi_max
    inner = np.compress(~(zero | top), a)
    starts = [sl.start for _, sl in layout]
    contiguous = starts == [0, *(sl.stop for _, sl in layout[:-1])]
    stop = layout[-1][1].stop if layout else 0
    sums = np.add.reduceat(a[:stop], starts) if contiguous and layout else [a[sl].sum() for _, sl in layout]
    tensors = {"pi_median": [], "pi_mean": [], "pi_zero_frac": []}
    start = 0
    for (_, sl), total in zip(layout, sums, strict=True):
        n = sl.stop - sl.start
        z, c = int(np.count_nonzero(zero[sl])), int(np.count_nonzero(top[sl]))
        if contiguous:
            part_inner = inner[start:start + n - z - c]
            start += n - z - c
        else:
            part_inner = np.compress(~(zero[sl] | top[sl]), a[sl])
        tensors["pi_median"].append(_clamped_median(n, z, c, part_inner, pi_max))
        tensors["pi_mean"].append(float(total) / n)
        tensors["pi_zero_frac"].append(z / n)
    z, c = int(np.count_nonzero(zero)), int(np.count_nonzero(top))
    covered = contiguous and stop == a.size
    metrics = {"pi_median": _clamped_median(a.size, z, c, inner, pi_max),
               "pi_mean": float(np.sum(sums, dtype=np.float64)) / a.size if covered else float(a.mean()),
               "pi_zero_frac": z / a.size, "pi_max_frac": c / a.size}
    return metrics, tensors


def _pi_stats_torch(pi, layout, pi_max):
    zero = pi == 0
    parts = [pi[sl] for _, sl in layout]
    values = torch.stack([pi.median(), pi.mean(), zero.float().mean(), (pi == pi_max).float().mean(),
                          *(p.median() for p in parts), *(p.mean() for p in parts),
                          *(zero[sl].float().mean() for _, sl in layout)]).tolist()
    k = len(parts)
    metrics = dict(zip(("pi_median", "pi_mean", "pi_zero_frac", "pi_max_frac"), values[:4], strict=True))
    tensors = {"pi_median": values[4:4 + k], "pi_mean": values[4 + k:4 + 2 * k],
               "pi_zero_frac": values[4 + 2 * k:]}
    return metrics, tensors


ALGORITHM = Algorithm("gem", Params, init_state, worker_rule, server_rule, init_server=init_server,
                      prepare=prepare, diagnostics=diagnostics)
