"""The `sim` engine: n virtual asynchronous workers in one process, deterministic for a seed.

Each virtual worker is the shared worker cycle (gem.engines.worker) with its own stale copy, algorithm state,
data stream and dropout stream; they share one model to compute gradients with. The order in which workers reach
the parameter server comes from a staleness model: every worker's cycle (its local steps up to a commit) takes a
simulated duration, and the worker whose cycle ends first commits next (an event queue).

- `round_robin`: every cycle takes 1, ties broken by worker index, so workers commit 0, 1, …, n−1, 0, …
  and τ = n − 1 exactly once the first n commits are done.
- `exponential`: cycle durations are Exp(1), as for workers with random compute times.
- `stragglers`: a fraction `straggler_fraction` of the workers take `straggler_slowdown` times longer.

A cycle runs to its end, commit included, before the next starts: the server's turn is simply the next event.
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
from gem.engines.server import Server
from gem.engines.worker import Diverged, Worker

STALENESS_MODELS = ("round_robin", "exponential", "stragglers")


class Schedule:
    """Simulated cycle durations for the staleness model; seeded, hence deterministic."""

    def __init__(self, model: str, n: int, seed: int, straggler_fraction: float = 0.25,
                 straggler_slowdown: float = 4.0):
        if model not in STALENESS_MODELS:
            raise ValueError(f"engine.staleness={model} is not a staleness model; "
                             f"choose one of: {', '.join(STALENESS_MODELS)}")
        self.model = model
        self.rng = torch.Generator().manual_seed(seed + 99_991)
        self.slowdown = [1.0] * n
        if model == "stragglers":
            k = max(1, math.ceil(straggler_fraction * n)) if n > 1 else 0
            slow = torch.randperm(n, generator=self.rng)[:k].tolist()
            for w in slow:
                self.slowdown[w] = float(straggler_slowdown)

    def duration(self, worker: int) -> float:
        if self.model == "exponential":
            return float(torch.empty(1).exponential_(1.0, generator=self.rng))
        return self.slowdown[worker]


class _Link:
    """The sim engine's server is right here: the turn is the current event, rows go straight to the ledger."""

    def __init__(self, server: Server, coord: Coordinator):
        self.server, self.coord = server, coord
        self.extra: dict = {}

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


def run(job: Job, recorder) -> Result:
    algo = algorithms.get(job.algorithm)
    n = job.workers
    job.data.to(job.device)
    model = build_flat_model(job)
    server, resumed = start_server(job, algo, model.param.clone())
    # with a single worker its local copy can be the model's own buffer: no copy on load
    workers = [Worker(w, job, algo, model, x=model.param if n == 1 else server.theta.clone()) for w in range(n)]
    opts = job.engine
    schedule = Schedule(opts.get("staleness", "round_robin"), n, job.seed, opts.get("straggler_fraction", 0.25),
                        opts.get("straggler_slowdown", 4.0))
    queue = [(schedule.duration(w), w) for w in range(n)]  # (simulated time the worker's cycle ends, worker)
    heapq.heapify(queue)
    if resumed is not None:
        schedule.rng.set_state(resumed["engine"]["schedule_rng"])
        queue = [(float(at), int(w)) for at, w in resumed["engine"]["queue"]]
        heapq.heapify(queue)
        for _, w in queue:
            workers[w].load_state_dict(ckpt.load_worker(job.resume, w))
    coord = Coordinator(job, recorder, server, Evaluator(job, job.data), resumed)
    link = _Link(server, coord)
    coord.start()
    while queue:
        now, w = heapq.heappop(queue)
        wk = workers[w]
        link.extra = {"sim_time": now}
        before = wk.step
        try:
            committed = wk.cycle(link)
        except Diverged as e:
            coord.diverge(f"{e} (commit {server.t + 1})")
            break
        if committed and wk.step < wk.budget:
            heapq.heappush(queue, (now + schedule.duration(w) * (wk.step - before), w))
        else:
            coord.finish(w)
        if coord.evaluation_due():
            coord.evaluate_at(server.t, server.theta)
            if coord.diverged:
                break
        if coord.checkpoint_due():
            _checkpoint(coord, workers, schedule, queue)
            if coord.diverged:
                break
    return coord.conclude()


def _checkpoint(coord: Coordinator, workers: list[Worker], schedule: Schedule, queue: list) -> None:
    """Between two cycles every virtual worker is at a commit boundary with nothing in hand."""
    folder = ckpt.pending(coord.job.run_dir)
    for _, w in queue:
        ckpt.save_atomic(workers[w].state_dict(), ckpt.worker_file(folder, w))
    coord.write_checkpoint(folder, coord.server.t, {"schedule_rng": schedule.rng.get_state(),
                                                    "queue": [[at, w] for at, w in queue]})
