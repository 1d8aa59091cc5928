"""Gradient Energy Matching (Hermans & Louppe 2018); docs/design.md, "The science in one page".

Each worker keeps the proxy, its own estimate of sequential momentum SGD, m ← μm + Δθ with Δθ = −η∇L,
and rescales its update element by element so that the kinetic energy of the central variable matches the
proxy's (paper eq. 27):

    π = (κ|m| − |θ − s|) / (|Δθ| + ε),   clamped to [0, π_max]        commit πΔθ;   server: θ ← θ + πΔθ

θ − s is how far the central variable moved since this worker's previous commit, its own commit included:
s is a copy of θ taken just before the server applies this worker's commit (worker_rule runs exactly then).
engine=distributed over the wire runs the whole rule at the server, on each worker's m and s kept there and the
gradient it sends (`runs_at_server` on worker_rule; docs/design.md, "Full duplex over the wire").
With one worker and κ = 1, θ − s is the worker's previous commit and GEM reduces to matching momentum SGD.

`proxy=global` (beyond the paper, its future work): the parameter server estimates the proxy from all
workers. Each commit carries the worker's m, and the server keeps their running average M, over all commits
until n have arrived, then an exponential average with weight 1/n (about the last n commits, one per
worker). Workers use κ|M| in place of κ|m|: the same scale, with the noise of n workers averaged out.

Per-commit diagnostics (docs/design.md): the median, mean and fraction-zero of π over all elements and per
parameter tensor, the fraction clamped at π_max, the proxy energy ½‖κm‖² (κM with the global proxy), and
the central energy ½‖θ − s + πΔθ‖². The median is the lower median (torch.median's convention).

On CPU the commit and the statistics run as fused loops (numba, below): the whole worker rule in one pass over the
parameters where the torch operations took about fifteen, and the medians by a histogram of π's bits instead of a
selection. They compute what the torch operations compute, bit for bit: the same float32 operations on each
element in the same order, no fused multiply-add (numba contracts none without fastmath), and the medians are
elements of π, chosen by rank. Only the two energies differ, by float32 rounding: the loop sums them exactly
(float64) where torch's float32 dot products err by up to a few 1e-6 relative. tests/test_algorithms.py and
tests/test_sim.py check all of it, on single commits and on a whole run. Elsewhere (a GPU, float64) the torch
operations run, as they do in the reference the tests compare with (`FUSED = False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from gem.algorithms import Algorithm, AtServer, Commit, View, positive, require, runs_at_server, scratch

PROXIES = ("local", "global")
FUSED = True  # the CPU loops below where they apply; False: the torch operations everywhere (the reference)


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
    return {
        "m": torch.zeros_like(theta),  # the worker's proxy momentum
        "stale": theta.clone(),
    }  # s: θ just before this worker's previous commit (at start: θ₀)


def init_server(theta: torch.Tensor, hp: Params, workers: int) -> dict:
    if hp.proxy != "global":
        return {}
    return {"proxy": torch.zeros_like(theta), "proxy_commits": torch.zeros((), dtype=torch.long)}


def payload(theta: torch.Tensor, hp: Params) -> dict:
    """What a commit carries for the server rule: under the global proxy, the worker's momentum m (θ's shape)."""
    return {"m": theta} if hp.proxy == "global" else {}


def prepare(state, x, grad, hp: Params) -> None:
    """The part of the commit that does not read θ, run before the worker takes the turn: Δθ, the proxy's next
    value μm + Δθ, and π's numerator κ|μm + Δθ| (local proxy) and denominator |Δθ| + ε. In scratch buffers only:
    the worker's state must stay as it was until its turn (a checkpoint taken while it waits saves it).

    Nothing, where the worker rule runs as one fused loop: computing these as it goes costs less than writing them
    out here and reading them back there (eight passes over the parameters instead of twelve), and the loop holds
    the turn for less time than the torch operations that read θ alone."""
    if _fused(grad, state["m"], state["stale"]):
        return
    update, m_next = scratch(grad, "update"), scratch(grad, "m_next")
    torch.mul(grad, -hp.lr, out=update)  # Δθ
    torch.mul(state["m"], hp.momentum, out=m_next).add_(update)
    torch.abs(update, out=scratch(grad, "denominator")).add_(hp.eps)
    if hp.proxy == "local":
        _numerator(m_next, hp)


def _numerator(proxy: torch.Tensor, hp: Params) -> torch.Tensor:
    pi = torch.abs(proxy, out=scratch(proxy, "pi"))
    if hp.kappa != 1:  # x·1 is x exactly: skip a pass over the model for the default κ
        pi.mul_(hp.kappa)
    return pi


def _gradient(state, x, grad, hp: Params) -> dict[str, torch.Tensor]:
    """What a worker sends for its rule at the server: its gradient, of which the rule makes Δθ = −η∇L there as it
    would here (the same bytes as Δθ; the rule then runs exactly as written)."""
    return {"grad": grad}


def _whole_rule(kept, sent, view: View, hp: Params) -> Commit:
    """The worker rule at the server, whole, as the worker cycle runs it (prepare, then worker_rule), on the
    worker's m and s kept there and the gradient it sent; x is not read."""
    prepare(kept, None, sent["grad"], hp)
    return worker_rule(kept, None, sent["grad"], view, hp)


