"""Asynchronous optimisers as explicit records of small pure functions (docs/design.md, "Algorithms").

Each algorithm module ends with one `Algorithm` record, in the spirit of optax's `GradientTransformation`:

- ``Params``: a frozen dataclass of its hyperparameters. It always has ``lr`` and ``momentum``, filled from the
  top-level config keys (and ``workers``, if it declares that field), and the keys of its
  ``conf/algorithm/<name>.yaml``. ``__post_init__`` rejects bad values with one line (see ``require``).
- ``init_state(theta, hp) -> dict[str, Tensor]``: a worker's private state (momentum, accumulators, ...).
  Tensors only, so that every engine can checkpoint, send and restore it the same way.
- ``commit_every(hp) -> int``: the commit boundary λ. A worker commits after every λ-th local gradient, and
  only then takes the server's turn; λ = 1 for most algorithms. No engine reads ``hp`` itself.
- ``local_step(state, x, grad, hp, k)``: a gradient that does not end a window (k = 1..λ−1, its place in the
  window). It may move the worker's local parameters ``x`` in place. It never sees θ: it runs without the
  server's turn. None when λ is always 1.
- ``worker_rule(state, x, grad, view, hp) -> Commit``: the gradient that ends a window, run under the server's
  turn. ``view`` (a `View`) holds the live central variable θ and the server's tensors (read them, never keep a
  reference), the clock t, this commit's staleness τ and the worker's id. This runs before the server applies the
  worker's commit, so a copy of θ taken now is θ just before the worker's own commit, which is the reference
  GEM needs for θ − s (docs/design.md). Do here only what the commit needs: statistics go in ``diagnostics``.
- ``prepare(state, x, grad, hp)`` (optional): the part of a commit that does not read θ, run at the window's end
  just before the worker takes the turn (GEM: Δθ, its proxy's next value, π's numerator and denominator). It
  writes scratch buffers only, never ``state`` or ``x``: a checkpoint taken while the worker waits for the turn
  saves the state as it was before this gradient, and a resumed worker takes the gradient and prepare again.
  The worker rule follows, under the turn; the arithmetic is the same, only less of it holds the others up.
- ``server_rule(view, commit, hp)``: applies a commit to ``view.theta`` in place, with ``view.staleness`` (τ,
  measured by the server on its own clock) and ``view.worker`` (for state kept per worker at the server).
- ``init_server(theta, hp, workers) -> dict[str, Tensor]`` (optional): tensors the server keeps next to θ
  (GEM's global proxy). Only ``server_rule`` writes them; ``worker_rule`` reads them as ``view.server``.
- ``payload(theta, hp) -> dict[str, Tensor]`` (optional): tensors of the names, dtypes and shapes of every
  commit's ``payload`` (θ itself may stand for one shaped like it); None: commits carry none. engine=distributed
  accepts from a worker only a payload of exactly these, so an algorithm whose commits carry one must declare it.
- ``diagnostics(commit, layout, hp) -> (metrics, tensors)`` (optional): per-commit statistics, computed by the
  worker after it has handed the turn on, from the tensors the worker rule left in ``commit.aux``. ``layout``
  lists the model's parameter tensors as ``(name, slice)`` pairs into the flat vectors; ``tensors`` holds one list
  per statistic with one value per parameter tensor, in layout order (GEM's π heatmaps).
- ``sequential``: True for the proxy, momentum SGD: it always runs with one worker.
- ``barriers``: True where commits set ``pull_at`` (synchronous SGD's rounds, below): the workers wait for the
  server's clock, so the server is one clock (engine=distributed runs it on one server, not sharded).
- ``reads_central(hp) -> bool`` (a method): whether ``worker_rule`` reads the live central variable or the server's
  tensors (``view.theta``, ``view.server``). True unless the rule itself says otherwise (the decorators
  ``reads_nothing_central`` and ``reads_central_when``: a record made with ``dataclasses.replace`` and another
  worker rule drops the claim with the rule), since only then is every rule computed as written. engine=distributed
  over the wire serves such a commit as one exchange: θ goes to the worker, its rule runs, its commit comes back,
  and only then does the next exchange begin. False (the rule reads the worker's own state, x and the gradient,
  and of the view at most t, τ and the worker's id, which the server sends before the rule runs) lets the server
  send θ to one worker while another's commit arrives (full duplex, docs/design.md); tests/test_algorithms.py
  checks each False by running the rule on a θ of NaNs.
- ``at_server`` (a property): for a rule that reads the live θ, the part of it that can run where θ lives instead
  (an `AtServer`, declared with the decorator ``runs_at_server`` on ``worker_rule``, so that a record made with
  another worker rule drops it, as it drops ``reads_central``); None: the rule runs only at the worker.
  engine=distributed over the wire then serves its commits in full duplex too: the worker sends what the part
  declares, the server runs it under its clock on the worker's state it keeps, and sends back θ (or the commit's
  delta, for a commit that does not pull). tests/test_algorithms.py checks that each declared part makes the
  commit, the state and the diagnostics of the rule run at the worker, bit for bit.
- ``reads_server`` (a property): for a rule that reads no θ but some of the server's tensors (small ones: Ringmaster's
  and Rennala's counters, DyLU's paces), their names, declared with the decorator ``reads_server`` on
  ``worker_rule`` (dropped with the rule, as above); None: undeclared. engine=distributed over the wire then sends
  them with GO, as they are when the commit is applied, and serves the commit in full duplex too;
  tests/test_algorithms.py checks each declaration by running the rule on a θ of NaNs and the other server tensors
  changed.

A commit may set ``window``, the length of the worker's next window (dynamic local updates): every engine's
worker cycle honours it, and the sim engine times the next cycle by it. The worker rule sees the window it ends
(``view.window``) and the worker's measured pace (``view.pace``: its local steps since its first commit, per unit
of its clock: the simulated clock on sim, the run's seconds elsewhere).

After a commit has been applied the worker pulls, copying θ into ``x``, unless the commit says ``pull=False``
(EASGD's workers keep their own variable). A commit may instead set ``pull_at``, a clock value: a barrier. The
worker then takes no further gradient until the server's clock has reached it, and pulls θ then (synchronous SGD:
the end of the round), whatever ``pull`` says. Every engine honours it the same way (gem.engines.worker). A
barrier that no commit can reach ends the run as failed rather than hanging: at once on sim and distributed, on
process once the waiting workers are lost as silent. Engines know nothing else about algorithms, so adding one takes a
module here, its name in ``ALGORITHMS``, a YAML file in conf/algorithm/ and a test. An algorithm outside this
package can be run by its import path: ``get("my_package.my_module")`` finds the module's ``ALGORITHM``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# every entry is a module gem.algorithms.<name> with an ALGORITHM record and a conf/algorithm/<name>.yaml
ALGORITHMS = (
    "sgd",
    "gem",
    "downpour",
    "adaptive",
    "agn",
    "easgd",
    "eamsgd",
    "ssgd",
    "dcasgd",
    "async_localsgd",
    "delay_adaptive",
    "ringmaster",
    "rennala",
)


@dataclass
class View:
    """What the worker rule and the server rule see at a commit, under the server's turn."""

    theta: torch.Tensor  # the live central variable (the server's own, or a worker's exact replica of it)
    server: dict[str, torch.Tensor]  # the algorithm's server tensors (init_server), in the same state as theta
    t: int  # the server's clock: commits applied before this one
    staleness: int  # τ: commits applied between this worker's last pull and this commit
    worker: int  # the committing worker's id, 0..n−1
    # set by the worker's cycle for its worker rule (the server rule gets neither):
    window: int | None = None  # the local gradients of the window this commit ends (None: commit_every's)
    pace: float = 0.0  # the worker's local steps per unit of its clock since its first commit (0: not yet measured)


