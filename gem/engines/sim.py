"""The `sim` engine: n virtual asynchronous workers in one process, deterministic for a seed.

Each virtual worker is the shared worker cycle (gem.engines.worker) with its own stale copy, algorithm state,
data stream and dropout stream; they share one model to compute gradients with. The order in which workers reach
the parameter server comes from a staleness model: every worker's cycle (its local steps up to a commit) takes a
simulated duration, and the worker whose cycle ends first commits next (an event queue).

- `round_robin`: every cycle takes 1, ties broken by worker index, so workers commit 0, 1, …, n−1, 0, …
  and τ = n − 1 exactly once the first n commits are done.
- `exponential`: cycle durations are Exp(1), as for workers with random compute times.
- `stragglers`: a fraction `straggler_fraction` of the workers take `straggler_slowdown` times longer.
- `gamma`: cycle durations are Gamma-distributed with mean 1 and coefficient of variation `cycle_cv`. The
  workers' phases start spread evenly over one cycle (worker w's first commit at w/n + its first duration), as
  a cluster's are once it has run a while; so CV = 0 is round robin's order and a small CV perturbs it. CV = 1
  is the exponential distribution.
- `trace`: the cycle times a real run recorded (`read_trace`), replayed per worker, then drawn from that
  worker's own recorded durations once they run out.

Durations are per local step: a cycle of k local steps (a window) takes k times one draw.

A cycle runs to its end, commit included, before the next starts: the server's turn is simply the next event.
A worker whose commit set a barrier (Commit.pull_at, synchronous SGD) is parked instead of queued: it pulls, and its
next cycle starts, when the commit that brings the clock to its barrier ends, so a round lasts as long as its
slowest cycle.
With one worker this is exactly sequential SGD. A checkpoint holds the event queue and the schedule's random
state with everything else, so a resumed run continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import heapq
import math

import torch

from gem import algorithms
from gem.engines import Job, Result
from gem.engines import checkpoint as ckpt
from gem.engines.coordinator import Coordinator, start_server
from gem.engines.core import Evaluator, build_flat_model
from gem.engines.options import STALENESS_MODELS, EngineOptions, SimOptions
from gem.engines.server import Server
from gem.engines.worker import Diverged, Worker


class TraceError(ValueError):
    """A run directory that cannot be replayed: one line naming it and why."""


def read_trace(run_dir) -> list[list[tuple[float, int]]]:
    """The asynchrony a real run (`process` or `distributed`) recorded: for each of its workers 0..m−1, the
    (time_s, worker_step) of its commits in order (empty for a worker that never committed). Lost commits (no
    row) are skipped."""
    import json
    from pathlib import Path

    from gem.metrics import read_table

    d = Path(run_dir)
    try:
        summary = json.loads((d / "summary.json").read_text())
    except FileNotFoundError:
        raise TraceError(f"engine.trace={run_dir} is not a run directory (no summary.json)") from None
    except (OSError, ValueError) as e:
        raise TraceError(f"engine.trace={run_dir}: its summary.json cannot be read ({e})") from None
    if summary.get("engine") == "sim":
        raise TraceError(
            f"engine.trace={run_dir} is a sim run; a trace replays the measured asynchrony of a "
            f"process or distributed run"
        )
    try:
        m = read_table(d)
    except (OSError, ValueError) as e:
        raise TraceError(f"engine.trace={run_dir}: its metrics cannot be read ({e})") from None
    if m.empty or not {"step", "worker", "worker_step", "time_s"} <= set(m.columns):
        raise TraceError(f"engine.trace={run_dir}: its metrics hold no commit rows")
    m = m[(m["worker"] >= 0) & m["time_s"].notna()].drop_duplicates("step").sort_values("step")
    workers = max(int(summary.get("workers") or 0), int(m["worker"].max()) + 1 if len(m) else 0)
    per = [[] for _ in range(workers)]
    for w, g in m.groupby("worker", sort=True):
        per[int(w)] = list(zip(g["time_s"].astype(float), g["worker_step"].astype(int), strict=True))
    if not any(len(c) >= 2 for c in per):
        raise TraceError(f"engine.trace={run_dir}: no worker of that run committed twice, so it holds no cycle time")
    gaps = [t1 - t0 for c in per for (t0, _), (t1, _) in zip(c, c[1:], strict=False)]
    if min(gaps) < 0 or sum(gaps) <= 0:
        raise TraceError(f"engine.trace={run_dir}: its commit times do not increase, so they are not cycle times")
    return per


class Schedule:
    """Simulated cycle durations for the staleness model; seeded, hence deterministic. `start(w, k)` is when
    worker w's first cycle of k local steps ends, `cycle(w, k)` how long its next one takes."""

    def __init__(
        self,
        model: str,
        n: int,
        seed: int,
        straggler_fraction: float = 0.25,
        straggler_slowdown: float = 4.0,
        cycle_cv: float = 0.0,
        trace=None,
    ):
        if model not in STALENESS_MODELS:
            raise ValueError(
                f"engine.staleness={model} is not a staleness model; choose one of: {', '.join(STALENESS_MODELS)}"
            )
        self.model, self.n, self.cv = model, n, float(cycle_cv)
        # gamma: shape k with scale 1/k has mean 1 and CV 1/sqrt(k)
        self.shape = torch.tensor([1.0 / self.cv**2 if self.cv > 0 else 0.0], dtype=torch.float64)
        self.rng = torch.Generator().manual_seed(seed + 99_991)
        self.slowdown = [1.0] * n
        if model == "stragglers":
            k = max(1, math.ceil(straggler_fraction * n)) if n > 1 else 0
            slow = torch.randperm(n, generator=self.rng)[:k].tolist()
            for w in slow:
                self.slowdown[w] = float(straggler_slowdown)
        self.used = [0] * n  # trace: recorded durations replayed so far, per worker
        if model == "trace":
            self._load_trace(trace)

    def _load_trace(self, trace) -> None:
        """Per recorded worker: its first commit's offset from the run's first commit, and the duration per
        local step of each later cycle, all in units of the run's mean duration per step (so that, as in the
        other models, a cycle of one step takes 1 on average). `trace` is what read_trace returns."""
        per_step = [[(t1 - t0) / max(1, s1 - s0) for (t0, s0), (t1, s1) in zip(c, c[1:], strict=False)] for c in trace]
        pooled = [d for ds in per_step for d in ds]
        unit = sum(pooled) / len(pooled)
        first = min(c[0][0] for c in trace if c)
        self.offsets = [(c[0][0] - first) / unit if c else 0.0 for c in trace]
        # a recorded worker that committed less than twice has no duration of its own: it draws from everyone's
        self.own = [bool(ds) for ds in per_step]
        self.recorded = [[d / unit for d in (ds or pooled)] for ds in per_step]

    def _draw(self, w: int) -> float:
        """One duration per local step for worker w."""
        if self.model == "exponential":
            return float(torch.empty(1).exponential_(1.0, generator=self.rng))
        if self.model == "gamma":
            if self.cv == 0:
                return 1.0
            # torch.distributions.Gamma takes no generator: its sampler, with the schedule's own
            return float(torch._standard_gamma(self.shape, generator=self.rng) / self.shape)
        if self.model == "trace":
            m = len(self.recorded)
            mine = self.recorded[w % m]
            if w < m and self.own[w] and self.used[w] < len(mine):  # the recorded durations, in order
                self.used[w] += 1
                return mine[self.used[w] - 1]
            return mine[int(torch.randint(len(mine), (1,), generator=self.rng))]  # then drawn from them
        return self.slowdown[w]

    def start(self, w: int, steps: int) -> float:
        if self.model == "gamma":
            return steps * (w / self.n + self._draw(w))
        if self.model == "trace" and w < len(self.recorded) and self.own[w]:
            # the recorded offset of its first commit, then one mean cycle: its later commits keep their
            # recorded spacing, so with as many workers as the run had, the sim commits in the run's order
            return self.offsets[w] + steps
        return steps * self._draw(w)

    def cycle(self, w: int, steps: int) -> float:
        if self.model in ("exponential", "gamma", "trace"):  # one draw per cycle: its spread whatever k is
            return steps * self._draw(w)  # (a trace's draw is one recorded cycle over its local steps)
        return steps * self.slowdown[w]

    def state_dict(self) -> dict:
        return {"schedule_rng": self.rng.get_state(), "trace_used": torch.tensor(self.used, dtype=torch.long)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.set_state(state["schedule_rng"])
        if "trace_used" in state:
            self.used = [int(u) for u in state["trace_used"]]


def describe(engine: EngineOptions) -> str:
    """The staleness model a run ran under, as the summary, reports and figures name it: `gamma (CV 0.25)`,
    `round_robin`, `stragglers (25% 4x slower)`, `trace (<run>)`; a real engine's is what its machine measured."""
    if not isinstance(engine, SimOptions):
        return f"measured ({engine.name})"
    if engine.staleness == "gamma":
        return f"gamma (CV {engine.cycle_cv:g})"
    if engine.staleness == "stragglers":
        return f"stragglers ({engine.straggler_fraction:.0%} {engine.straggler_slowdown:g}x slower)"
    if engine.staleness == "trace":
        return f"trace ({engine.trace})"
    return engine.staleness


class _Link:
    """The sim engine's server is right here: the turn is the current event, rows go straight to the ledger."""

    def __init__(self, server: Server, coord: Coordinator):
        self.server, self.coord = server, coord
        self.extra: dict = {}
        self.at = 0.0  # the simulated time the cycle being run ends at, with its commit

    def clock(self) -> float:
        return self.at

    def acquire(self, w: int):
        return self.server.view(w)

    def submit(self, view, commit) -> None:
        pass

    def release(self) -> None:
        pass

    def now(self) -> float:
        return self.coord.now()

    def rows(self, row: dict, tensors) -> None:
        self.coord.ledger.add(row, tensors)
        self.coord.ledger.record()

    def await_clock(self, w: int, t: int):
        if self.server.t < t:  # the engine parks a worker until its barrier is reached: this would be a bug
            raise RuntimeError(f"sim: worker {w} started a cycle at t={self.server.t} before its barrier t={t}")
        return self.server.pull(w)


def run(job: Job, recorder) -> Result:
    algo = algorithms.get(job.algorithm)
    n = job.workers
    job.data.to(job.device)
    model = build_flat_model(job)
    server, resumed = start_server(job, algo, model.param.clone())
    # with a single worker its local copy can be the model's own buffer: no copy on load
    workers = [Worker(w, job, algo, model, x=model.param if n == 1 else server.theta.clone()) for w in range(n)]
    opts = job.engine
    if not isinstance(opts, SimOptions):
        raise ValueError(f"engine=sim cannot run a job for engine={opts.name}")
    schedule = Schedule(
        opts.staleness,
        n,
        job.seed,
        opts.straggler_fraction,
        opts.straggler_slowdown,
        opts.cycle_cv,
        read_trace(opts.trace) if opts.staleness == "trace" else None,
    )
    # (simulated time the worker's first cycle, up to its first commit, ends; worker)
    queue = [(schedule.start(w, workers[w].window), w) for w in range(n)]
    heapq.heapify(queue)
    parked: dict[int, int] = {}  # workers waiting at a barrier: the local steps of their last cycle
    if resumed is not None:
        schedule.load_state_dict(resumed["engine"])
        queue = [(float(at), int(w)) for at, w in resumed["engine"]["queue"]]
        heapq.heapify(queue)
        parked = {int(w): int(k) for w, k in resumed["engine"].get("parked", [])}
        for w in [*(w for _, w in queue), *parked]:
            workers[w].load_state_dict(ckpt.load_worker(job.resume, w))
    coord = Coordinator(job, recorder, server, Evaluator(job, job.data), resumed)
    coord.sim_time = 0.0 if resumed is None else float(resumed["engine"].get("sim_time", 0.0))
    link = _Link(server, coord)
    coord.start()
    sim_cap = (job.budget or {}).get("sim_time")
    while queue:
        now, w = heapq.heappop(queue)
        wk = workers[w]
        if sim_cap and now > sim_cap:  # budget.sim_time: no commit lands after it (the queue is in time order)
            coord.sim_capped = True
            coord.finish(w)
            continue
        link.extra, link.at = {"sim_time": now}, now
        try:
            committed = wk.cycle(link)
        except Diverged as e:
            coord.diverge(f"{e} (commit {server.t + 1})")
            break
        if committed:
            coord.sim_time = now
        if committed and wk.step < wk.budget:
            if wk.pull_at > server.t:
                parked[w] = wk.window
            else:
                heapq.heappush(queue, (now + schedule.cycle(w, wk.window), w))  # its next window (DyLU: its own)
        else:
            coord.finish(w)
        for v in [v for v in parked if workers[v].pull_at <= server.t]:  # this commit reached their barrier:
            workers[v].await_pull(link)  # they pull now, and their next cycles start
            heapq.heappush(queue, (now + schedule.cycle(v, parked.pop(v)), v))
        if parked and not queue:
            barrier = min(workers[v].pull_at for v in parked)
            raise RuntimeError(
                f"sim: workers {sorted(parked)} wait at a barrier (t={barrier}) that no commit can "
                f"reach (t={server.t}, no other worker runs)"
            )
        if coord.evaluation_due():
            coord.evaluate_at(server.t, server.theta)
            if coord.diverged:
                break
        if coord.checkpoint_due():
            _checkpoint(coord, workers, schedule, queue, parked)
            if coord.diverged:
                break
    return coord.conclude({"placement": f"θ on {server.theta.device}, in this process with every virtual worker"})


def _checkpoint(
    coord: Coordinator, workers: list[Worker], schedule: Schedule, queue: list, parked: dict[int, int]
) -> None:
    """Between two cycles every virtual worker is at a commit boundary with nothing in hand."""
    folder = ckpt.pending(coord.job.run_dir)
    for w in [*(w for _, w in queue), *parked]:
        ckpt.save_atomic(workers[w].state_dict(), ckpt.worker_file(folder, w))
    coord.write_checkpoint(
        folder,
        coord.server.t,
        {
            **schedule.state_dict(),
            "sim_time": coord.sim_time,
            "queue": [[at, w] for at, w in queue],
            "parked": [[w, k] for w, k in parked.items()],
        },
    )
