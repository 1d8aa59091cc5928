"""`python run.py -m <sweep> plan=true`: what a sweep would run and roughly how long it would take, before any of it
runs. Nothing is launched and no run or sweep directory is made.

Each job's size is exact: its commits and gradient steps follow from the config and the training-set size
(gem.engines.core). Its time is an estimate from a short calibration on this machine: a few gradient steps of
the job's own model on its own data and batch size (once per distinct model, data, batch and precision), and one
forward pass for the cost of an evaluation. A job's estimate is

    gradient steps × the time of one step / the workers that compute at once   (+ its evaluations)

where the workers that compute at once are min(n, cores) on `process` and `distributed` (each worker one
process, with cores / n torch threads) and 1 on `sim` (one process simulates every worker), plus each commit's
arithmetic (the algorithm's worker and server rules, timed on a θ of the model's size: commits go through the
server one at a time). It leaves out what the calibration cannot see: starting n processes (about a second each
here), communication and a loaded machine. Treat it as a lower bound good to a factor of about two; it is there to
catch the sweep that would take a day, not to schedule one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

WARN_S = 3600.0  # a sweep estimated above this gets a warning line
CALIBRATION_S = 1.5  # time spent timing gradient steps, per distinct (model, data, batch, precision, device)


@dataclass
class Cost:
    step_s: float  # one gradient step, one thread (a process worker's share of the cores when n <= cores)
    step_all_s: float  # one gradient step with every core (the sim engine's single process)
    example_fwd_s: float  # one example's forward pass, for evaluations
    train: int  # training examples
    val: int
    busy: bool = False  # every core was slower than one thread: another program holds the cores (step_all_s = step_s)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _timed(fn, budget: float, at_least: int = 3) -> float:
    """Seconds per call of fn, after one warm-up call: the fastest of at least `at_least` calls (more until
    `budget` is spent, at most 50). The fastest, neither the mean nor the median: on a shared machine a call now
    and then waits for a core, and a busy spell must not set the estimate of a whole sweep (the plan is a lower
    bound)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < at_least or (time.perf_counter() - start < budget and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def calibrate(spec) -> tuple[Cost, object, object]:
    """Time the job's model on its data: gradient steps on one thread and on all cores, and a forward pass.
    Returns the cost, and the job and model for `_commit_cost`."""
    import torch

    from experiments.job import build_job
    from gem.engines.core import build_flat_model

    job = build_job(spec, log=lambda *a: None)
    model = build_flat_model(job)
    b = job.batch_size
    x, y = job.data.train_x[:b].to(model.device), job.data.train_y[:b].to(model.device)
    threads = torch.get_num_threads()
    try:
        step_1 = step_all = float("inf")
        for _ in range(2):  # interleaved: a busy spell of the machine meets both, and the fastest of each is kept
            torch.set_num_threads(1)
            step_1 = min(step_1, _timed(lambda: model.loss_and_grad(x, y), CALIBRATION_S / 4))
            torch.set_num_threads(cores())
            step_all = min(step_all, _timed(lambda: model.loss_and_grad(x, y), CALIBRATION_S / 4))
        # a check for sense: every core cannot be slower than one thread unless other programs hold the cores
        # (seen: 7.6 ms on 1 thread, 285 ms on 2, on a loaded machine); then a step costs what one thread's does
        busy = step_all > 1.5 * step_1
        step_all = min(step_all, step_1)
        k = min(len(job.data.train_y), 1024)
        xe, ye = job.data.train_x[:k], job.data.train_y[:k]
        fwd = _timed(lambda: model.evaluate(xe, ye), CALIBRATION_S / 4, at_least=1) / k
    finally:
        torch.set_num_threads(threads)
    return Cost(step_1, step_all, fwd, len(job.data.train_y), len(job.data.val_y), busy), job, model


def _commit_cost(job, model) -> float:
    """Seconds of one commit's arithmetic on θ of the model's size: the algorithm's own worker rule, server step
    and diagnostics (GEM's per-element π and its medians are not free at n = 30), with a random gradient."""
    import torch

    from gem import algorithms
    from gem.engines.server import Server

    algo = algorithms.get(job.algorithm)
    theta = model.param.detach().clone()
    server = Server.create(algo, job.hp, theta, job.workers)
    x = theta.clone()
    state = algo.init_state(x, job.hp)
    grad = torch.randn_like(theta) * 1e-3
    layout = model.layout

    def one():
        if algo.prepare is not None:
            algo.prepare(state, x, grad, job.hp)
        view = server.view(0)
        commit = algo.worker_rule(state, x, grad, view, job.hp)
        server.apply(view, commit)
        if algo.diagnostics is not None:
            algo.diagnostics(commit, layout, job.hp)

    threads = torch.get_num_threads()
    try:  # the faster of one thread and all of them: elementwise work on θ may or may not gain from threads
        torch.set_num_threads(1)
        single = _timed(one, CALIBRATION_S / 8)
        torch.set_num_threads(cores())
        return min(single, _timed(one, CALIBRATION_S / 8))
    finally:
        torch.set_num_threads(threads)


def _key(cfg) -> str:
    from omegaconf import OmegaConf

    node = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "data")}
    return repr((node, cfg.batch_size, cfg.precision, cfg.device, cfg.loss))


