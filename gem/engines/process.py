"""The `process` engine: n real worker processes on one machine, θ in shared memory (DESIGN §3).

Workers are OS processes started with `spawn`. The central variable θ, the algorithm's server-side tensors, the
clock t and the training set live in shared memory, so no worker holds a copy of the data.

The parameter server is a turn that the workers pass among themselves, first in, first out (`Turn`): a worker
with a fresh gradient takes the turn, runs its worker rule against the live θ, applies its commit with the
server rule, measures its staleness τ = t − (t at its last pull), advances t and pulls, all in place in shared
memory, and passes the turn to the worker that asked next. Turns are exclusive, so staleness is measured under
the server's lock; a free turn costs one uncontended lock; a busy one, a single wake-up of the next worker in
line. Nobody is starved: while a worker waits, each other worker gets the turn at most once (the original
code's polling in rank order let low ranks overtake high ones again and again).

The coordinating process (the one that calls `run`) holds the turn until every worker has started, so that
all of them copy the same θ at the same clock, and after that holds no lock on the hot path. It reads each worker's
commit rows from that worker's pipe, puts them in clock order, and is the only process that writes files and
W&B. It takes the turn itself to read θ for an evaluation, and for a checkpoint, during which every worker
writes its own state. It watches every worker's process: a worker killed mid-run (SIGKILL included) is
recorded, the turn is taken back from it if it held it, the others are asked to send the rows they
hold so that the lost worker's unreported commits can be marked (`lost_row`), and the run goes on. Every wait has a
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
    Ledger,
    build_flat_model,
    check_resumable,
    conclude,
    finite,
    load_checkpoint,
    save_atomic,
    worker_steps,
    write_manifest,
)

START_TIMEOUT_S = 300.0  # a spawned worker imports torch and builds its model: slow on a loaded machine
TURN_TIMEOUT_S = 120.0  # nothing holds the turn this long unless it is hung
POLL_S = 1.0  # how often a waiting process checks that the others are still alive
# a worker sends its commit rows in batches of this many, or this often: each message wakes the coordinator,
# which on a machine with as many workers as cores takes CPU from a worker
ROWS_PER_MESSAGE, ROWS_SECONDS = 16, 0.25

GO, SAVE, STOP, FLUSH = 0, 1, 2, 3  # what a worker woken on its semaphore is asked to do


def threads_per_process(workers: int) -> int:
    """floor(cores / processes), at least 1 (DESIGN §3)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


class _Gone(Exception):
    """The coordinator has died, or asked this worker to stop."""


