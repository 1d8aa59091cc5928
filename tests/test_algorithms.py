"""Each update rule against tensors computed by hand (docs/design.md). A wrong sign or factor fails here."""

import dataclasses
import itertools
import math

import pytest
import torch

from experiments.config import CONF_DIR
from gem import algorithms
from gem.algorithms import (
    View,
    adaptive,
    agn,
    async_localsgd,
    dcasgd,
    delay_adaptive,
    downpour,
    eamsgd,
    easgd,
    gem,
    rennala,
    ringmaster,
    sgd,
    ssgd,
)

T = torch.tensor
LAYOUT = [("a", slice(0, 4)), ("b", slice(4, 6))]


def at(theta, server=None, staleness=0, t=0, worker=0) -> View:
    """The view a rule gets at a commit: θ, the server's tensors, the clock, τ, the worker."""
    return View(theta, {} if server is None else server, t, staleness, worker)


def commit(module, state, x, grad, theta, hp, server=None, layout=LAYOUT):
    """A commit as every engine makes it: prepare (before the turn), the worker rule at a view of θ, then, once
    the turn is handed on, the diagnostics (merged into commit.metrics; the per-tensor lists in commit.tensors)."""
    algo = module.ALGORITHM
    if algo.prepare is not None:
        algo.prepare(state, x, grad, hp)
    c = algo.worker_rule(state, x, grad, at(theta, server), hp)
    c.tensors = {}
    if algo.diagnostics is not None:
        metrics, c.tensors = algo.diagnostics(c, layout, hp)
        c.metrics.update(metrics)
    return c


def step(module, state, x, grad, theta, hp, i, server=None):
    """A worker's i-th gradient (from 1), as the worker cycle runs it: a local step inside a window (None), the
    worker rule, a commit, at the window's end."""
    algo = module.ALGORITHM
    k = i % algo.commit_every(hp)
    if k:
        algo.local_step(state, x, grad, hp, k)
        return None
    return commit(module, state, x, grad, theta, hp, server)


def close(a, b, tol=1e-6):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0
    )


# ------------------------------------------------------------------------------------------------- GEM
# lr = 1 and μ = 0.5, so Δθ = −g and m = m0/2 − g. s = 1 everywhere, θ = s + (θ − s).
M0 = [4.0, 0.0, 0.0, 20.0, 2.0, -4.0]
GRAD = [1.0, 2.0, 1.0, 1.0, 0.0, -1.0]
DRIFT = [0.5, 0.0, 3.0, 0.0, 0.0, 0.25]  # θ − s
# m = [1, -2, -1, 9, 1, -1]; Δθ = [-1, -2, -1, -1, 0, 1]
# π = (|m| − |θ − s|)/|Δθ| = [0.5, 1, -2 -> 0, 9 -> 5, 1/ε -> 5, 0.75]
PI = [0.5, 1.0, 0.0, 5.0, 5.0, 0.75]


def gem_commit(kappa=1.0, pi_max=5.0, proxy="local", server=None):
    hp = gem.Params(lr=1.0, momentum=0.5, kappa=kappa, pi_max=pi_max, proxy=proxy)
    stale = torch.ones(6)
    state = gem.ALGORITHM.init_state(stale, hp)
    state["m"].copy_(T(M0))
    theta = stale + T(DRIFT)
    return commit(gem, state, theta.clone(), T(GRAD), theta, hp, server), state, theta


def test_gem_pi_and_commit_by_hand():
    c, state, theta = gem_commit()
    delta = [p * -g for p, g in zip(PI, GRAD, strict=True)]  # πΔθ = [-0.5, -2, 0, -5, 0, 0.75]
    assert close(c.delta, delta)
    assert close(state["m"], [1, -2, -1, 9, 1, -1])
    assert torch.equal(state["stale"], theta)  # the next θ − s counts from θ just before this commit
    assert c.pull and not c.payload


def test_gem_clamps_at_zero_and_pi_max():
    c, _, _ = gem_commit(pi_max=0.8)  # π = [0.5, 0.8, 0, 0.8, 0.8, 0.75]
    assert close(c.delta, [-0.5, -1.6, 0.0, -0.8, 0.0, 0.75])
    assert c.metrics["pi_zero_frac"] == pytest.approx(1 / 6)
    assert c.metrics["pi_max_frac"] == pytest.approx(3 / 6)


def test_gem_kappa_scales_the_proxy():
    c, _, _ = gem_commit(kappa=2.0)  # π = (2|m| − |θ − s|)/|Δθ| = [1.5, 2, 0, 5, 5, 1.75]
    assert close(c.delta, [-1.5, -4.0, 0.0, -5.0, 0.0, -1.75 * -1])
    assert c.metrics["proxy_energy"] == pytest.approx(0.5 * 4 * 89)


def test_gem_metrics_by_hand():
    c, _, _ = gem_commit()
    m = c.metrics
    assert m["pi_median"] == pytest.approx(0.75)  # lower median of [0, .5, .75, 1, 5, 5]
    assert m["pi_mean"] == pytest.approx(12.25 / 6)
    assert m["pi_zero_frac"] == pytest.approx(1 / 6)
    assert m["proxy_energy"] == pytest.approx(0.5 * 89)  # ½‖κm‖², ‖m‖² = 1+4+1+81+1+1
    # ½‖θ − s + πΔθ‖²: θ − s + πΔθ = [0, −2, 3, −5, 0, 1]
    assert m["central_energy"] == pytest.approx(0.5 * 39)
    t = c.tensors  # a = [.5, 1, 0, 5], b = [5, .75]
    assert t["pi_median"] == pytest.approx([0.5, 0.75])
    assert t["pi_mean"] == pytest.approx([6.5 / 4, 5.75 / 2])
    assert t["pi_zero_frac"] == pytest.approx([0.25, 0.0])


def test_gem_drift_includes_the_workers_own_previous_commit():
    hp = gem.Params(lr=0.1, momentum=0.9)
    theta = torch.zeros(6)
    a, b = gem.ALGORITHM.init_state(theta, hp), gem.ALGORITHM.init_state(theta, hp)
    g = T([1.0, -1.0, 2.0, 0.5, -0.5, 1.0])
    c1 = commit(gem, a, theta.clone(), g, theta, hp)
    d1 = c1.delta.clone()
    gem.ALGORITHM.server_rule(at(theta), c1, hp)
    c2 = commit(gem, b, theta.clone(), 2 * g, theta, hp)
    d2 = c2.delta.clone()
    gem.ALGORITHM.server_rule(at(theta, staleness=1), c2, hp)
    assert torch.equal(a["stale"], torch.zeros(6)) and torch.equal(b["stale"], d1)
    c3 = commit(gem, a, theta.clone(), g, theta, hp)
    # the central movement since a's previous commit is a's own commit plus b's, plus this one
    assert c3.metrics["central_energy"] == pytest.approx(0.5 * float((d1 + d2 + c3.delta).pow(2).sum()), rel=1e-5)


