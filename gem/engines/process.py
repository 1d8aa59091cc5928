"""The `process` engine: n real worker processes on one machine, θ in shared memory (DESIGN §3).

Workers are OS processes started with `spawn`. The central variable θ, the algorithm's server-side tensors and
the clock t live in shared memory, and so does the training set, so that no worker holds a copy of it.

The parameter server is the coordinating process (the one that runs `run`), and it serves commits first in,
first out. A worker that has a gradient asks for the server's turn over its own pipe, stamped with the
system-wide monotonic clock; the coordinator hands out turns in the order of those stamps, one at a time. A
worker that has the turn runs its worker rule against the live θ, applies its commit with the server rule,
measures its staleness τ = t − (t at its last pull) and advances t, and pulls, all in place in shared memory,
then hands the turn back with its metrics row. Turns are exclusive, so staleness is measured under the
server's lock, and a worker never waits behind a faster one that asks again (the original code's polling in
rank order starved high ranks). Only the coordinator writes files and W&B.

Each worker has its own pipe, so a worker killed mid-run (SIGKILL included) cannot leave a shared lock held:
the coordinator notices its process sentinel, records the loss, and goes on with the others. Every wait has a
timeout, workers exit when the coordinator disappears, and the coordinator stops every child on the way out,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import time
from collections import deque
from multiprocessing import connection
from pathlib import Path

import torch
import torch.multiprocessing as tmp

from gem import algorithms
from gem.data import WorkerStream
from gem.engines import Job, Result
from gem.engines.core import (
    CHECKPOINT,
    Evaluator,
    build_flat_model,
    check_resumable,
    finite,
    load_checkpoint,
    save_atomic,
    worker_steps,
    write_manifest,
)

START_TIMEOUT_S = 300.0  # a spawned worker imports torch and builds its model: slow on a loaded machine
TURN_TIMEOUT_S = 120.0  # a worker holding the server's turn does elementwise work only; longer means hung
POLL_S = 1.0  # how often a waiting worker checks that the coordinator is still alive


def threads_per_process(workers: int) -> int:
    """floor(cores / processes), at least 1 (DESIGN §3)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


# ----------------------------------------------------------------------------------------------- worker


class _CoordinatorGone(Exception):
    pass


def _recv(conn, parent) -> tuple:
    """The next message from the coordinator; gives up if the coordinator has died."""
    while not conn.poll(POLL_S):
        if parent is not None and not parent.is_alive():
            raise _CoordinatorGone()
    return conn.recv()


def _plain(state: dict) -> dict:
    """The checkpointable part of an algorithm state: tensors and numbers (not GEM's layout, say)."""
    return {k: v for k, v in state.items() if isinstance(v, (torch.Tensor, int, float))}