class Turn:
    """The parameter server's lock, handed over first in, first out.

    Participants 0..n−1 are the workers and n is the coordinator. `meta` guards a ring buffer of waiting
    participants and the current holder; it is held for a few instructions only. Each participant sleeps on
    its own semaphore, which the releaser posts when the turn is handed to it, or the coordinator posts with
    `action` set to SAVE (write a checkpoint), FLUSH (send your rows) or STOP. A lock held by a process that
    died is taken back by the coordinator (`recover`), so a SIGKILL cannot hang the others. Every wait polls:
    `waiting()` is called about once a second and may raise to give up.
    """

    def __init__(self, ctx, participants: int):
        self.meta = ctx.Lock()
        self.sems = [ctx.Semaphore(0) for _ in range(participants)]
        # [holder, head, count, ring...]: holder −1 when free
        self.state = torch.zeros(3 + participants, dtype=torch.long).share_memory_()
        self.state[0] = -1
        self.action = torch.zeros(participants, dtype=torch.long).share_memory_()
        self.size = participants

    def _lock_meta(self, waiting=None) -> None:
        while not self.meta.acquire(timeout=POLL_S):
            if waiting is not None:
                waiting()

    def _line(self) -> list[int]:
        s = self.state
        return [int(s[3 + (int(s[1]) + i) % self.size]) for i in range(int(s[2]))]

    def _enqueue(self, who: int) -> None:
        s = self.state
        s[3 + (int(s[1]) + int(s[2])) % self.size] = who
        s[2] += 1

    def _hand_over(self) -> None:
        """Give the turn to the oldest waiter, or free it. Call with meta held."""
        s = self.state
        if int(s[2]) == 0:
            s[0] = -1
            return
        nxt = int(s[3 + int(s[1])])
        s[1] = (int(s[1]) + 1) % self.size
        s[2] -= 1
        s[0] = nxt
        if int(self.action[nxt]) != STOP:
            self.action[nxt] = GO
        self.sems[nxt].release()

    def acquire(self, who: int, waiting=None, on_request=None, timeout: float | None = None) -> bool:
        """Wait for the turn. `on_request(action)`: do what the coordinator asks (SAVE, FLUSH) meanwhile.
        With a `timeout`, give up after it, out of line again, and return False."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._lock_meta(waiting)
        try:
            act = int(self.action[who])
            if act == STOP:
                raise _Gone()
            if int(self.state[0]) == -1:
                self.state[0] = who
                return True
            self._enqueue(who)
        finally:
            self.meta.release()
        if act in (SAVE, FLUSH) and on_request is not None:  # asked before we queued: nobody will wake us
            self.action[who] = GO
            on_request(act)
        while True:
            if not self.sems[who].acquire(timeout=POLL_S):
                if waiting is not None:
                    waiting()
                if deadline is not None and time.monotonic() > deadline:
                    self.recover(who)  # out of line, or the turn handed on if it came just now
                    return False
                continue
            act = int(self.action[who])
            if act == STOP:
                raise _Gone()
            if act in (SAVE, FLUSH):
                self.action[who] = GO
                if on_request is not None:
                    on_request(act)
                continue
            return True  # GO: the turn is ours

    def release(self, waiting=None) -> None:
        self._lock_meta(waiting)
        try:
            self._hand_over()
        finally:
            self.meta.release()

    def ask(self, workers: set[int], action: int, waiting=None) -> None:
        """(coordinator, holding the turn) Ask these workers to SAVE or FLUSH: at once if they wait in line,
        else as soon as they queue."""
        self._lock_meta(waiting)
        try:
            line = set(self._line())
            for w in workers:
                self.action[w] = action
                if w in line:
                    self.sems[w].release()
        finally:
            self.meta.release()

    def stop(self, who: int) -> None:
        if self.meta.acquire(timeout=2.0):
            try:
                self.action[who] = STOP
            finally:
                self.meta.release()
        else:
            self.action[who] = STOP
        self.sems[who].release()

    def recover(self, gone: int) -> None:
        """(coordinator) Take the turn, and any place in line, back from a participant that died, or from the
        coordinator itself when it gives up waiting."""
        if not self.meta.acquire(timeout=2.0):
            # meta is held for a few instructions only: after 2 s its holder is the process that died
            self.meta.release()
            if not self.meta.acquire(timeout=2.0):
                return
        try:
            s = self.state
            line = self._line()
            if gone in line:
                line.remove(gone)
                s[1], s[2] = 0, 0
                for w in line:
                    self._enqueue(w)
            if int(s[0]) == gone:
                self._hand_over()
        finally:
            self.meta.release()


# ----------------------------------------------------------------------------------------------- worker


def _plain(state: dict) -> dict:
    """The checkpointable part of an algorithm state: tensors and numbers (not GEM's layout, say)."""
    return {k: v for k, v in state.items() if isinstance(v, (torch.Tensor, int, float))}


def _worker(w: int, job: Job, theta: torch.Tensor, server: dict, clock: torch.Tensor, turn: Turn, conn,
            threads: int, t0: float):
    """One worker process: local gradients, and, at each of its turns, the worker and server rules."""
    import multiprocessing
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the coordinator stops us
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()

    def waiting():  # called about once a second while this worker waits for a lock
        if parent is not None and not parent.is_alive():
            raise _Gone()

    try:
        algo = algorithms.get(job.algorithm)
        hp, data = job.hp, job.data
        model = build_flat_model(job)
        torch.manual_seed(job.seed * 1_000_003 + 7919 * (w + 1))  # this worker's dropout draws
        # the coordinator holds the server's turn until every worker is ready, so θ and the clock are still
        x = model.param  # the worker's local copy: gradients are taken right here, no copy per step
        x.copy_(theta)
        layout = list(zip(model.tensor_names, model.slices, strict=True))
        state = algo.init_state(theta, hp, layout)
        stream = WorkerStream(len(data.train_y), job.batch_size, job.seed, w)
        budget = worker_steps(job)
        done_steps, pulled_at, loss_sum, local = 0, int(clock), 0.0, 0
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
        before: dict = {}
        step = done_steps
        rows: list = []  # commit rows not yet sent: sent in batches, so the coordinator wakes up less often
        sent_at = time.monotonic()

        def send_rows():
            nonlocal rows, sent_at
            if rows:
                conn.send(("rows", rows))
                rows, sent_at = [], time.monotonic()

        def on_request(action):
            send_rows()
            if action == FLUSH:
                conn.send(("flushed", w))
                return
            # SAVE: our state as of our last turn, and the stream and RNGs before the step in hand
            save_atomic({"x": x, "state": _plain(state), "step": step - 1, "pulled_at": pulled_at, **before},
                        os.path.join(job.run_dir, CHECKPOINT, "pending", f"worker-{w}.pt"))
            conn.send(("saved", w))

        for step in range(done_steps + 1, budget + 1):
            before = {"epoch": stream.epoch, "pos": stream.pos, "perm": stream.perm,
                      "generator": stream.generator.get_state(), "rng": torch.get_rng_state(),
                      "loss_sum": loss_sum, "local": local}
            xb, yb = data.batch(stream.next_indices(), stream.generator)
            loss = model.loss_and_grad(xb, yb)
            loss_sum += loss
            local += 1
            if not math.isfinite(loss):
                send_rows()
                conn.send(("diverged", f"non-finite loss {loss} at worker {w}, worker step {step}"))
                return
            asked, asked_at = time.monotonic(), int(clock)
            turn.acquire(w, waiting, on_request)
            try:
                waited = time.monotonic() - asked
                commit = algo.worker_rule(state, x, model.grad, theta, hp, server)
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
                           "wait_s": waited, "wait_commits": t - 1 - asked_at, "apply_s": applied,
                           **commit.metrics}
                    rows.append((row, commit.tensors or None))
                    loss_sum, local = 0.0, 0
            finally:
                turn.release(waiting)
            if len(rows) >= ROWS_PER_MESSAGE or time.monotonic() - sent_at > ROWS_SECONDS:
                send_rows()
        send_rows()
        conn.send(("finished", w))
    except (_Gone, BrokenPipeError, EOFError, ConnectionResetError):
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
    torch.set_num_threads(threads)  # the coordinator evaluates while the workers train
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
    turn = Turn(ctx, n + 1)
    turn.state[0] = n  # the coordinator holds the turn until every worker is ready: all start from one θ
    children: list[_Child] = []
    try:
        for w in range(n):
            if w in past["finished"] or w in past["lost_workers"]:
                continue  # done, or lost, before the checkpoint
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"gem-worker-{w}", daemon=True,
                            args=(w, shared, theta, server, clock, turn, child_conn, threads, t0_wall))
            p.start()
            child_conn.close()
            children.append(_Child(w, p, parent_conn))
        return _Coordinator(job, recorder, children, turn, theta, server, clock, evaluate, t0, past).serve()
    finally:
        _stop(children, turn)


