"""Accumulated Gradient Normalisation (Hermans et al. 2017); docs/design.md, "Algorithms".

Each worker takes λ local SGD steps, like DOWNPOUR, and commits the accumulated difference divided
by λ: the average step of the window rather than its sum. The server adds it: θ ← θ + Δ/1. Fewer, smaller,
less noisy commits make the central variable robust to staleness. The authors recommend λ = 10–15.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gem.algorithms import Commit, View, downpour, reads_nothing_central


@dataclass(frozen=True)
class Params(downpour.Params):
    window: int = 10  # λ: local steps between commits, and the normaliser of the commit


@reads_nothing_central
def worker_rule(state, x, grad, view: View, hp: Params) -> Commit:
    return downpour.window_commit(state, grad, hp, normalise=True)


ALGORITHM = replace(downpour.ALGORITHM, name="agn", Params=Params, worker_rule=worker_rule)