# engine=distributed over the wire: m and s live at the server, where θ − s is read at the θ the commit is applied
# to, and the worker sends its gradient alone (docs/design.md, "Full duplex over the wire")
@runs_at_server(AtServer(keeps=("m", "stale"), sends=_gradient, rule=_whole_rule))
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    """Under the server's turn, after `prepare`: only what reads θ. The statistics wait for `diagnostics`,
    which the worker runs once it has handed the turn on."""
    m, stale, theta = state["m"], state["stale"], view.theta
    update, pi = scratch(grad, "update"), scratch(m, "pi")
    proxy = view.server["proxy"] if hp.proxy == "global" else m  # the server's proxy as it is now, or m
    if _fused(grad, m, stale):  # as in prepare
        # Δθ, m ← μm + Δθ, θ − s, s ← θ, π, πΔθ (into update) and both energies in one pass
        proxy_sq, moved_sq = _rule_loop(
            grad.numpy(),
            m.numpy(),
            theta.numpy(),
            stale.numpy(),
            None if proxy is m else proxy.numpy(),
            np.float32(-hp.lr),
            np.float32(hp.momentum),
            np.float32(hp.kappa),
            hp.kappa != 1,
            np.float32(hp.eps),
            np.float32(hp.pi_max),
            update.numpy(),
            pi.numpy(),
        )
        aux = {"pi": pi, "central_energy": torch.tensor(0.5 * moved_sq, dtype=torch.float64)}
    else:
        m.copy_(scratch(grad, "m_next"))  # m ← μm + Δθ
        central = torch.sub(theta, stale, out=scratch(theta, "central"))  # θ − s
        stale.copy_(theta)  # the next commit's s: θ as it is now, before this commit lands
        if hp.proxy == "global":
            _numerator(proxy, hp)
        pi.sub_(torch.abs(central, out=scratch(m, "tmp")))
        pi.div_(scratch(m, "denominator")).clamp_(0.0, hp.pi_max)
        update.mul_(pi)  # πΔθ, the commit
        # the global proxy moves with every commit: its energy is read now, while it is the one π used
        proxy_sq = float(proxy.dot(proxy))
        aux = {"pi": pi, "central": central}
    metrics = {"proxy_energy": 0.5 * hp.kappa**2 * proxy_sq}
    return Commit(delta=update, payload=payload(m, hp), metrics=metrics, aux=aux)


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta)
    if hp.proxy == "global":
        server = view.server
        server["proxy_commits"] += 1
        k = min(int(server["proxy_commits"]), max(hp.workers, 1))
        server["proxy"].mul_(1 - 1 / k).add_(commit.payload["m"], alpha=1 / k)


