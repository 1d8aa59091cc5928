"""The `sim` engine: n virtual asynchronous workers in one process, deterministic for a seed.

Each virtual worker has its own stale copy `x` of the parameters, its own algorithm state and its own data
stream. The order in which workers reach the parameter server comes from a staleness model: every worker's
cycle (its local steps up to a commit) takes a simulated duration, and the worker whose cycle ends first
commits next (an event queue).

- `round_robin`: every cycle takes 1, ties broken by worker index, so workers commit 0, 1, …, n−1, 0, …
  and τ = n − 1 exactly once the first n commits are done.
- `exponential`: cycle durations are Exp(1), as for workers with random compute times.
- `stragglers`: a fraction `straggler_fraction` of the workers take `straggler_slowdown` times longer.

The server applies a commit and then the worker pulls θ, as one atomic step: staleness τ is the number of
commits applied between a worker's last pull and its commit. With one worker this is exactly sequential SGD.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import torch

from gem import algorithms
from gem.data import WorkerStream
from gem.engines import Job, Result
from gem.engines.core import Evaluator, build_flat_model, finite, worker_steps
from gem.metrics import tensor_rows

STALENESS_MODELS = ("round_robin", "exponential", "stragglers")


@dataclass
class VirtualWorker:
    index: int
    x: torch.Tensor  # the worker's local (stale) parameters
    state: dict
    stream: WorkerStream
    steps: int = 0  # local gradient steps done
    pulled_at: int = 0  # clock value of the worker's last pull


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


def run(job: Job, recorder) -> Result:
    algo = algorithms.get(job.algorithm)
    hp = job.hp
    data = job.data.to(job.device)
    model = build_flat_model(job)
    theta = model.param.clone()  # the central variable θ
    n = job.workers
    budget = worker_steps(job)
    opts = dict(job.engine)
    schedule = Schedule(opts.get("staleness", "round_robin"), n, job.seed,
                        opts.get("straggler_fraction", 0.25), opts.get("straggler_slowdown", 4.0))
    layout = list(zip(model.tensor_names, model.slices, strict=True))
    workers = []
    for w in range(n):
        # With a single worker its local copy can be the model's own buffer: no copy on load.
        x = model.param if n == 1 else theta.clone()
        workers.append(VirtualWorker(w, x, algo.init_state(theta, hp, layout),
                                     WorkerStream(len(data.train_y), job.batch_size, job.seed, w)))
    server = algorithms.init_server(algo, theta, hp)  # server-side algorithm state next to θ (GEM global proxy)
    evaluate = Evaluator(job, data)
    names = model.tensor_names

    t = 0  # the parameter server's clock: commits applied
    heap = [(schedule.duration(w), w) for w in range(n)]
    heapq.heapify(heap)
    t0 = time.perf_counter()
    recorder.eval(evaluate(theta, 0, t0))
    while heap:
        now, w = heapq.heappop(heap)
        wk = workers[w]
        loss_sum, local = 0.0, 0
        commit = None
        while commit is None and wk.steps < budget:
            xb, yb = data.batch(wk.stream.next_indices(), wk.stream.generator)
            model.load(wk.x)
            loss = model.loss_and_grad(xb, yb)
            wk.steps += 1
            local += 1
            loss_sum += loss
            if not math.isfinite(loss):
                return Result("diverged", t, reason=f"non-finite loss {loss} at worker {w}, "
                                                    f"worker step {wk.steps} (commit {t + 1})")
            commit = algo.worker_rule(wk.state, wk.x, model.grad, theta, hp, server)
        if commit is None:  # the budget ended inside a communication window: nothing left to send
            continue
        staleness = t - wk.pulled_at
        algo.server_rule(theta, commit, staleness, hp, server)
        t += 1
        if commit.pull:
            wk.x.copy_(theta)
        wk.pulled_at = t
        row = {"step": t, "worker": w, "worker_step": wk.steps, "staleness": staleness,
               "loss": loss_sum / local, "time_s": time.perf_counter() - t0, "sim_time": now,
               **commit.metrics}
        recorder.commit(row, tensor_rows(row, names, commit.tensors))
        if t % job.eval_every == 0:
            if not finite(theta):
                return Result("diverged", t, reason=f"non-finite central variable at commit {t}")
            recorder.eval(evaluate(theta, t, t0))
        if wk.steps < budget:
            heapq.heappush(heap, (now + schedule.duration(w) * local, w))
    if not finite(theta):
        return Result("diverged", t, reason=f"non-finite central variable at commit {t}")
    if t % job.eval_every != 0:
        recorder.eval(evaluate(theta, t, t0))
    return Result("completed", t)