def test_gem_matches_the_proxy_energy_when_pi_is_not_clamped():
    # n = 1, κ = 1, a constant gradient: θ − s is the worker's previous commit, and π makes the central
    # movement over the cycle, previous commit plus this one, exactly as large as the proxy's momentum
    hp = gem.Params(lr=0.1, momentum=0.5)
    theta = torch.zeros(3)
    state = gem.ALGORITHM.init_state(theta, hp)
    pis = []
    for _ in range(40):
        c = commit(gem, state, theta.clone(), torch.ones(3), theta, hp, layout=[("w", slice(0, 3))])
        gem.ALGORITHM.server_rule(at(theta), c, hp)
        pis.append(c.metrics["pi_median"])
        assert c.metrics["central_energy"] == pytest.approx(c.metrics["proxy_energy"], rel=1e-5)
    assert pis[:3] == pytest.approx([1.0, 0.5, 1.25])  # |m|/|Δθ| = 1, 1.5, 1.75 minus the previous π
    assert pis[-1] + pis[-2] == pytest.approx(2.0, rel=1e-4)  # |m| → η/(1 − μ) = 2|Δθ|


def test_gem_global_proxy_is_the_servers_average_of_worker_momenta():
    hp = gem.Params(lr=1.0, momentum=0.5, proxy="global", workers=2)
    theta = torch.zeros(6)
    server = gem.ALGORITHM.init_server(theta, hp, 2)
    ms = [torch.full((6,), v) for v in (2.0, 4.0, 8.0)]
    for m in ms:
        gem.ALGORITHM.server_rule(at(theta, server), algorithms.Commit(delta=torch.zeros(6), payload={"m": m}), hp)
    # the mean until n commits have arrived, then an exponential average with weight 1/n
    assert close(server["proxy"], torch.full((6,), ((2 + 4) / 2) / 2 + 8 / 2))
    # a worker uses κ|M| from the server, not its own m
    server = {"proxy": T(M0) / 2 - T(GRAD), "proxy_commits": torch.tensor(5)}  # = the local m of gem_commit
    c, state, _ = gem_commit(proxy="global", server=server)
    assert close(c.delta, [p * -g for p, g in zip(PI, GRAD, strict=True)])
    server["proxy"].zero_()
    c, _, _ = gem_commit(proxy="global", server=server)
    assert close(c.delta, torch.zeros(6))  # no proxy energy at the server: nothing to commit
    assert c.payload["m"] is not None and close(c.payload["m"], state["m"])


# --------------------------------------------------------------------------- DOWNPOUR, adaptive, AGN


def test_downpour_commits_a_plain_sgd_step_however_stale():
    hp = downpour.Params(lr=0.1, momentum=0.9)  # the top-level momentum is GEM's proxy μ, not downpour's
    theta = torch.zeros(2)
    state = downpour.ALGORITHM.init_state(theta, hp)
    for _ in range(2):  # no momentum carried from one commit to the next
        c = commit(downpour, state, theta.clone(), T([1.0, -2.0]), theta, hp)
        assert close(c.delta, [-0.1, 0.2]) and c.pull
    downpour.ALGORITHM.server_rule(at(theta, staleness=7), c, hp)  # however stale, added as it is
    assert close(theta, [-0.1, 0.2])


def test_downpour_local_momentum():
    hp = downpour.Params(lr=0.1, local_momentum=0.5)
    theta = torch.zeros(2)
    state = downpour.ALGORITHM.init_state(theta, hp)
    state["m"].copy_(T([1.0, -2.0]))
    c = commit(downpour, state, theta.clone(), T([1.0, 1.0]), theta, hp)
    assert close(c.delta, [0.5 - 0.1, -1.0 - 0.1])  # m ← μ'm − ηg


@pytest.mark.parametrize("module, scale", [(downpour, 1.0), (agn, 0.5)])
def test_window_accumulates_local_steps(module, scale):
    hp = module.Params(lr=0.1, local_momentum=0.5, window=2)
    theta, x = torch.zeros(2), torch.zeros(2)
    state = module.ALGORITHM.init_state(theta, hp)
    g = T([1.0, -1.0])
    assert step(module, state, x, g, theta, hp, 1) is None
    assert close(x, [-0.1, 0.1])  # the local copy moved by m1 = −ηg
    c = step(module, state, x, g, theta, hp, 2)
    # m2 = μ'm1 − ηg = −0.15g; the window's difference x − s = m1 + m2 = −0.25g, and AGN divides it by λ = 2
    assert close(c.delta, [-0.25 * scale, 0.25 * scale])
    x.copy_(theta)  # the engine pulls; the next window starts afresh
    assert step(module, state, x, g, theta, hp, 3) is None
    c = step(module, state, x, g, theta, hp, 4)
    m3, m4 = -0.175, -0.1875  # μ' = 0.5 carries across windows
    assert close(c.delta, [(m3 + m4) * scale, -(m3 + m4) * scale])


def test_agn_default_window_divides_by_ten():
    hp = agn.Params(lr=1.0, momentum=0.0)
    assert hp.window == 10
    theta, x = torch.zeros(1), torch.zeros(1)
    state = agn.ALGORITHM.init_state(theta, hp)
    commits = [step(agn, state, x, T([1.0]), theta, hp, i) for i in range(1, 11)]
    assert all(c is None for c in commits[:9])
    assert close(commits[9].delta, [-1.0])  # ten steps of −1, averaged
    assert close(x, [-9.0])  # nine local steps taken; the tenth is in the commit


@pytest.mark.parametrize("tau", [0, 1, 3, 29])
def test_adaptive_divides_by_staleness_plus_one(tau):
    hp = adaptive.Params()
    theta = torch.ones(3)
    adaptive.ALGORITHM.server_rule(at(theta, staleness=tau), algorithms.Commit(delta=torch.full((3,), 6.0)), hp)
    assert close(theta, torch.full((3,), 1 + 6 / (tau + 1)))


def test_adaptive_worker_is_downpours():
    hp_a, hp_d = adaptive.Params(lr=0.1, local_momentum=0.9), downpour.Params(lr=0.1, local_momentum=0.9)
    theta = torch.zeros(2)
    sa, sd = adaptive.ALGORITHM.init_state(theta, hp_a), downpour.ALGORITHM.init_state(theta, hp_d)
    for g in (T([1.0, 2.0]), T([-1.0, 0.5])):
        ca = commit(adaptive, sa, theta.clone(), g, theta, hp_a)
        cd = commit(downpour, sd, theta.clone(), g, theta, hp_d)
        assert torch.equal(ca.delta, cd.delta)


# ------------------------------------------------------------------------------------------- EASGD