def diagnostics(commit: Commit, layout, hp: Params) -> tuple[dict[str, float], dict[str, list[float]]]:
    """π's median, mean and clamped fractions, over all elements and per tensor, and the central energy."""
    metrics, tensors = pi_stats(commit.aux["pi"], layout, hp.pi_max)
    if "central_energy" in commit.aux:  # summed by the fused loop as it went
        metrics["central_energy"] = float(commit.aux["central_energy"])
    else:
        central = commit.aux["central"].add_(commit.delta)  # θ − s + πΔθ: the central variable's move over the cycle
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
    fused = _pi_stats_fused(a, layout, pi_max) if _fused(pi) else None
    if fused is not None:
        return fused
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
            part_inner = inner[start : start + n - z - c]
            start += n - z - c
        else:
            part_inner = np.compress(~(zero[sl] | top[sl]), a[sl])
        tensors["pi_median"].append(_clamped_median(n, z, c, part_inner, pi_max))
        tensors["pi_mean"].append(float(total) / n)
        tensors["pi_zero_frac"].append(z / n)
    z, c = int(np.count_nonzero(zero)), int(np.count_nonzero(top))
    covered = contiguous and stop == a.size
    metrics = {
        "pi_median": _clamped_median(a.size, z, c, inner, pi_max),
        "pi_mean": float(np.sum(sums, dtype=np.float64)) / a.size if covered else float(a.mean()),
        "pi_zero_frac": z / a.size,
        "pi_max_frac": c / a.size,
    }
    return metrics, tensors


def _pi_stats_torch(pi, layout, pi_max):
    zero = pi == 0
    parts = [pi[sl] for _, sl in layout]
    values = torch.stack(
        [
            pi.median(),
            pi.mean(),
            zero.float().mean(),
            (pi == pi_max).float().mean(),
            *(p.median() for p in parts),
            *(p.mean() for p in parts),
            *(zero[sl].float().mean() for _, sl in layout),
        ]
    ).tolist()
    k = len(parts)
    metrics = dict(zip(("pi_median", "pi_mean", "pi_zero_frac", "pi_max_frac"), values[:4], strict=True))
    tensors = {
        "pi_median": values[4 : 4 + k],
        "pi_mean": values[4 + k : 4 + 2 * k],
        "pi_zero_frac": values[4 + 2 * k :],
    }
    return metrics, tensors


# ------------------------------------------------------------------------------------------ fused CPU loops
# Each loop does, element by element, exactly the float32 operations of the torch code above, in its order.


def _fused(*tensors: torch.Tensor) -> bool:
    return FUSED and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and not t.requires_grad
        for t in tensors
    )


_jit = numba.njit(cache=True, nogil=True, error_model="numpy")  # numpy's: no check for a zero divisor (ε > 0)


# reassoc: the two sums may be taken in vectorised partial sums. It reorders additions of a sum only: nothing
# else in the loop is a chain of additions or products, and no multiply-add is contracted (that is `contract`)
@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _rule_loop(grad, m, theta, stale, proxy, neg_lr, momentum, kappa, scaled, eps, pi_max, update, pi):
    """Returns ‖proxy‖² and ‖θ − s + πΔθ‖², summed in float64 (torch's float32 dot products differ from these
    sums by float32 rounding, a few 1e-6 relative at most: they are metrics, not part of the commit). `proxy`
    None: the local proxy, m itself."""
    proxy_sq, moved_sq = 0.0, 0.0
    for i in range(theta.size):
        u = grad[i] * neg_lr  # Δθ
        mn = m[i] * momentum + u  # two roundings, as mul then add_
        m[i] = mn
        q = mn if proxy is None else proxy[i]
        th = theta[i]
        c = th - stale[i]  # θ − s
        stale[i] = th
        proxy_sq += np.float64(q) * np.float64(q)
        num = abs(q)
        if scaled:
            num = num * kappa
        p = (num - abs(c)) / (abs(u) + eps)
        if p < 0:  # clamp_(0, π_max); a NaN stays NaN, as there
            p = np.float32(0)
        elif p > pi_max:
            p = pi_max
        pi[i] = p
        d = u * p  # πΔθ
        update[i] = d
        moved = c + d
        moved_sq += np.float64(moved) * np.float64(moved)
    return proxy_sq, moved_sq