def _stop(children: list[_Child], turn: Turn, grace_s: float = 5.0) -> None:
    """Stop every child: ask, then terminate, then kill. Never waits forever."""
    for c in children:
        if c.process.is_alive():
            turn.stop(c.index)
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


class _Coordinator:
    def __init__(self, job, recorder, children, turn, theta, server, clock, evaluate, t0, past):
        self.job, self.recorder, self.children, self.turn = job, recorder, children, turn
        self.theta, self.server, self.clock, self.evaluate, self.t0 = theta, server, clock, evaluate, t0
        self.me = job.workers  # the coordinator's place in the turn
        self.by_conn = {c.conn: c for c in children}
        self.by_sentinel = {c.process.sentinel: c for c in children}
        self.past = past
        self.lost: list[str] = list(past["lost"])
        self.finished: list[int] = list(past["finished"])
        self.ready: set[int] = set()
        self.replies: set[int] = set()  # workers that answered the current SAVE or FLUSH request
        self.need_sync = False  # a worker was lost: its unsent rows leave a gap to fill
        self.started = False  # the coordinator holds the turn until every worker is ready
        self.ledger = Ledger(recorder, evaluate.model.tensor_names, int(clock))
        self.diverged = ""
        every = job.eval_every
        self.next_eval = (self.steps // every + 1) * every
        ck = job.checkpoint_every if job.run_dir else 0
        self.next_checkpoint = (self.steps // ck + 1) * ck if ck else None

    @property
    def steps(self) -> int:  # the last commit recorded
        return self.ledger.steps

    def active(self) -> list[_Child]:
        return [c for c in self.children if not c.finished and not c.lost]

    def lose(self, c: _Child, why: str) -> None:
        if c.lost or c.finished:
            return
        code = c.process.exitcode
        c.lost = f"worker {c.index} lost at commit {int(self.clock)} ({why}" + (
            f", exit code {code})" if code is not None else ")")
        self.lost.append(c.lost)
        print(f"gem: {c.lost}; the run goes on with the others", flush=True)
        if c.process.is_alive():
            c.process.kill()
            c.process.join(2.0)
        self.turn.recover(c.index)
        self.need_sync = True

    def lost_workers(self) -> list[int]:
        return [*self.past["lost_workers"], *(c.index for c in self.children if c.lost)]

    def poll(self, timeout: float) -> bool:
        """Read whatever the workers have sent, for up to `timeout` s; notice the dead. False: nothing came."""
        live = self.active()
        if not live:
            return True
        events = connection.wait([c.conn for c in live] + [c.process.sentinel for c in live], timeout=timeout)
        for e in events:
            c = self.by_sentinel.get(e) or self.by_conn[e]
            self.drain(c)
            if c.process.exitcode is not None and not c.finished and not self.diverged:
                self.drain(c)
                self.lose(c, "process died")
        return bool(events)

    def drain(self, c: _Child) -> None:
        while True:
            try:
                if not c.conn.poll():
                    return
                msg = c.conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "rows":
                for row, tensors in msg[1]:
                    self.ledger.add(row, tensors)
            elif kind == "ready":
                self.ready.add(c.index)
            elif kind in ("saved", "flushed"):
                self.replies.add(c.index)
            elif kind == "finished":
                c.finished = True
                self.finished.append(c.index)
            elif kind == "diverged":
                self.diverged = msg[1]
                c.finished = True  # it has stopped and will send nothing more (not counted as finished)
            elif kind == "error":
                self.lose(c, f"raised {msg[1]}")

    def record(self) -> None:
        self.ledger.record()

    def fill_gaps(self, upto: int) -> None:
        """(once every live worker has sent its rows: at a checkpoint, and at the end)"""
        self.ledger.fill_gaps(upto)

    def take_turn(self) -> bool:
        """Take the server's turn, waiting in line like a worker while reading rows and watching for the
        dead (`lose` hands a dead holder's turn on). False, out of line again, if it did not come in time."""
        return self.turn.acquire(self.me, self._waiting, timeout=TURN_TIMEOUT_S)

    def _waiting(self) -> None:
        self.poll(0)
        self.record()

    def release_turn(self) -> None:
        self.turn.release(self._waiting)

    def collect(self, action: int, reply: str, stop_on_divergence: bool = True) -> None:
        """(holding the turn) Ask every active worker to SAVE or FLUSH and wait for each one's reply; a worker
        that does not answer in time is lost."""
        self.replies = set()
        want = {c.index for c in self.active()}
        self.turn.ask(want, action, self._waiting)
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while not (stop_on_divergence and self.diverged):
            missing = [c for c in self.active() if c.index in want and c.index not in self.replies]
            if not missing:
                break
            if time.monotonic() > deadline:
                for c in missing:
                    self.lose(c, f"did not answer a {reply} request within {TURN_TIMEOUT_S:.0f} s")
                break
            self.poll(POLL_S)
            self.record()
        self.poll(0)

    def flush_all(self, stop_on_divergence: bool = True) -> None:
        """Every live worker sends the rows it holds; commits with no row left are those of lost workers and
        get a row that says so. Needed after a loss (else recording, and the evaluations and checkpoints
        that follow it, would wait at the first missing row until the end) and before stopping early."""
        self.need_sync = False
        if not self.take_turn():
            return
        try:
            self.collect(FLUSH, "flushed", stop_on_divergence)
            self.fill_gaps(int(self.clock))
        finally:
            self.release_turn()

    def snapshot_eval(self) -> None:
        if not self.take_turn():
            return
        try:
            step, theta = int(self.clock), self.theta.clone()
        finally:
            self.release_turn()
        if not finite(theta):
            self.diverged = self.diverged or f"non-finite central variable at commit {step}"
            return
        self.recorder.eval(self.evaluate(theta, step, self.t0))

    def checkpoint(self) -> None:
        job = self.job
        base = Path(job.run_dir) / CHECKPOINT
        pending = base / "pending"
        shutil.rmtree(pending, ignore_errors=True)
        pending.mkdir(parents=True)
        if not self.take_turn():
            return
        try:
            step = int(self.clock)
            if not finite(self.theta):
                self.diverged = self.diverged or f"non-finite central variable at commit {step}"
                return
            self.collect(SAVE, "saved")  # every live worker sends its rows, then writes its state
            if self.diverged:
                return
            self.fill_gaps(step)
            self.recorder.flush()  # the rows up to the checkpoint are on disk before it is named
            name = f"step-{step:09d}"
            save_atomic({"theta": self.theta, "server": dict(self.server), "step": step,
                         "finished": self.finished, "lost": self.lost, "lost_workers": self.lost_workers()},
                        pending / "central.pt")
            shutil.rmtree(base / name, ignore_errors=True)
            os.replace(pending, base / name)
            write_manifest(job.run_dir, step, name, job, {"time_s": time.perf_counter() - self.t0})
            for old in base.glob("step-*"):  # the manifest names the new one now
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
        finally:
            self.release_turn()

    def serve(self) -> Result:
        job = self.job
        if job.resume is None:
            self.recorder.eval(self.evaluate(self.theta, 0, self.t0))
        started = time.monotonic()
        while self.active():
            waiting_for_start = len(self.ready) < len(self.children)
            timeout = START_TIMEOUT_S if waiting_for_start else TURN_TIMEOUT_S
            if not self.poll(timeout):
                why = "did not start" if waiting_for_start else "sent nothing"
                if not waiting_for_start or time.monotonic() - started >= START_TIMEOUT_S:
                    return Result("failed", self.steps, reason=f"workers {why} for {timeout:.0f} s")
            if not self.started and all(c.index in self.ready or c.lost for c in self.children):
                self.started = True
                self.release_turn()  # every worker has copied θ: the race begins
            self.record()
            if self.diverged:
                self.flush_all(stop_on_divergence=False)
                return Result("diverged", self.steps, reason=self.diverged)
            if self.need_sync and self.started and self.active():
                self.flush_all()
            if self.steps >= self.next_eval:
                self.next_eval = (self.steps // job.eval_every + 1) * job.eval_every
                self.snapshot_eval()
            if self.next_checkpoint is not None and self.steps >= self.next_checkpoint:
                self.next_checkpoint = (self.steps // job.checkpoint_every + 1) * job.checkpoint_every
                self.checkpoint()
            if self.diverged:
                self.flush_all(stop_on_divergence=False)
                return Result("diverged", self.steps, reason=self.diverged)
        for c in self.children:  # what the last workers sent before they exited
            self.drain(c)
        self.fill_gaps(int(self.clock))
        return conclude(self.recorder, self.evaluate, self.theta, self.steps, self.t0, diverged=self.diverged,
                        finished=bool(self.finished), lost=self.lost, extra={"lost_workers": self.lost_workers()})