def test_easgd_elastic_difference_and_symmetric_update():
    hp = easgd.Params(lr=0.1, window=1, alpha=0.5)
    x, theta = T([1.0, 2.0]), T([0.0, 4.0])
    c = commit(easgd, easgd.ALGORITHM.init_state(theta, hp), x, T([1.0, 1.0]), theta, hp)
    assert close(c.delta, [0.5, -1.0])  # E = α(x − θ)
    assert close(x, [1 - 0.5 - 0.1, 2 + 1.0 - 0.1])  # x ← x − E − ηg
    assert not c.pull  # the worker keeps its own variable
    easgd.ALGORITHM.server_rule(at(theta), c, hp)
    assert close(theta, [0.5, 3.0])  # θ ← θ + E
    assert close(x + theta, [1 + 0 - 0.1, 2 + 4 - 0.1])  # the elastic force conserves x + θ


def test_easgd_window_and_moving_rate():
    hp = easgd.Params(lr=0.1, workers=10, window=3)
    assert easgd.moving_rate(hp) == pytest.approx(0.09)  # β/n with β = 0.9
    assert easgd.moving_rate(dataclasses.replace(hp, rho=2.0)) == pytest.approx(0.2)  # α = ηρ
    assert easgd.moving_rate(dataclasses.replace(hp, alpha=0.3)) == pytest.approx(0.3)
    x, theta = torch.zeros(1), T([9.0])
    state = easgd.ALGORITHM.init_state(theta, hp)
    assert step(easgd, state, x, T([1.0]), theta, hp, 1) is None
    assert step(easgd, state, x, T([1.0]), theta, hp, 2) is None
    assert close(x, [-0.2])  # two plain SGD steps; the top-level momentum is not used
    c = step(easgd, state, x, T([1.0]), theta, hp, 3)
    assert close(c.delta, [0.09 * (-0.2 - 9.0)])
    assert close(x, [-0.2 - 0.09 * (-9.2) - 0.1])


# ------------------------------------------------------------------------------------------ EAMSGD


def eamsgd_reference(steps, a, x0, theta0, lr, delta, alpha, window, lookahead_sign=1.0):
    """Zhang et al. Algorithm 2, written out literally, on f(x) = ½ a x²."""
    xh, v, theta = x0.clone(), torch.zeros_like(x0), theta0.clone()
    out = []
    for t in range(steps):
        if t % window == 0 and t > 0:
            e = alpha * (xh - theta)
            xh, theta = xh - e, theta + e
        g = a * (xh + lookahead_sign * delta * v)
        v = delta * v - lr * g
        xh = xh + v
        out.append((xh.clone(), theta.clone()))
    return out


def test_eamsgd_matches_algorithm_2_with_the_lookahead_ahead_of_the_worker():
    a, x0, theta0 = T([1.0, 3.0]), T([2.0, -1.0]), T([0.5, 0.5])
    hp = eamsgd.Params(lr=0.1, momentum=0.9, window=3, alpha=0.2)
    ref = eamsgd_reference(12, a, x0, theta0, 0.1, 0.9, 0.2, 3)
    wrong = eamsgd_reference(12, a, x0, theta0, 0.1, 0.9, 0.2, 3, lookahead_sign=-1.0)
    x, theta = x0.clone(), theta0.clone()
    state = eamsgd.ALGORITHM.init_state(theta, hp)
    ours = []
    for i in range(1, 13):
        c = step(eamsgd, state, x, a * x, theta, hp, i)  # the engine's gradient, at x
        if c is not None:
            assert not c.pull
            eamsgd.ALGORITHM.server_rule(at(theta), c, hp)
        ours.append((x - 0.9 * state["v"], theta.clone()))  # x̂ = x − δv
    # our exchange comes right after steps 3, 6, 9, 12, Algorithm 2's at the start of t = 3, 6, 9: compare
    # the states in between, where both have done the same exchanges
    for i in (0, 1, 3, 4, 6, 7, 9, 10):
        assert close(ours[i][0], ref[i][0], 1e-5) and close(ours[i][1], ref[i][1], 1e-5), i
    assert not close(ours[10][0], wrong[10][0], 1e-2)  # a look-back (x̂ − δv) gives another path


def test_eamsgd_gradient_point_is_ahead_along_the_velocity():
    hp = eamsgd.Params(lr=0.1, momentum=0.5, window=100)
    theta, x = torch.zeros(1), torch.zeros(1)
    state = eamsgd.ALGORITHM.init_state(theta, hp)
    step(eamsgd, state, x, T([-1.0]), theta, hp, 1)  # v = 0.1, x̂ = 0.1
    assert close(state["v"], [0.1])
    assert close(x, [0.1 + 0.5 * 0.1])  # next gradient at x̂ + δv, further along v


# ------------------------------------------------------------------------------ beyond the paper's baselines


