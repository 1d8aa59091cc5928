"""Staleness-aware SGD (DynSGD, Jiang et al. 2017): DOWNPOUR's workers, and a server that divides each commit
by its staleness plus one (docs/design.md, "Algorithms"): θ ← θ + Δ/(τ + 1).

τ is measured by the parameter server on its own clock, so the scaling uses the true number of commits the
worker missed. With n equally fast workers τ = n − 1, so each commit counts 1/n: the group moves about as far
per cycle as one worker would, which is stable but slow.
"""

from __future__ import annotations

from dataclasses import replace

from gem.algorithms import Commit, View, downpour

Params = downpour.Params  # the same keys and defaults: window 1, local_momentum 0


def server_rule(view: View, commit: Commit, hp: Params) -> None:
    view.theta.add_(commit.delta, alpha=1.0 / (view.staleness + 1))


ALGORITHM = replace(downpour.ALGORITHM, name="adaptive", server_rule=server_rule)