def _worker(w: int, job: Job, theta: torch.Tensor, server: dict, clock: torch.Tensor, conn, threads: int,
            t0: float):
    """One worker process: local gradients, and, at each of its turns, the worker and server rules."""
    import multiprocessing
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the coordinator stops us
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()
    try:
        algo = algorithms.get(job.algorithm)
        hp, data = job.hp, job.data
        model = build_flat_model(job)
        torch.manual_seed(job.seed * 1_000_003 + 7919 * (w + 1))  # this worker's dropout draws
        x = model.param  # the worker's local copy: gradients are taken right here, no copy per step
        x.copy_(theta)
        layout = list(zip(model.tensor_names, model.slices, strict=True))
        state = algo.init_state(theta, hp, layout)
        stream = WorkerStream(len(data.train_y), job.batch_size, job.seed, w)
        budget = worker_steps(job)
        done_steps, pulled_at, loss_sum, local = 0, 0, 0.0, 0
        if job.resume is not None:
            saved = load_checkpoint(os.path.join(job.resume["path"], f"worker-{w}.pt"))
            x.copy_(saved["x"])
            for k, v in saved["state"].items():
                if isinstance(v, torch.Tensor):
                    state[k].copy_(v)
                else:
                    state[k] = v
            stream.epoch, stream.pos, stream.perm = saved["epoch"], saved["pos"], saved["perm"]
            stream.generator.set_state(saved["generator"])
            torch.set_rng_state(saved["rng"])
            done_steps, pulled_at = saved["step"], saved["pulled_at"]
            loss_sum, local = saved["loss_sum"], saved["local"]
        conn.send(("ready",))
        for step in range(done_steps + 1, budget + 1):
            # what a checkpoint needs to redo this step: the stream and RNGs before it, the window so far
            before = {"epoch": stream.epoch, "pos": stream.pos, "perm": stream.perm,
                      "generator": stream.generator.get_state(), "rng": torch.get_rng_state(),
                      "loss_sum": loss_sum, "local": local}
            xb, yb = data.batch(stream.next_indices(), stream.generator)
            loss = model.loss_and_grad(xb, yb)
            loss_sum += loss
            local += 1
            asked, asked_at = time.monotonic(), int(clock)
            conn.send(("turn", asked))
            msg = _recv(conn, parent)
            while msg[0] == "save":  # the server is checkpointing: our state as of our last turn
                save_atomic({"x": x, "state": _plain(state), "step": step - 1, "pulled_at": pulled_at, **before},
                            os.path.join(msg[1], f"worker-{w}.pt"))
                conn.send(("saved",))
                msg = _recv(conn, parent)
            if msg[0] != "go":
                return
            if not math.isfinite(loss):
                conn.send(("diverged", f"non-finite loss {loss} at worker {w}, worker step {step}"))
                return
            waited = time.monotonic() - asked
            commit = algo.worker_rule(state, x, model.grad, theta, hp, server)
            row = tensors = None
            if commit is not None:
                t = int(clock)
                staleness = t - pulled_at
                applied = time.perf_counter()
                algo.server_rule(theta, commit, staleness, hp, server)
                applied = time.perf_counter() - applied
                t += 1
                clock.fill_(t)
                if commit.pull:
                    x.copy_(theta)
                pulled_at = t
                row = {"step": t, "worker": w, "worker_step": step, "staleness": staleness,
                       "loss": loss_sum / local, "time_s": time.time() - t0,
                       # the server's queue: seconds, and commits by others, between asking and the turn
                       "wait_s": waited, "wait_commits": t - 1 - asked_at, "apply_s": applied, **commit.metrics}
                tensors = commit.tensors or None
                loss_sum, local = 0.0, 0
            conn.send(("done", row, tensors))
        conn.send(("finished",))
        _recv(conn, parent)  # hold on until the coordinator has read everything ("stop")
    except (_CoordinatorGone, BrokenPipeError, EOFError, ConnectionResetError):
        return
    except Exception as e:  # tell the coordinator why, then die
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ coordinator


@dataclasses.dataclass
class _Child:
    index: int
    process: object
    conn: object
    finished: bool = False
    lost: str = ""  # why the worker was lost, if it was


def _share(job: Job) -> Job:
    """The job with its dataset in shared memory: spawned workers map it instead of copying it."""
    data = dataclasses.replace(job.data)
    for k in ("train_x", "train_y"):
        setattr(data, k, getattr(data, k).share_memory_())
    # workers never evaluate: send them no validation split
    data.val_x, data.val_y = data.val_x[:0].clone(), data.val_y[:0].clone()
    return dataclasses.replace(job, data=data)


def run(job: Job, recorder) -> Result:
    if job.device != "cpu":
        raise ValueError("engine=process runs on device=cpu only (its central variable lives in shared host "
                         "memory); use engine=sim for device=cuda")
    algo = algorithms.get(job.algorithm)
    n = job.workers
    threads = threads_per_process(n)
    torch.set_num_threads(threads)  # the coordinator evaluates between commits
    model = build_flat_model(job)
    theta = model.param.clone().share_memory_()
    server = {k: v.share_memory_() for k, v in algorithms.init_server(algo, theta, job.hp).items()}
    clock = torch.zeros((), dtype=torch.long).share_memory_()
    past = {"finished": [], "lost": [], "lost_workers": []}
    if job.resume is not None:
        check_resumable(job.resume, job)
        central = load_checkpoint(os.path.join(job.resume["path"], "central.pt"))
        theta.copy_(central["theta"])
        for k, v in central["server"].items():
            server[k].copy_(v)
        clock.fill_(int(central["step"]))
        past = {k: list(central[k]) for k in past}
        for w in set(range(n)) - set(past["finished"]) - set(past["lost_workers"]):  # unreadable: say so now
            load_checkpoint(os.path.join(job.resume["path"], f"worker-{w}.pt"))
    evaluate = Evaluator(job, job.data)
    t0_wall, t0 = time.time(), time.perf_counter()  # one origin: workers stamp time_s with the wall clock
    if job.resume is not None:  # carry on the run's clock, so that time_s keeps increasing
        t0_wall -= float(job.resume.get("time_s", 0.0))
        t0 -= float(job.resume.get("time_s", 0.0))
    shared = _share(job)
    ctx = tmp.get_context("spawn")
    children: list[_Child] = []
    try:
        for w in range(n):
            if w in past["finished"] or w in past["lost_workers"]:
                continue  # done, or lost, before the checkpoint
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(w, shared, theta, server, clock, child_conn, threads, t0_wall),
                            name=f"gem-worker-{w}", daemon=True)
            p.start()
            child_conn.close()
            children.append(_Child(w, p, parent_conn))
        return _serve(job, recorder, children, theta, server, evaluate, t0, int(clock), past)
    finally:
        _stop(children)