def duration(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def job_size(spec, cost: Cost, commit_s: float, job_cores: int | None = None) -> dict:
    """Commits, gradient steps, evaluations and the estimated seconds of one job (`commit_s`: one commit's
    arithmetic, `_commit_cost`) on `job_cores` cores (all of this machine's by default; fewer when a launcher runs
    several jobs at once)."""
    from types import SimpleNamespace

    from experiments.config import budget_of
    from gem import algorithms
    from gem.engines.core import commits_per_worker, worker_steps

    cfg, n = spec.cfg, spec.workers
    algo = algorithms.get(spec.algorithm)
    window = algo.commit_every(spec.hp)
    budget = budget_of(cfg)
    # the engines' own count of a worker's steps and commits, on a job of this size
    sized = SimpleNamespace(
        epochs=cfg.epochs, batch_size=cfg.batch_size, data=SimpleNamespace(train_y=range(cost.train)), budget=budget
    )
    commits = n * commits_per_worker(sized, window)
    steps = n * worker_steps(sized)
    # the caps: budget.commits exactly; budget.sim_time about n·sim_time/λ commits (a worker's cycle of λ local steps
    # takes λ on average); budget.seconds below, on the estimate itself
    cap = min(
        budget.get("commits") or commits, int(n * budget["sim_time"] / window) if "sim_time" in budget else commits
    )
    if cap < commits:
        steps, commits = steps * cap // max(1, commits), cap
    evals = commits // cfg.logger.eval_every + 2  # every eval_every commits, at the start and at the end
    eval_examples = cost.val + min(cfg.logger.eval_train_size, cost.train)
    job_cores = job_cores or cores()
    if cfg.engine.name == "sim":  # one process, torch's own threads: the faster of the two timings
        compute = steps * (min(cost.step_all_s, cost.step_s) if job_cores > 1 else cost.step_s)
    else:  # n processes, cores / n threads each: about min(n, cores) steps at once
        compute = steps * cost.step_s / min(n, job_cores)
    # commits go through the server one at a time on every engine
    training = compute + commits * commit_s
    evaluating = evals * eval_examples * cost.example_fwd_s
    if budget.get("seconds") and training + evaluating > budget["seconds"]:  # the run stops there
        scale = budget["seconds"] / (training + evaluating)
        commits, steps, evals = int(commits * scale), int(steps * scale), int(evals * scale)
        training, evaluating = training * scale, evaluating * scale
    return {
        "n": n,
        "commits": commits,
        "steps": steps,
        "evals": evals,
        "seconds": training + evaluating,
        "eval_seconds": evaluating,
        "eval_every": cfg.logger.eval_every,
    }


ACTIONS = {"skip": "finished: skipped", "new": "start"}  # how a resumed sweep's plan words rerun, resume and these


def _swept(jobs) -> set[str]:
    """The keys whose value differs between the jobs, or that only some jobs set (a grid's own setting, such as
    AGN's tuned window beside its default): what tells one job from another."""
    values: dict[str, set[str]] = {}
    present: dict[str, int] = {}
    for overrides, _ in jobs:
        for o in overrides:
            key, _, value = o.partition("=")
            key = key.lstrip("+~")
            values.setdefault(key, set()).add(value)
            present[key] = present.get(key, 0) + 1
    return {k for k, v in values.items() if (len(v) > 1 or present[k] < len(jobs)) and not k.startswith("hydra")}


def show(
    jobs: list[tuple[list[str], object]],
    out=print,
    actions: list[str] | None = None,
    heldout_seeds: list[int] | None = None,
    at_once: int = 1,
) -> float:
    """Print the plan of `jobs` ((overrides, experiments.config.Spec) each); returns the estimated total seconds.
    `actions`: what a resumed sweep does with each job (experiments.rundir.sweep_action); a skipped job costs
    nothing, a resumed one is counted whole (an upper bound). `heldout_seeds`: the sweep is a tuning protocol's
    first stage (hydra.sweeper.heldout_seeds); its second, which `python -m analysis.tune` writes, runs each
    algorithm at each n at two settings at most (the paper's and the chosen one) on these seeds, so it is
    estimated too, at the cost of that algorithm's and n's costliest trial. `at_once`: how many jobs the launcher
    runs at a time (joblib's hydra.launcher.n_jobs); above 1 the plan also gives the wall time, each job timed on
    its share of the cores (two jobs on 2 cores run on one thread each: the held-out stage of the tuning protocol
    took 2.2 times a plan that timed them on two, BENCHMARKS.md)."""
    import dataclasses

    from experiments.instantiate import display_name

    costs: dict[str, Cost] = {}
    built: dict[str, tuple] = {}
    commit_s: dict[tuple[str, str], float] = {}
    rows = []
    costliest: dict[tuple[str, int], float] = {}  # per (algorithm, n): its costliest job (the held-out stage)
    swept = _swept(jobs)
    shared: list[float] = []  # each job's seconds on its share of the cores, when several run at once
    for i, (overrides, spec) in enumerate(jobs):
        cfg = spec.cfg
        key, algo = _key(cfg), spec.algorithm
        if key not in costs:
            costs[key], *built[key] = calibrate(spec)
        if (key, algo) not in commit_s:  # each algorithm's own rules, on the model of this key
            job, model = built[key]
            job = dataclasses.replace(job, algorithm=algo, hp=spec.hp, workers=spec.workers)
            commit_s[(key, algo)] = _commit_cost(job, model)
        size = job_size(spec, costs[key], commit_s[(key, algo)])
        label = " ".join(o for o in overrides if o.partition("=")[0].lstrip("+~") in swept) or "(one job)"
        if actions is not None:
            label += f"  [{ACTIONS.get(actions[i], actions[i])}]"
            if actions[i] == "skip":
                size["seconds"] = 0.0
        rows.append((label, cfg.engine.name, size))
        if at_once > 1 and (actions is None or actions[i] != "skip"):
            shared.append(job_size(spec, costs[key], commit_s[(key, algo)], max(1, cores() // at_once))["seconds"])
        trial = (spec.algorithm, spec.workers)
        costliest[trial] = max(costliest.get(trial, 0.0), size["seconds"])
    total = sum(r[2]["seconds"] for r in rows)
    width = max(len(r[0]) for r in rows)
    out(f"gem: plan for {len(rows)} job{'s' if len(rows) != 1 else ''} (plan=true: nothing runs, no directory is made)")
    out(
        f"  {'#':>3}  {'job':<{width}}  {'engine':<11} {'n':>4} {'commits':>10} {'grad steps':>11} {'evals':>6} "
        f"{'estimate':>9} {'of it evals':>11}"
    )
    for i, (name, engine, s) in enumerate(rows):
        share = s["eval_seconds"] / s["seconds"] if s["seconds"] > 0 else 0.0
        out(
            f"  {i:>3}  {name:<{width}}  {engine:<11} {s['n']:>4} {s['commits']:>10,} {s['steps']:>11,} "
            f"{s['evals']:>6,} {duration(s['seconds']):>9} {share:>11.0%}"
        )
    commits = sum(r[2]["commits"] for i, r in enumerate(rows) if actions is None or actions[i] != "skip")
    left = "" if actions is None else f" for the {sum(a != 'skip' for a in actions)} jobs left to run"
    out(
        f"total{left}: {commits:,} commits, about {duration(total)} one job after another on this machine "
        f"({cores()} cores)"
    )
    if at_once > 1 and shared:
        k = min(at_once, len(shared))
        wall = max(sum(shared) / k, max(shared))  # k at a time, and never less than the longest job
        per = max(1, cores() // at_once)
        out(
            f"  with {k} jobs at a time (hydra.launcher.n_jobs={at_once}): about {duration(wall)} of wall time, each "
            f"job on {per} of the {cores()} cores"
        )
    if heldout_seeds:
        held = 2 * len(heldout_seeds) * sum(costliest.values())
        out(
            f"then the held-out stage (python -m analysis.tune): at most {2 * len(heldout_seeds) * len(costliest)} "
            f"jobs, each algorithm at each n at the paper's setting and at the chosen one on seeds "
            f"{','.join(map(str, heldout_seeds))}, about {duration(held)}; the whole protocol about "
            f"{duration(total + held)}"
        )
        total += held
    for key, c in costs.items():
        cfg = next(spec.cfg for _, spec in jobs if _key(spec.cfg) == key)
        out(
            f"  calibration: model={display_name('model', cfg.model)} data={display_name('data', cfg.data)} "
            f"batch_size={cfg.batch_size}: {c.step_s * 1e3:.1f} ms per gradient step on 1 thread, "
            + (
                f"and no faster on {cores()} (the cores are busy with other programs: the estimate assumes one "
                "thread's speed, which a run gets with OMP_NUM_THREADS=1; on every core it may be far slower)"
                if c.busy
                else f"{c.step_all_s * 1e3:.1f} ms on {cores()}"
            )
            + f"; an evaluation of {c.val:,} + {min(cfg.logger.eval_train_size, c.train):,} examples "
            f"{(c.val + min(cfg.logger.eval_train_size, c.train)) * c.example_fwd_s:.2f} s"
        )
    evaluating = sum(r[2]["eval_seconds"] for i, r in enumerate(rows) if actions is None or actions[i] != "skip")
    if total > 0 and evaluating / total > 0.2:  # the knob that shortens it, named where it matters
        every = sorted({r[2]["eval_every"] for r in rows})
        out(
            f"  evaluations are {evaluating / total:.0%} of the estimate ({duration(evaluating)}): each one evaluates "
            f"the validation split and logger.eval_train_size training examples; logger.eval_every="
            f"{'/'.join(map(str, every))} commits apart now, a larger logger.eval_every (or a smaller "
            "logger.eval_train_size) makes them fewer (or cheaper)"
        )
    slowest: dict[str, float] = {}
    for (_, a), v in commit_s.items():
        slowest[a] = max(v, slowest.get(a, 0.0))
    rules = ", ".join(f"{a} {v * 1e3:.1f} ms" for a, v in slowest.items())
    out(f"  a commit's arithmetic (the algorithm's rules on θ): {rules}")
    out(
        "  (a lower bound good to about 2x: process start-up, communication and a loaded machine are not counted; "
        "experiments/plan.py)"
    )
    if total > WARN_S:
        longest = max(range(len(rows)), key=lambda i: rows[i][2]["seconds"])
        out(
            f"gem: warning: this sweep is estimated at {duration(total)}, above {duration(WARN_S)}; its longest job "
            f"is #{longest} ({rows[longest][0]}, {rows[longest][2]['commits']:,} commits, "
            f"{duration(rows[longest][2]['seconds'])}). Consider fewer workers, epochs or seeds, or a _quick "
            "experiment."
        )
    return total