@dataclass
class Commit:
    delta: torch.Tensor  # flat update; applied by server_rule before the worker's next gradient
    pull: bool = True  # copy θ into the worker's x once the commit is applied
    pull_at: int | None = None  # a barrier: pull only once the server's clock has reached this t (not before
    # the worker's next gradient); None or a t already reached: pull at once, as `pull` says
    window: int | None = None  # the local gradients of this worker's next window; None: as it was (dynamic
    # local updates, async_localsgd's `dynamic_window`)
    payload: dict[str, torch.Tensor] = field(default_factory=dict)  # extra tensors for server_rule only
    metrics: dict[str, float] = field(default_factory=dict)  # numbers that must be read under the turn
    aux: dict[str, torch.Tensor] = field(default_factory=dict)  # worker-private tensors for diagnostics


def _every_step(hp) -> int:
    return 1


def _reads(hp) -> bool:
    return True  # unless declared: the rule may read the live θ


def _never(hp) -> bool:
    return False


def _marking(name: str, value):
    """A decorator that notes `value` on a worker rule as `name`: what the rule says of itself travels with it (a
    record made with another rule drops it)."""

    def mark(rule: Callable) -> Callable:
        setattr(rule, name, value)
        return rule

    return mark


def reads_central_when(predicate: Callable):
    """Decorates a worker rule that reads the live θ or the server's tensors only where `predicate(hp)` is true
    (`Algorithm.reads_central`)."""
    return _marking("reads_central", predicate)