_SHIFT, _BINS = 20, 2048  # a float32 ≥ 0 has its exponent and top 3 mantissa bits above bit 20: 8 bins per octave


@_jit
def _median_loop(pi, bounds, pi_max, top_bin, out):
    """The lower median of π in each segment [bounds[t], bounds[t+1]) (out[t]) and over all of it (out[T]),
    by rank, as `_clamped_median` selects it: values at 0 and at π_max are counted (the counts are returned),
    the others go into a histogram of their top bits; the bin that holds the median's rank is gathered in a second
    pass and the median selected among those few. `kind[t]`: 0 a value in out[t], 1 zero, 2 π_max. Returns
    ok = False, and nothing valid, if π holds a NaN, an infinity or a negative value (the numpy code decides)."""
    bits = pi.view(np.uint32)
    T = bounds.size - 1
    zeros, tops = np.zeros(T, np.int64), np.zeros(T, np.int64)
    kind = np.zeros(T + 1, np.int64)
    top_bits = np.array([pi_max]).view(np.uint32)[0]
    hist = np.empty(4 * _BINS, np.int32)  # four interleaved copies: neighbours, often in one bin, do not wait
    total = np.zeros(_BINS, np.int64)  # on each other's increment
    target, rank, size = np.full(T + 1, -1, np.int64), np.zeros(T + 1, np.int64), np.zeros(T + 1, np.int64)
    for s in range(T):  # the clamps first: a median at a clamp needs no histogram
        z, c, bad = 0, 0, np.uint32(0)
        for i in range(bounds[s], bounds[s + 1]):  # a loop the compiler vectorises
            b = bits[i]
            z += np.int64(b == 0)
            c += np.int64(b == top_bits)
            bad = max(bad, b)
        if bad >= np.uint32(0x7F800000):  # NaN, ±inf or a sign bit
            return zeros, tops, kind, False
        zeros[s], tops[s] = z, c
    for s in range(T + 1):
        n = bounds[s + 1] - bounds[s] if s < T else bounds[T] - bounds[0]
        z, c = (zeros[s], tops[s]) if s < T else (zeros.sum(), tops.sum())
        k = (n - 1) // 2
        kind[s] = 1 if k < z else 2 if k >= n - c else 0
    for s in range(T + 1):
        if s < T:
            if kind[s] != 0 and kind[T] != 0:  # neither this tensor's median nor the overall one needs its bins
                continue
            hist[:] = 0
            for i in range(bounds[s], bounds[s + 1]):
                hist[((bits[i] >> _SHIFT) << 2) | (i & 3)] += 1
            h = (hist[0::4] + hist[1::4] + hist[2::4] + hist[3::4]).astype(np.int64)
            h[0] -= zeros[s]  # the histogram of the values strictly between the clamps
            h[top_bin] -= tops[s]
            total += h
            n, z, c = bounds[s + 1] - bounds[s], zeros[s], tops[s]
        else:
            n, z, c, h = bounds[T] - bounds[0], zeros.sum(), tops.sum(), total
        if kind[s] != 0:
            continue
        r, j = (n - 1) // 2 - z, 0
        while r >= h[j]:
            r -= h[j]
            j += 1
        # gathered below: every value of bin j, the clamped ones included; zeros sort first in bin 0, values at
        # π_max last in theirs, so the median's rank among them is r past the zeros
        target[s], rank[s] = j, r + (z if j == 0 else 0)
        size[s] = h[j] + (z if j == 0 else 0) + (c if j == top_bin else 0)
    mine, every = np.empty(size[:T].max() + 1, np.float32), np.empty(size[T] + 1, np.float32)
    k_all, j_all = 0, target[T]
    for t in range(T):
        j_t, k_t = target[t], 0
        if j_t < 0 and j_all < 0:  # both medians at a clamp (most commits at large n, where most of π is 0)
            continue
        for i in range(bounds[t], bounds[t + 1]):  # a bin holds few values: these branches are rarely taken
            j = np.int64(bits[i] >> _SHIFT)
            if j == j_t:
                mine[k_t] = pi[i]
                k_t += 1
            if j == j_all:
                every[k_all] = pi[i]
                k_all += 1
        if j_t >= 0:
            out[t] = np.partition(mine[:k_t], rank[t])[rank[t]]
    if j_all >= 0:
        out[T] = np.partition(every[:k_all], rank[T])[rank[T]]
    return zeros, tops, kind, True