def _stop(children: list[_Child], grace_s: float = 5.0) -> None:
    """Stop every child: ask, then terminate, then kill. Never waits forever."""
    for c in children:
        try:
            c.conn.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))
    for c in children:
        if c.process.is_alive():
            c.process.terminate()
    for c in children:
        c.process.join(2.0)
        if c.process.is_alive():
            c.process.kill()
            c.process.join(2.0)
    for c in children:
        c.conn.close()


class _Checkpoint:
    """A checkpoint in progress at commit `step`: no turn is granted until every active worker has saved."""

    def __init__(self, job: Job, step: int):
        self.step = step
        self.name = f"step-{step:09d}"
        self.path = Path(job.run_dir) / CHECKPOINT / self.name
        self.path.mkdir(parents=True, exist_ok=True)
        self.pending: set[int] = set()

    def finish(self, job, theta, server, past: dict, time_s: float) -> None:
        save_atomic({"theta": theta, "server": dict(server), "step": self.step, **past}, self.path / "central.pt")
        write_manifest(job.run_dir, self.step, self.name, job, {"time_s": time_s})
        for old in (Path(job.run_dir) / CHECKPOINT).glob("step-*"):  # the manifest names the new one now
            if old.name != self.name:
                shutil.rmtree(old, ignore_errors=True)