def reads_server(*names: str):
    """Decorates a worker rule that reads no θ, only the server's tensors `names` (small ones: counters, the
    workers' paces; `Algorithm.reads_server`): over the wire they go out with GO, as they are when the commit is
    applied, and θ comes back after it (full duplex)."""
    return _marking("reads_server", tuple(names))


def reads_nothing_central(rule: Callable) -> Callable:
    """Decorates a worker rule that reads neither θ nor the server's tensors (`Algorithm.reads_central`)."""
    return reads_central_when(_never)(rule)


@dataclass(frozen=True)
class AtServer:
    """The part of a worker rule that reads the live θ, run where θ lives (docs/design.md, "Full duplex over the
    wire"): a rule that reads θ_t must read the θ its commit is applied to, which over the wire exists only at the
    server once the commit before has been applied; run there, it needs no θ sent out first, and the link carries
    one model each way at once.

    - ``keeps``: the names of the worker-state tensors (``init_state``'s) that live at the server, one set per
      worker: the part reads and writes them there, and a checkpoint takes them from there into the worker's file.
    - ``sends(state, x, grad, hp) -> dict[str, Tensor]``: what the worker sends at its window's end, in place of a
      commit, of fixed names, dtypes and shapes (the server receives exactly these: nothing announces a size).
    - ``rule(kept, sent, view, hp) -> Commit``: at the server under its clock, with this worker's kept tensors and
      what it sent; ``view`` as the worker rule's, without the worker's window and pace. It sets neither
      ``window`` nor ``pull_at``. Its ``metrics`` and ``diagnostics`` are computed there and go back to the worker's
      row.
    - ``finish(state, x, grad, delta, hp)`` (a commit that does not pull): at the worker once its commit has been
      applied, with the commit's delta, which the server sends back in place of θ; None: every commit pulls θ.
    """

    keeps: tuple[str, ...]
    sends: Callable
    rule: Callable
    finish: Callable | None = None


def runs_at_server(part: AtServer):
    """Decorates a worker rule that reads the live θ with the part of it that can run where θ lives
    (`Algorithm.at_server`)."""
    return _marking("at_server", part)