def test_ssgd_applies_the_rounds_mean_with_momentum_once_per_round():
    # n = 2, η = 1, μ = 0.5. Round 1: Δ = [−2, 4], [−4, 0]: m = [−3, 2], θ = [−2, 3]. Round 2: Δ = [0, −2], [−2, −2]:
    # m = 0.5·[−3, 2] + [−1, −2] = [−2.5, −1], θ = [−4.5, 2]
    hp = ssgd.Params(lr=1.0, momentum=0.5, workers=2)
    theta = T([1.0, 1.0])
    server = ssgd.ALGORITHM.server_state(theta, hp, 2)
    for t, grad, expected in [
        (0, [2.0, -4.0], [1.0, 1.0]),
        (1, [4.0, 0.0], [-2.0, 3.0]),
        (2, [0.0, 2.0], [-2.0, 3.0]),
        (3, [2.0, 2.0], [-4.5, 2.0]),
    ]:
        c = ssgd.ALGORITHM.worker_rule({}, theta.clone(), T(grad), at(theta, server, t=t, worker=t % 2), hp)
        assert close(c.delta, [-g for g in grad]) and c.pull_at == (t // 2 + 1) * 2  # pull at the round's end
        ssgd.ALGORITHM.server_rule(at(theta, server, t=t, worker=t % 2), c, hp)
        assert close(theta, expected), t  # θ moves only at a round's last commit
    assert close(server["m"], [-2.5, -1.0]) and close(server["round"], [[0.0, -2.0], [-2.0, -2.0]])  # row i: worker i


def test_ssgd_rounds_the_same_whatever_order_the_rounds_commits_arrive_in():
    # in float32, (1e8 − 1e8) + 1 = 1 but (1e8 + 1) − 1e8 = 0: a running sum would depend on arrival order
    hp = ssgd.Params(lr=1.0, momentum=0.0, workers=3)
    grads = {0: [-1e8, 1.0], 1: [-1.0, 2.0], 2: [1e8, 3.0]}
    thetas = []
    for order in itertools.permutations(range(3)):
        theta = T([0.0, 0.0])
        server = ssgd.ALGORITHM.server_state(theta, hp, 3)
        for t, w in enumerate(order):
            c = ssgd.ALGORITHM.worker_rule({}, theta.clone(), T(grads[w]), at(theta, server, t=t, worker=w), hp)
            ssgd.ALGORITHM.server_rule(at(theta, server, t=t, worker=w), c, hp)
        thetas.append(theta.tolist())
    assert all(th == thetas[0] for th in thetas) and close(thetas[0][1], -2.0), thetas


def dc_commit(hp, grad, theta, workers=2, worker=1):
    server = dcasgd.ALGORITHM.server_state(T([1.0, 2.0]), hp, workers)  # every backup: θ₀ = [1, 2]
    c = dcasgd.ALGORITHM.worker_rule({}, T([1.0, 2.0]), T(grad), at(theta, server, worker=worker), hp)
    dcasgd.ALGORITHM.server_rule(at(theta, server, worker=worker), c, hp)
    return c, server


def test_dcasgd_compensates_with_the_committing_workers_backup():
    # η = 0.5, λ = 0.25, θ = [2, 0], θ_bak = [1, 2], g = [2, −4]: θ − θ_bak = [1, −2], λg⊙g⊙(θ − θ_bak) = [1, −8],
    # g + it = [3, −12]; θ − η(…) = [0.5, 6]
    hp = dcasgd.Params(lr=0.5, dc_lambda=0.25, workers=2)
    theta = T([2.0, 0.0])
    c, server = dc_commit(hp, [2.0, -4.0], theta)
    assert close(c.delta, [-1.0, 2.0])  # the worker commits −ηg
    assert close(theta, [0.5, 6.0])
    assert close(server["backup"][1], [0.5, 6.0]) and close(server["backup"][0], [1.0, 2.0])  # w pulled; 0 did not


def test_dcasgd_adaptive_lambda_divides_by_the_root_mean_square():
    # m = 0.75, λ₀ = 0.5, g = [2, 4]: MeanSquare = 0.25·g⊙g = [1, 4], λ_t = λ₀/√· = [0.5, 0.25],
    # λ_t g⊙g⊙(θ − θ_bak) = [0.5·4·1, 0.25·16·(−2)] = [2, −8]; g + it = [4, −4]; θ = [2, 0] − 0.5·[4, −4] = [0, 2]
    hp = dcasgd.Params(lr=0.5, dc_lambda=0.5, adaptive_lambda=True, ms_momentum=0.75, workers=2)
    theta = T([2.0, 0.0])
    _, server = dc_commit(hp, [2.0, 4.0], theta)
    assert close(server["mean_square"], [1.0, 4.0]) and close(theta, [0.0, 2.0], tol=1e-5)


def test_dcasgd_default_lambda_is_the_papers_for_each_variant():
    assert dcasgd.Params().lam == 0.04 and dcasgd.Params(adaptive_lambda=True).lam == 2.0
    assert dcasgd.Params(dc_lambda=0.0, adaptive_lambda=True).lam == 0.0


def test_async_localsgd_inner_momentum_steps_and_outer_nesterov():
    # H = 2, η = 1, μ = 0.5, η_o = 0.5, μ_o = 0.5. Window 1: g = 1, 2: m = −1, −2.5; x − s = −3.5, Δ = 3.5;
    # v = 3.5, θ = 10 − 0.5·(3.5 + 0.5·3.5) = 7.375. Window 2, g = 0, 0 (m carried over the pull): m = −1.25, −0.625,
    # Δ = 1.875; v = 0.5·3.5 + 1.875 = 3.625, θ = 7.375 − 0.5·(1.875 + 0.5·3.625) = 5.53125
    hp = async_localsgd.Params(lr=1.0, momentum=0.5, window=2, outer_lr=0.5, outer_momentum=0.5, outer="nesterov")
    theta = T([10.0])
    server = async_localsgd.ALGORITHM.server_state(theta, hp, 1)
    x = theta.clone()
    state = async_localsgd.ALGORITHM.init_state(x, hp)
    i = 0
    for grads, delta, v, expected in [((1.0, 2.0), 3.5, 3.5, 7.375), ((0.0, 0.0), 1.875, 3.625, 5.53125)]:
        for g in grads:
            i += 1
            c = step(async_localsgd, state, x, T([g]), theta, hp, i, server)
        assert close(c.delta, [delta])
        async_localsgd.ALGORITHM.server_rule(at(theta, server), c, hp)
        assert close(server["v"], [v]) and close(theta, [expected])
        x.copy_(theta)  # the pull
    assert close(state["m"], [-0.625])


def test_async_localsgd_delayed_nesterov_by_hand():
    # N = 3, η_o = 0.5, μ_o = 0.5; pseudo-gradients Δ = 3, 6, 9, then 3. Commits 1, 2: θ −= η_o·Δ/N, no momentum:
    # θ = 10 − 0.5, then − 1 = 8.5. Commit 3 (t = 3, a multiple of N): θ −= 0.5·9/3 = 1.5 → 7; v = 0.5·0 + 18/3 = 6;
    # θ −= η_o·μ_o·v = 1.5 → 5.5; the buffer empties. Commit 4: θ −= 0.5·3/3 → 5.0, v stays 6, buffer 3.
    hp = async_localsgd.Params(outer_lr=0.5, outer_momentum=0.5, nesterov_every=3)
    theta = T([10.0])
    server = async_localsgd.ALGORITHM.server_state(theta, hp, 2)
    for t, (delta, v, buffer, expected) in enumerate(
        [(3.0, 0.0, 3.0, 9.5), (6.0, 0.0, 9.0, 8.5), (9.0, 6.0, 0.0, 5.5), (3.0, 6.0, 3.0, 5.0)]
    ):
        async_localsgd.ALGORITHM.server_rule(at(theta, server, t=t), algorithms.Commit(delta=T([delta])), hp)
        assert close(theta, [expected]) and close(server["v"], [v]) and close(server["buffer"], [buffer]), t


def test_delayed_nesterov_defaults_to_one_momentum_step_per_n_commits():
    assert async_localsgd.delay(async_localsgd.Params(workers=7)) == 7  # Liu et al.: N = the number of workers
    assert async_localsgd.delay(async_localsgd.Params(workers=7, nesterov_every=2)) == 2
    assert async_localsgd.delay(async_localsgd.Params(workers=7, outer="nesterov")) == 1


def test_delayed_nesterov_with_n_1_is_nesterov_on_every_commit_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(1000, generator=g)
    deltas = [torch.randn(1000, generator=g) * 0.1 for _ in range(20)]
    out = []
    for hp in (async_localsgd.Params(nesterov_every=1, workers=4), async_localsgd.Params(outer="nesterov")):
        theta = theta0.clone()
        server = async_localsgd.ALGORITHM.server_state(theta, hp, 4)
        for t, d in enumerate(deltas):
            async_localsgd.ALGORITHM.server_rule(at(theta, server, t=t), algorithms.Commit(delta=d.clone()), hp)
        out.append((theta, server["v"]))
    theta, v = theta0.clone(), torch.zeros(1000)  # the outer step as it was before delayed Nesterov
    for d in deltas:
        v.mul_(0.9).add_(d)
        theta.add_(d, alpha=-0.7).add_(v, alpha=-0.7 * 0.9)
    out.append((theta, v))
    # and all are torch.optim.SGD(nesterov=True) on the pseudo-gradients, as DiLoCo's outer step
    p = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for d in deltas:
        p.grad = d.clone()
        opt.step()
    for theta, v in out[1:]:
        assert torch.equal(out[0][0], theta) and torch.equal(out[0][1], v)
    assert torch.allclose(out[0][0], p.detach(), atol=1e-5, rtol=0)  # to rounding: torch adds η_o(Δ + μ_o v) at once


# ------------------------------------------------------------------------------------ sgd and the set


def test_sgd_rule():
    hp = sgd.Params(lr=0.1, momentum=0.5)
    theta = torch.zeros(1)
    state = sgd.ALGORITHM.init_state(theta, hp)
    for expected in (-0.1, -0.25):  # m = −0.1, then 0.5·(−0.1) − 0.1
        c = commit(sgd, state, theta.clone(), T([1.0]), theta, hp)
        sgd.ALGORITHM.server_rule(at(theta), c, hp)
        assert close(theta, [expected])


# ------------------------------------------------------------------------- delay-adaptive, Ringmaster, Rennala


@pytest.mark.parametrize(
    "rule, tau, share",
    [
        ("mishchenko", 0, 1.0),
        ("mishchenko", 4, 1.0),  # τ ≤ τ_C = n = 4: the whole step
        ("mishchenko", 8, 0.5),  # τ_C/τ = 4/8
        ("koloskova", 4, 1.0),
        ("koloskova", 8, 0.125),  # 1/τ
    ],
)
def test_delay_adaptive_scales_a_commit_by_its_delay_beyond_the_concurrency(rule, tau, share):
    hp = delay_adaptive.Params(lr=0.5, workers=4, rule=rule)
    theta = T([1.0, 1.0])
    c = delay_adaptive.ALGORITHM.worker_rule({}, theta.clone(), T([2.0, -4.0]), at(theta, staleness=tau), hp)
    assert close(c.delta, [-1.0, 2.0]) and c.metrics == {"step_share": share}  # −ηg
    delay_adaptive.ALGORITHM.server_rule(at(theta, staleness=tau), c, hp)
    assert close(theta, [1.0 - share, 1.0 + 2.0 * share])


def test_delay_adaptive_concurrency_can_be_set():
    assert delay_adaptive.factor(6, delay_adaptive.Params(workers=10, tau_c=3)) == 0.5


def replay(module, hp, commits, workers=2):
    """Commits of (worker, g) on θ = [0], η = 1, each worker pulling after its commit as every engine does;
    returns θ after each commit and the commits' metrics."""
    theta = T([0.0])
    server = module.ALGORITHM.server_state(theta, hp, workers)
    thetas, metrics = [], []
    for t, (w, g) in enumerate(commits):
        view = at(theta, server, t=t, worker=w)
        c = module.ALGORITHM.worker_rule({}, theta.clone(), T([g]), view, hp)
        module.ALGORITHM.server_rule(at(theta, server, t=t, worker=w), c, hp)
        thetas.append(theta.item())
        metrics.append(c.metrics)
    return thetas, metrics


def test_ringmaster_drops_a_commit_whose_delay_has_reached_r():
    # R = 2. Worker 0 commits three times while worker 1 computes: its delay counts the 3 updates applied since
    # its pull (k 0 -> 3), so its commit is dropped and θ stays; it pulls then, and its next commit is applied.
    hp = ringmaster.Params(lr=1.0, workers=2, threshold=2)
    thetas, metrics = replay(ringmaster, hp, [(0, 1.0), (0, 1.0), (0, 1.0), (1, 5.0), (1, 2.0)])
    assert thetas == [-1.0, -2.0, -3.0, -3.0, -5.0]
    assert [m["delay"] for m in metrics] == [0, 0, 0, 3, 0]
    assert [m["dropped"] for m in metrics] == [0, 0, 0, 1, 0]


def test_ringmaster_counts_only_the_updates_it_applied():
    # R = 2: worker 1's commit at delay 2 is dropped (no update), so worker 0, which pulled before it, is at delay
    # 1 when it commits next, not 2, and is applied; with gem's clock τ it would be 2, and dropped.
    hp = ringmaster.Params(lr=1.0, workers=3, threshold=2)
    thetas, metrics = replay(ringmaster, hp, [(2, 1.0), (0, 1.0), (2, 1.0), (1, 1.0), (0, 1.0)], workers=3)
    assert [m["delay"] for m in metrics] == [0, 1, 1, 3, 1]
    assert [m["dropped"] for m in metrics] == [0, 0, 0, 1, 0]
    assert thetas == [-1.0, -2.0, -3.0, -3.0, -4.0]


def test_ringmaster_threshold_defaults_to_the_workers():
    assert ringmaster.Params(workers=7).R == 7 and ringmaster.Params(workers=7, threshold=3).R == 3


def test_rennala_steps_with_the_mean_of_s_gradients_of_the_current_point():
    # S = 2. Worker 0's gradient 1 and worker 1's 3 are of point 0: θ ← 0 − (1 + 3)/2 = −2, point 1. Worker 0's
    # next was taken at point 0 (it pulled before the step): dropped. Then 2 and 4, of point 1: θ ← −2 − 3 = −5.
    hp = rennala.Params(lr=1.0, workers=2, batch=2)
    thetas, metrics = replay(rennala, hp, [(0, 1.0), (1, 3.0), (0, 7.0), (0, 2.0), (1, 4.0)])
    assert thetas == [0.0, -2.0, -2.0, -2.0, -5.0]
    assert [m["dropped"] for m in metrics] == [0, 0, 1, 0, 0]
    assert [m["delay"] for m in metrics] == [0, 0, 1, 0, 0]


def test_rennala_lets_a_fast_worker_fill_the_batch():
    # S = 2, one fast worker: its two gradients of point 0 make the step; the slow one's, of point 0, is dropped.
    hp = rennala.Params(lr=1.0, workers=2, batch=2)
    thetas, metrics = replay(rennala, hp, [(0, 2.0), (0, 4.0), (1, 9.0)])
    assert thetas == [0.0, -3.0, -3.0] and [m["dropped"] for m in metrics] == [0, 0, 1]


@pytest.mark.parametrize("name", algorithms.ALGORITHMS)
def test_every_algorithm_has_its_record_and_yaml(name):
    algo = algorithms.get(name)
    assert isinstance(algo, algorithms.Algorithm) and algo.name == name
    for fn in ("init_state", "worker_rule", "server_rule", "commit_every"):
        assert callable(getattr(algo, fn)), f"{name}.{fn}"
    hp = algo.Params()  # defaults are valid
    assert hp.lr > 0 and 0 <= hp.momentum < 1
    window = algo.commit_every(hp)
    assert window >= 1 and (window == 1 or algo.local_step is not None)  # a window needs its local steps
    state = algo.init_state(torch.zeros(4), hp)
    assert all(isinstance(v, torch.Tensor) for v in state.values()), "worker state holds tensors only"
    assert (CONF_DIR / "algorithm" / f"{name}.yaml").exists()


@pytest.mark.parametrize(
    "module, key, value, message",
    [
        (gem, "kappa", 0.0, "algorithm.kappa=0.0 is not allowed; kappa must be a number > 0"),
        (gem, "pi_max", -1.0, "algorithm.pi_max=-1.0 is not allowed"),
        (gem, "proxy", "both", "algorithm.proxy=both is not allowed; proxy must be one of: local, global"),
        (gem, "eps", math.inf, "algorithm.eps=inf is not allowed"),
        (downpour, "window", 0, "algorithm.window=0 is not allowed; window must be an integer >= 1"),
        (agn, "local_momentum", 1.0, "algorithm.local_momentum=1.0 is not allowed; local_momentum must be a number in"),
        (easgd, "alpha", 1.5, "algorithm.alpha=1.5 is not allowed; alpha must be a number in (0, 1]"),
        (dcasgd, "dc_lambda", -1.0, "algorithm.dc_lambda=-1.0 is not allowed; dc_lambda must be a number >= 0"),
        (async_localsgd, "outer_momentum", 1.0, "algorithm.outer_momentum=1.0 is not allowed"),
        (async_localsgd, "outer_lr", 0.0, "algorithm.outer_lr=0.0 is not allowed; outer_lr must be a number > 0"),
        (
            delay_adaptive,
            "rule",
            "sqrt",
            "algorithm.rule=sqrt is not allowed; rule must be one of: mishchenko, koloskova",
        ),
        (ringmaster, "threshold", 0, "algorithm.threshold=0 is not allowed; threshold must be an integer >= 1"),
        (rennala, "batch", 1.5, "algorithm.batch=1.5 is not allowed; batch must be an integer >= 1"),
        # a bool is not a count (True passed as 1); one check for every knob that defaults to n
        (async_localsgd, "nesterov_every", True, "algorithm.nesterov_every=True is not allowed; nesterov_every must"),
        (delay_adaptive, "tau_c", True, "algorithm.tau_c=True is not allowed; tau_c must be an integer >= 1"),
    ],
)
def test_bad_hyperparameters_get_one_line(module, key, value, message):
    with pytest.raises(ValueError) as e:
        module.Params(**{key: value})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "zero_frac, top_frac, size",
    [
        (0.0, 0.0, 1001),
        (0.3, 0.3, 1000),
        (0.6, 0.1, 999),
        (0.1, 0.6, 1000),
        (1.0, 0.0, 10),
        (0.0, 1.0, 11),
        (0.5, 0.0, 1000),
        (0.0, 0.5, 1000),
    ],
)
def test_pi_median_is_torch_lower_median_with_ties_at_the_clamps(zero_frac, top_frac, size):
    g = torch.Generator().manual_seed(size)
    u = torch.rand(size, generator=g)
    pi = torch.rand(size, generator=g) * 5
    pi[u < zero_frac] = 0.0
    pi[u > 1 - top_frac] = 5.0
    layout = [("a", slice(0, size // 3)), ("b", slice(size // 3, size))]
    metrics, tensors = gem.pi_stats(pi, layout, 5.0)
    assert metrics["pi_median"] == pi.median().item()
    assert tensors["pi_median"] == [pi[sl].median().item() for _, sl in layout]
    assert metrics["pi_zero_frac"] == pytest.approx(float((pi == 0).float().mean()))
    torch_metrics, torch_tensors = gem._pi_stats_torch(pi, layout, 5.0)  # the GPU path, run on CPU here
    assert torch_metrics == pytest.approx(metrics)
    for key, values in tensors.items():
        assert torch_tensors[key] == pytest.approx(values), key


MNIST_CNN_SIZES = [250, 10, 5000, 20, 96000, 300, 60000, 200, 2000, 10]  # the paper CNN's parameter tensors


@pytest.mark.parametrize("sizes", [MNIST_CNN_SIZES, [7] * 40 + [3000, 2900], [1, 1, 1, 500], [64] * 16])
@pytest.mark.parametrize(
    "zero_frac, top_frac", [(0.0, 0.0), (0.45, 0.08), (0.49, 0.49), (0.1, 0.6), (0.7, 0.0), (0.0, 0.7), (0.3, 0.0)]
)
def test_the_overall_median_built_from_the_parts_is_torchs(sizes, zero_frac, top_frac):
    """The medians come from one copy of the values between the clamps, selected in place tensor by tensor and
    then as a whole: they must be torch's lower medians exactly, whatever the layout and the clamps; the other
    overall numbers must agree, with a layout that covers all of π or leaves its end out."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        n = sum(sizes)
        pi = torch.rand(n, generator=g) * torch.rand(len(sizes), generator=g).repeat_interleave(torch.tensor(sizes)) * 5
        u = torch.rand(n, generator=g)
        pi[u < zero_frac] = 0.0
        pi[u > 1 - top_frac] = 5.0
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        layout = [(str(i), slice(a, b)) for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
        metrics, tensors = gem.pi_stats(pi, layout, 5.0)
        assert metrics["pi_median"] == pi.median().item(), (seed, metrics["pi_median"], pi.median().item())
        assert tensors["pi_median"] == [pi[sl].median().item() for _, sl in layout]
        assert metrics["pi_mean"] == pytest.approx(pi.double().mean().item(), rel=1e-5)
        assert metrics["pi_zero_frac"] == pytest.approx(float((pi == 0).double().mean()))
        assert metrics["pi_max_frac"] == pytest.approx(float((pi == 5.0).double().mean()))
        partial, partial_tensors = gem.pi_stats(pi, layout[:-1], 5.0)  # a layout that leaves some of π out
        assert partial["pi_median"] == pi.median().item()
        assert partial_tensors["pi_mean"] == pytest.approx([pi[sl].double().mean().item() for _, sl in layout[:-1]])


def _gem_inputs(seed, sizes, scale_drift):
    """A commit's inputs on the scales of a real run: |θ − s| against κ|m| puts π at 0, between the clamps and at
    π_max in proportions that change with `scale_drift`."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    grad = torch.randn(n, generator=g) * 0.01
    m = torch.randn(n, generator=g) * 0.003
    stale = torch.randn(n, generator=g) * 0.1
    theta = stale + torch.randn(n, generator=g) * 0.003 * scale_drift
    grad[::97] = 0.0  # |Δθ| + ε = ε: π at π_max or 0
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    layout = [(str(i), slice(a, b)) for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    return grad, m, stale, theta, layout


@pytest.mark.parametrize(
    "hp",
    [gem.Params(), gem.Params(kappa=2.0), gem.Params(kappa=1.5, pi_max=2.3), gem.Params(proxy="global", workers=4)],
    ids=["default", "kappa", "pi_max", "global"],
)
@pytest.mark.parametrize("scale_drift", [0.3, 1.0, 4.0])
def test_gem_fused_loops_compute_what_the_torch_operations_compute(monkeypatch, hp, scale_drift):
    """On CPU, GEM's commit and statistics run as fused loops (numba): m, s, θ, the commit πΔθ, π itself, π's
    statistics over all elements and per tensor must be bit for bit those of the torch operations (gem.FUSED =
    False). The two energies are exact sums there (float64), where torch's float32 dot products are off by float32
    rounding."""
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(gem, "FUSED", fused)
        grad, m, stale, theta, layout = _gem_inputs(0, MNIST_CNN_SIZES, scale_drift)
        state = {"m": m, "stale": stale}
        server = (
            {"proxy": m * 0.7, "proxy_commits": torch.zeros((), dtype=torch.long)} if hp.proxy == "global" else None
        )
        c = commit(gem, state, theta.clone(), grad, theta, hp, server, layout)
        proxy = (server["proxy"] if server else state["m"]).double().clone()
        gem.server_rule(at(theta, server), c, hp)
        out[fused] = ([state["m"], state["stale"], theta, c.delta.clone(), c.aux["pi"].clone()], c.metrics, c.tensors)
    (a, am, at_), (b, bm, bt) = out[True], out[False]
    for x, y, name in zip(a, b, ["m", "s", "theta", "delta", "pi"], strict=True):
        assert torch.equal(x, y), name
    energies = ("proxy_energy", "central_energy")
    assert {k: v for k, v in am.items() if k not in energies} == {k: v for k, v in bm.items() if k not in energies}
    assert at_ == bt
    # the energies: the loop sums in float64, torch's dot products in float32, off by up to a few 1e-6 relative
    moved = c.aux["central"].double()  # θ − s + πΔθ, from the torch path's diagnostics
    exact = {
        "proxy_energy": 0.5 * hp.kappa**2 * float(proxy.dot(proxy)),
        "central_energy": 0.5 * float(moved.dot(moved)),
    }
    for k in energies:
        assert am[k] == pytest.approx(exact[k], rel=1e-12) and bm[k] == pytest.approx(exact[k], rel=1e-5), k
    assert 0 < am["pi_zero_frac"] < 1 and 0 < am["pi_max_frac"] < 1  # every branch of the clamp was taken


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.0])
def test_gem_fused_statistics_leave_a_nan_or_a_sign_to_numpy(bad):
    pi = torch.rand(1000) * 5
    pi[10] = bad
    layout = [("a", slice(0, 400)), ("b", slice(400, 1000))]
    assert gem._pi_stats_fused(pi.numpy(), layout, 5.0) is None  # the numpy code decides, as before
    metrics, _ = gem.pi_stats(pi, layout, 5.0)
    assert metrics["pi_zero_frac"] == (0.001 if bad == 0 else 0.0)


def test_dylu_sets_each_workers_window_from_its_pace_against_the_fastest():
    # H = 8; paces known at the server: worker 0 at 4 steps per unit, worker 2 at 1. Worker 1 measured 2 now:
    # ⌊8·2/4⌋ = 4. Worker 2 at 1: ⌊8/4⌋ = 2. Worker 0, the fastest: 8. Unknown pace: H. Never below 1.
    hp = async_localsgd.Params(window=8, dynamic_window=True, workers=3)
    server = async_localsgd.ALGORITHM.server_state(torch.zeros(2), hp, 3)
    server["pace"].copy_(T([4.0, 0.0, 1.0]))

    def view(worker, pace):
        return View(torch.zeros(2), server, 0, 0, worker, window=8, pace=pace)

    assert async_localsgd.next_window(view(1, 2.0), hp) == 4
    assert async_localsgd.next_window(view(2, 0.0), hp) == 2  # its pace as the server last noted it
    assert async_localsgd.next_window(view(0, 4.0), hp) == 8
    assert async_localsgd.next_window(view(1, 0.0), hp) == 8  # not known yet: H
    assert async_localsgd.next_window(view(2, 0.1), hp) == 1  # ⌊0.2⌋ = 0 would never commit: at least 1
    assert async_localsgd.next_window(view(0, 8.0), hp) == 8  # faster than any noted: it is the fastest


def test_dylu_commit_carries_its_pace_and_the_server_notes_it():
    hp = async_localsgd.Params(window=4, dynamic_window=True, workers=2, outer_lr=1.0, outer="nesterov")
    theta = torch.zeros(2)
    server = async_localsgd.ALGORITHM.server_state(theta, hp, 2)
    state = async_localsgd.ALGORITHM.init_state(theta, hp)
    v = View(theta, server, 0, 0, 1, window=1, pace=0.5)  # a window of 1: no local step began it
    c = async_localsgd.ALGORITHM.worker_rule(state, theta.clone(), T([1.0, 2.0]), v, hp)
    assert close(c.delta, [0.05, 0.1]) and c.window == 4 and c.metrics == {"window": 1, "pace": 0.5}
    async_localsgd.ALGORITHM.server_rule(View(theta, server, 0, 0, 1), c, hp)
    assert server["pace"].tolist() == [0.0, 0.5]


@pytest.mark.parametrize(
    "name, extra",
    [(n, {}) for n in algorithms.ALGORITHMS]
    + [("async_localsgd", {"dynamic_window": True}), ("gem", {"proxy": "global"})],
)
def test_a_rule_that_says_it_reads_nothing_central_commits_the_same_on_any_theta(name, extra):
    """`reads_central` False lets engine=distributed run the worker rule without the live θ (full duplex): the rule
    must then make the same commit, state and x whatever θ and the server's tensors hold (here: NaNs, and other
    counts). A rule that reads them must say so (the default). One that declares the server's tensors it reads, and
    no θ (`reads_server`: GO carries those), makes the same commit whatever θ and the others hold."""
    algo = algorithms.get(name)
    fields = {f.name for f in dataclasses.fields(algo.Params)}
    hp = algo.Params(**{k: v for k, v in {"lr": 0.1, "workers": 2, **extra}.items() if k in fields})
    torch.manual_seed(0)
    theta, grad = torch.randn(6), torch.randn(6)

    declared = algo.reads_server if algo.reads_central(hp) else ()  # the server's tensors GO would carry

    def run(central: torch.Tensor, count: int):
        x, state = theta.clone(), algo.init_state(theta, hp)
        for v in state.values():
            v.add_(torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(v.dtype))
        server = algo.server_state(central.clone(), hp, 2)
        for i, (k, v) in enumerate(server.items()):  # (counters that differ from one another: a delay is not 0)
            if k in (declared or ()):  # as GO would send them: the same in both runs (DyLU's paces above its own)
                v.copy_(theta[0].abs() + 2 if v.is_floating_point() else i + 1)
            else:  # (a float: NaN in one run, above the declared ones in the other, so that a max reads it)
                v.copy_(central[0] + 10 * count if v.is_floating_point() else count * (i + 1))
        if algo.prepare is not None:
            algo.prepare(state, x, grad, hp)
        view = View(central.clone(), server, 3, 1, 0, window=algo.commit_every(hp), pace=2.0)
        c = algo.worker_rule(state, x, grad, view, hp)
        return c, x, state

    same, other = run(theta.clone(), 1), run(torch.full_like(theta, math.nan), 7)
    if algo.reads_central(hp) and declared is None:
        return  # the rule may read θ: engine=distributed serves its commits as one exchange each
    (c1, x1, s1), (c2, x2, s2) = same, other
    assert torch.equal(c1.delta, c2.delta) and torch.equal(x1, x2)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert (c1.pull, c1.pull_at, c1.window, c1.metrics) == (c2.pull, c2.pull_at, c2.window, c2.metrics)
    assert c1.payload.keys() == c2.payload.keys() and all(torch.equal(c1.payload[k], c2.payload[k]) for k in c1.payload)


def test_the_rules_that_read_the_live_theta_say_so():
    """GEM's θ − s, EASGD's and EAMSGD's elastic term, the global proxy, ringmaster's and rennala's delays and DyLU's
    paces are read from the live θ or the server's tensors (docs/design.md)."""
    reads = {n for n in algorithms.ALGORITHMS if algorithms.get(n).reads_central(algorithms.get(n).Params())}
    assert reads == {"gem", "easgd", "eamsgd", "ringmaster", "rennala"}
    assert async_localsgd.ALGORITHM.reads_central(async_localsgd.Params(dynamic_window=True))
    # of them, those that read no θ name the server's tensors they read, which GO carries over the wire
    declared = {n: algorithms.get(n).reads_server for n in algorithms.ALGORITHMS if algorithms.get(n).reads_server}
    assert declared == {
        "ringmaster": ("applied", "pulled"),
        "rennala": ("point", "pulled"),
        "async_localsgd": ("pace",),
    }
    for name, names in declared.items():  # tensors the server has (rank 0 sends them by name), of a few numbers
        algo = algorithms.get(name)
        hp = algo.Params(workers=2, **({"dynamic_window": True} if name == "async_localsgd" else {}))
        server = algo.server_state(torch.zeros(1000), hp, 2)
        assert set(names) <= set(server) and all(server[k].numel() <= 2 for k in names), (name, list(server))


def test_a_record_made_from_another_with_a_rule_of_its_own_reads_the_live_theta_unless_it_says_so():
    """The claim is the worker rule's: `dataclasses.replace(downpour.ALGORITHM, worker_rule=...)` does not carry
    DOWNPOUR's to a rule that may read θ (EAMSGD's own rule is EASGD's record's), and adaptive keeps DOWNPOUR's rule
    and its claim."""

    def rule(state, x, grad, view, hp):
        return downpour.worker_rule(state, x, grad, view, hp)

    hp = downpour.Params()
    assert not downpour.ALGORITHM.reads_central(hp) and not adaptive.ALGORITHM.reads_central(hp)
    assert dataclasses.replace(downpour.ALGORITHM, worker_rule=rule).reads_central(hp)
    assert not dataclasses.replace(
        downpour.ALGORITHM, worker_rule=algorithms.reads_nothing_central(rule)
    ).reads_central(hp)


def _declared(name: str, extra: dict):
    algo = algorithms.get(name)
    fields = {f.name for f in dataclasses.fields(algo.Params)}
    hp = algo.Params(**{k: v for k, v in {"lr": 0.1, "workers": 2, **extra}.items() if k in fields})
    return algo, hp


@pytest.mark.parametrize(
    "name, extra", [(n, {}) for n in algorithms.ALGORITHMS] + [("gem", {"proxy": "global"}), ("gem", {"kappa": 2.0})]
)
def test_a_rule_run_at_the_server_makes_the_commit_it_makes_at_the_worker(name, extra):
    """`at_server` lets engine=distributed run the part of a worker rule that reads θ where θ lives: the worker
    sends what the part declares, the server runs it on the worker's tensors it keeps and the live θ, and the
    worker finishes a commit that does not pull with its delta. Over several commits of two workers, with the
    server rule between them, that must make every commit, payload, metric and per-tensor statistic, every worker
    state and every θ that the rule run at the worker makes, bit for bit."""
    algo, hp = _declared(name, extra)
    part = algo.at_server
    if part is None:
        return  # the rule runs at the worker only
    torch.manual_seed(0)
    theta0, layout = torch.randn(1000), [("a", slice(0, 600)), ("b", slice(600, 1000))]
    grads = [torch.randn(1000) for _ in range(6)]
    sides = {}
    for where in ("worker", "server"):
        theta, server = theta0.clone(), algo.server_state(theta0.clone(), hp, 2)
        workers = [(theta0.clone(), algo.init_state(theta0, hp)) for _ in range(2)]
        out = []
        for i, grad in enumerate(grads):
            x, state = workers[i % 2]
            view = View(theta, server, i, 1, i % 2)
            if where == "worker":
                if algo.prepare is not None:
                    algo.prepare(state, x, grad, hp)
                c = algo.worker_rule(state, x, grad, view, hp)
            else:
                kept = {k: state[k] for k in part.keeps}
                mine = {k: v for k, v in state.items() if k not in part.keeps}
                sent = {k: v.clone() for k, v in part.sends(mine, x, grad, hp).items()}
                c = part.rule(kept, sent, view, hp)
            metrics, tensors = algo.diagnostics(c, layout, hp) if algo.diagnostics is not None else ({}, None)
            algo.server_rule(view, c, hp)
            if c.pull:
                x.copy_(theta)
            elif where == "server":
                part.finish(mine, x, grad, c.delta.clone(), hp)
            out.append((c.delta.clone(), c.pull, {k: v.clone() for k, v in c.payload.items()}, c.metrics, metrics))
            out[-1] += (tensors, theta.clone(), [x.clone() for x, _ in workers])
            out[-1] += ([{k: v.clone() for k, v in s.items()} for _, s in workers],)
        sides[where] = out
    for at_worker, at_server in zip(sides["worker"], sides["server"], strict=True):
        for a, b in zip(at_worker, at_server, strict=True):
            assert _same(a, b), (a, b)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b, strict=True))
    return a == b


def test_the_rules_that_run_their_part_that_reads_theta_at_the_server_say_so():
    """GEM declares its whole rule at the server, on m and s kept there, and EASGD its elastic term (docs/design.md,
    "Full duplex over the wire"); the claim is the worker rule's, so a record made with another rule drops it:
    EAMSGD's own rule is EASGD's record's, and runs at the worker."""
    declared = {n for n in algorithms.ALGORITHMS if algorithms.get(n).at_server is not None}
    assert declared == {"gem", "easgd"}
    assert gem.ALGORITHM.at_server.keeps == ("m", "stale") and easgd.ALGORITHM.at_server.keeps == ()
    assert eamsgd.ALGORITHM.at_server is None

    def rule(state, x, grad, view, hp):
        return gem.worker_rule(state, x, grad, view, hp)

    assert dataclasses.replace(gem.ALGORITHM, worker_rule=rule).at_server is None