def _serve(job: Job, recorder, children: list[_Child], theta, server, evaluate, t0: float, steps: int,
           past: dict) -> Result:
    if job.resume is None:
        recorder.eval(evaluate(theta, 0, t0))
    by_conn = {c.conn: c for c in children}
    by_sentinel = {c.process.sentinel: c for c in children}
    waiting: deque[tuple[float, _Child]] = deque()  # turn requests, oldest first
    ready = set()
    lost: list[str] = list(past["lost"])
    finished: list[int] = list(past["finished"])
    saving: _Checkpoint | None = None

    def lose(c: _Child, why: str) -> None:
        if not c.lost and not c.finished:
            code = c.process.exitcode
            c.lost = f"worker {c.index} lost at commit {steps} ({why}" + (
                f", exit code {code})" if code is not None else ")")
            lost.append(c.lost)
            print(f"gem: {c.lost}; the run goes on with the others", flush=True)

    def active() -> list[_Child]:
        return [c for c in children if not c.finished and not c.lost]

    def read(c: _Child) -> tuple | None:
        try:
            return c.conn.recv()
        except (EOFError, OSError):
            lose(c, "its pipe closed")
            return None

    def state_of_run() -> dict:
        return {"finished": finished, "lost": lost,
                "lost_workers": [*past["lost_workers"], *(c.index for c in children if c.lost)]}

    started = time.monotonic()
    while active():
        timeout = START_TIMEOUT_S if len(ready) < len(children) else TURN_TIMEOUT_S
        live = active()
        events = connection.wait([c.conn for c in live] + [c.process.sentinel for c in live], timeout=timeout)
        if not events:
            if len(ready) < len(children) and time.monotonic() - started >= START_TIMEOUT_S:
                return Result("failed", steps, reason=f"workers did not start within {START_TIMEOUT_S:.0f} s")
            return Result("failed", steps, reason=f"no worker sent anything for {timeout:.0f} s")
        for e in events:
            c = by_sentinel.get(e) or by_conn[e]
            while not c.lost and not c.finished and c.conn.poll():
                msg = read(c)
                if msg is None:
                    break
                if msg[0] == "ready":
                    ready.add(c.index)
                elif msg[0] == "turn":
                    waiting.append((msg[1], c))
                elif msg[0] == "finished":
                    c.finished = True
                    finished.append(c.index)
                elif msg[0] == "error":
                    lose(c, f"raised {msg[1]}")
            if c.process.exitcode is not None and not c.finished:
                lose(c, "process died")
        # first in, first out: the oldest request across all workers gets the next turn
        waiting = deque(sorted((r for r in waiting if not r[1].lost), key=lambda r: r[0]))
        if saving is not None:
            for _, c in waiting:
                if c.index in saving.pending:
                    _save(c, saving.path, lose)
                    saving.pending.discard(c.index)
            saving.pending &= {c.index for c in active()}
            if saving.pending:
                continue  # the others have yet to reach the checkpoint
            saving.finish(job, theta, server, state_of_run(), time.perf_counter() - t0)
            saving = None
        while waiting:
            _, c = waiting.popleft()
            outcome = _turn(c, lose)
            if outcome is None:
                continue
            if outcome[0] == "diverged":
                return Result("diverged", steps, reason=outcome[1])
            _, row, tensors = outcome
            if row is None:
                continue
            steps = row["step"]
            recorder.commit(row, [{"step": steps, "worker": c.index, "tensor": name, "tensor_index": i,
                                   **{k: v[i] for k, v in tensors.items()}}
                                  for i, name in enumerate(evaluate.model.tensor_names)] if tensors else None)
            if steps % job.eval_every == 0:
                if not finite(theta):
                    return Result("diverged", steps, reason=f"non-finite central variable at commit {steps}")
                recorder.eval(evaluate(theta, steps, t0))
            if job.checkpoint_every and job.run_dir and steps % job.checkpoint_every == 0:
                if not finite(theta):
                    return Result("diverged", steps, reason=f"non-finite central variable at commit {steps}")
                recorder.flush()  # the rows up to the checkpoint are on disk before it is named
                saving = _Checkpoint(job, steps)
                saving.pending = {c.index for c in active()}
                break  # the requests still waiting are served after the checkpoint
    if not finite(theta):
        return Result("diverged", steps, reason=f"non-finite central variable at commit {steps}")
    if not finished:
        return Result("failed", steps, reason="; ".join(lost) or "no worker finished")
    if recorder.last_eval is None or recorder.last_eval["step"] != steps:
        recorder.eval(evaluate(theta, steps, t0))
    return Result("completed", steps, reason="; ".join(lost), extra={"lost_workers": state_of_run()["lost_workers"]})


def _save(c: _Child, path: Path, lose) -> None:
    """Ask worker c, which is waiting for a turn, to write its state into the checkpoint folder."""
    try:
        c.conn.send(("save", str(path)))
    except OSError:
        lose(c, "its pipe closed")
        return
    ready = connection.wait([c.conn, c.process.sentinel], timeout=TURN_TIMEOUT_S)
    if c.conn not in ready and not c.conn.poll():
        lose(c, "did not write its checkpoint")
        return
    try:
        msg = c.conn.recv()
    except (EOFError, OSError):
        lose(c, "process died while writing its checkpoint")
        return
    if msg[0] != "saved":
        lose(c, f"raised {msg[1]}" if msg[0] == "error" else f"unexpected message {msg[0]!r}")


def _turn(c: _Child, lose) -> tuple | None:
    """Give worker c the server's turn and wait for it to hand it back. None if the worker was lost."""
    try:
        c.conn.send(("go",))
    except OSError:
        lose(c, "its pipe closed")
        return None
    ready = connection.wait([c.conn, c.process.sentinel], timeout=TURN_TIMEOUT_S)
    if not ready:
        c.process.kill()  # hung while holding the turn: it must not touch θ again
        lose(c, f"held the server's turn for more than {TURN_TIMEOUT_S:.0f} s")
        return None
    if c.conn not in ready and not c.conn.poll():
        lose(c, "process died during its turn")
        return None
    try:
        msg = c.conn.recv()
    except (EOFError, OSError):
        lose(c, "process died during its turn")
        return None
    if msg[0] == "error":
        lose(c, f"raised {msg[1]}")
        return None
    if msg[0] not in ("done", "diverged"):
        lose(c, f"unexpected message {msg[0]!r} during its turn")
        return None
    return msg