@dataclass(frozen=True)
class Algorithm:
    name: str
    Params: type
    init_state: Callable
    worker_rule: Callable
    server_rule: Callable
    commit_every: Callable = _every_step
    local_step: Callable | None = None
    init_server: Callable | None = None
    payload: Callable | None = None
    prepare: Callable | None = None
    diagnostics: Callable | None = None
    # how each statistic of a commit's row made at the server (its metrics and diagnostics) adds up over slices of θ,
    # where θ is sharded (engine.servers; docs/design.md, "Sharded servers"): "sum" (an energy), "mean" (over the
    # elements: the slices' values weighted by their sizes), or "median" (exact only where one slice holds all
    # the elements, else NaN); None: the rule runs at no sharded server while it makes statistics
    over_slices: dict[str, str] | None = None
    sequential: bool = False
    barriers: bool = False  # its commits set pull_at: the workers wait for the one server's clock

    def reads_central(self, hp) -> bool:
        """Whether the worker rule reads the live θ or the server's tensors: as the rule says, else True."""
        return getattr(self.worker_rule, "reads_central", _reads)(hp)

    @property
    def reads_server(self) -> tuple[str, ...] | None:
        """The server's tensors the worker rule reads, where it reads them and no θ, as the rule declares them
        (`@reads_server`); None: undeclared (it may read θ)."""
        return getattr(self.worker_rule, "reads_server", None)

    @property
    def at_server(self) -> AtServer | None:
        """The part of the worker rule that reads θ, as the rule declares it to run at the server; None: none."""
        return getattr(self.worker_rule, "at_server", None)

    def server_state(self, theta: torch.Tensor, hp, workers: int) -> dict[str, torch.Tensor]:
        return self.init_server(theta, hp, workers) if self.init_server is not None else {}


def get(name: str) -> Algorithm:
    """The record of a built-in algorithm, or of a module given by its import path (``package.module``)."""
    if name in ALGORITHMS:
        return importlib.import_module(f"gem.algorithms.{name}").ALGORITHM
    if "." in name:
        try:
            record = getattr(importlib.import_module(name), "ALGORITHM", None)
        except ImportError as e:
            raise ValueError(f"algorithm={name} cannot be imported ({e})") from None
        if isinstance(record, Algorithm):
            return record
        raise ValueError(f"algorithm={name}: the module has no ALGORITHM record (gem.algorithms.Algorithm)")
    raise ValueError(f"algorithm={name} is not an algorithm; choose one of: {', '.join(ALGORITHMS)}")


def workers_that_run(name: str, requested: int) -> int:
    """The workers a run of algorithm `name` has: 1 for a sequential one (the proxy), else those requested. An
    algorithm that cannot be found is left to the validation that names it: `requested` here."""
    try:
        return 1 if get(name).sequential else int(requested)
    except ValueError:
        return int(requested)


def require(ok: bool, key: str, value, allowed: str) -> None:
    """For Params.__post_init__: one line naming the key and what is allowed."""
    if not ok:
        raise ValueError(f"algorithm.{key}={value} is not allowed; {key} must be {allowed}")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and 0 < x < math.inf


def require_count_or_workers(key: str, value) -> None:
    """For a knob that counts (τ_C, R, S, N) and defaults to n when null: an integer >= 1 (a bool is not one)."""
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    require(ok, key, value, "an integer >= 1, or null for the number of workers")


def or_workers(value: int | None, workers: int) -> int:
    """Such a knob's value: n, the number of workers, where it is null."""
    return value if value is not None else max(1, workers)


# Scratch buffers, one set per process and shape. A commit's delta and aux may live in them: every engine
# applies a commit and takes its diagnostics before any worker rule runs again in that process (sim: one commit
# at a time; process and distributed: one worker per process), so a buffer is never overwritten while still
# needed. Sharing them keeps the sim engine's memory at the workers' own state plus a constant, instead of a few
# model copies per worker.
_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(like: torch.Tensor, name: str) -> torch.Tensor:
    key = (name, like.shape, like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty_like(like)
    return buf