def _pi_stats_fused(a: np.ndarray, layout, pi_max: float):
    """`pi_stats` by `_median_loop`, or None where it does not apply (a layout that is not contiguous and in
    order, or π not finite and ≥ 0): then the numpy code runs."""
    starts = [sl.start for _, sl in layout]
    if not layout or starts != [0, *(sl.stop for _, sl in layout[:-1])] or layout[-1][1].stop != a.size:
        return None
    bounds = np.array([*starts, a.size], np.int64)
    out = np.empty(len(layout) + 1, np.float32)
    top = np.float32(pi_max)
    zeros, tops, kind, ok = _median_loop(a, bounds, top, int(top.view(np.uint32)) >> _SHIFT, out)
    if not ok:
        return None
    medians = [float(v) if k == 0 else 0.0 if k == 1 else float(pi_max) for v, k in zip(out, kind, strict=True)]
    sums = np.add.reduceat(a, starts)
    sizes = np.diff(bounds)
    tensors = {
        "pi_median": medians[:-1],
        "pi_mean": [float(v) / n for v, n in zip(sums, sizes, strict=True)],
        "pi_zero_frac": [int(z) / n for z, n in zip(zeros, sizes, strict=True)],
    }
    z, c = int(zeros.sum()), int(tops.sum())
    metrics = {
        "pi_median": medians[-1],
        "pi_mean": float(np.sum(sums, dtype=np.float64)) / a.size,
        "pi_zero_frac": z / a.size,
        "pi_max_frac": c / a.size,
    }
    return metrics, tensors


# how the statistics of a commit made on each server's slice of θ add up to the row's (engine.servers > 1): the
# energies are sums over the elements, the means and fractions at a clamp are weighted by the slices' sizes, and a
# median is exact where one slice holds its elements (a tensor whole on one server) and NaN where it spans several
OVER_SLICES = {
    "proxy_energy": "sum",
    "central_energy": "sum",
    "pi_mean": "mean",
    "pi_zero_frac": "mean",
    "pi_max_frac": "mean",
    "pi_median": "median",
}


def warm() -> None:
    """Compile the loops now (or load them from numba's cache), in this process: the forkserver that worker
    processes are forked from calls it, so that no worker compiles them again."""
    x = torch.ones(4)
    for hp in (Params(), Params(proxy="global")):  # the rule's loop is compiled once for each kind of proxy
        state = init_state(x, hp)
        prepare(state, x, x, hp)
        commit = worker_rule(state, x, x, View(x.clone(), init_server(x, hp, 1), 0, 0, 0), hp)
    diagnostics(commit, [("a", slice(0, 2)), ("b", slice(2, 4))], Params())


ALGORITHM = Algorithm(
    "gem",
    Params,
    init_state,
    worker_rule,
    server_rule,
    init_server=init_server,
    payload=payload,
    prepare=prepare,
    diagnostics=diagnostics,
    over_slices=OVER_SLICES,
)
