"""The coordinator: the bookkeeping of a run, the same on every engine.

It puts commit rows in clock order (`Ledger`), evaluates the central variable every `eval_every` commits,
writes a checkpoint every `checkpoint_every` commits (and removes it once the run has completed: a completed
run cannot be resumed), keeps track of finished and lost workers, and ends the run: completed, diverged or
failed. It lives in the process that writes the run directory: the sim engine's only process, the process
engine's parent, rank 0 of the distributed engine.

An engine with real workers subclasses it and supplies the transport: `poll` (read what the workers sent),
`watch` (notice the dead, and the silent by the one rule of `Silence`), `snapshot` (θ and its clock, read under
the server's turn), `checkpoint` (every live worker's state at one clock, then `write_checkpoint`), `sync` (after
a loss: make sure the rows of the lost worker's commits are known) and `wrap_up`. `serve` is the loop they share.
The sim engine calls the bookkeeping directly, one commit at a time.

Every evaluation row (eval.parquet) carries `worker_step` beside `step` (t): the mean number of local steps per
worker at that clock, t·λ/n, with λ the algorithm's commit boundary (`commit_every`) and n the job's workers; a
float (t·λ/n need not be whole), equal to t for one worker committing every step. It puts the evaluations on the
x axis of the commit rows' `worker_step` (the committing worker's own local step count), so that evaluation
curves can be drawn against worker steps like the loss curves. It counts the commits applied, spread evenly over
the n workers: a run that lost workers did more steps per surviving worker than it says.
"""

from __future__ import annotations

import heapq
import shutil
import statistics
import time
from collections import deque
from pathlib import Path

import torch

from gem.engines import Result
from gem.engines import checkpoint as ckpt
from gem.engines.core import commits_per_worker, finite, stopped_by
from gem.engines.options import EngineOptions, ProcessOptions
from gem.engines.server import Server

POLL_S = 0.5  # how often the loop looks at the workers when nothing arrives


def start_server(job, algo, theta: torch.Tensor, server: Server | None = None) -> tuple[Server, dict | None]:
    """The parameter server at the start of a run: θ₀ (`theta`), or the state of the checkpoint that `resume`
    continues, once it is checked against this job. Returns (server, the checkpoint's central state or None).
    `server`: one made around `theta` already (several servers: gem.engines.distributed.shards.Sharded)."""
    server = server or Server.create(algo, job.hp, theta, job.workers)
    if job.resume is None:
        return server, None
    ckpt.check_resumable(job.resume, job)
    resumed = ckpt.load_central(job.resume)
    server.load_state_dict(resumed)
    return server, resumed


class Silence:
    """A silent worker is a lost worker: the one rule, for every engine with real workers, that says when a worker
    that is alive but makes no progress (frozen, hung) is given up for lost.

    A worker is silent when it has not made progress for longer than

        limit = max(engine.timeout_s, engine.silent_cycles x the median time between two commits of a worker)

    The median cycle (pooled over the workers, the last `samples` cycles) follows the run's own pace: a windowed
    algorithm, a large model or a loaded machine commit less often, and get a longer limit; `timeout_s` is the
    floor. Before the first cycle is known, the limit is the floor.

    It is fed observations, in seconds on any one clock: `progress(w, at)`, a commit of w at `at` (a cycle
    sample: the time since w's previous commit); `seen(w, at)`, w is known not to be silent through its own fault
    at `at` (it committed, though when exactly is not known; or it waits for the server's turn behind another
    worker): its silence starts again, and no cycle is sampled. `start` (the race starts, or restarts on a resumed
    run) starts every worker's timer; `forget` stops watching a worker that finished or was lost.
    """

    def __init__(
        self,
        timeout_s: float = ProcessOptions.timeout_s,
        cycles: float = ProcessOptions.silent_cycles,
        samples: int = 1024,
    ):
        self.floor, self.cycles = float(timeout_s), float(cycles)
        self.gaps: deque[float] = deque(maxlen=samples)
        self.committed: dict[int, float] = {}  # each watched worker's last commit
        self.since: dict[int, float] = {}  # when its current silence began

    @classmethod
    def of(cls, engine: EngineOptions) -> Silence:
        """The rule with a job's `engine.timeout_s` and `engine.silent_cycles` (the sim engine's workers are never
        silent: its defaults, unused)."""
        if isinstance(engine, ProcessOptions):
            return cls(engine.timeout_s, engine.silent_cycles)
        return cls()

    def start(self, workers, now: float) -> None:
        for w in workers:  # (the time to a worker's first commit is no cycle: it may have waited for the start)
            self.since[w] = now
            self.committed.pop(w, None)

    def progress(self, w: int, at: float) -> None:
        if w not in self.since:
            return  # not watched (yet, or any more)
        prev = self.committed.get(w)
        if prev is None or at > prev:
            if prev is not None:
                self.gaps.append(at - prev)
            self.committed[w] = at
        self.since[w] = max(self.since[w], at)

    def seen(self, w: int, at: float) -> None:
        if w in self.since:
            self.since[w] = max(self.since[w], at)

    def forget(self, w: int) -> None:
        self.committed.pop(w, None)
        self.since.pop(w, None)

    def watched(self) -> list[int]:
        return sorted(self.since)

    def median(self) -> float | None:
        return statistics.median(self.gaps) if self.gaps else None

    def limit(self) -> float:
        m = self.median()
        return self.floor if m is None else max(self.floor, self.cycles * m)

    def silent(self, now: float) -> list[tuple[int, float]]:
        """(worker, seconds silent) of every watched worker silent for longer than the limit."""
        limit = self.limit()
        return [(w, now - s) for w, s in sorted(self.since.items()) if now - s > limit]

    def why(self, silent_for: float, what: str = "silent") -> str:
        """The reason, for the log line and the summary: 'silent for 12.3 s, limit 10.0 s = max(engine.timeout_s,
        10 x median cycle 0.05 s)'."""
        m = self.median()
        cycle = f"median cycle {m:.3g} s" if m is not None else "median cycle not known yet"
        return (
            f"{what} for {silent_for:.1f} s, limit {self.limit():.1f} s = max(engine.timeout_s, "
            f"{self.cycles:g} x {cycle})"
        )


def tensor_rows(row: dict, names: list[str], tensors: dict[str, list[float]] | None) -> list[dict] | None:
    """A commit's per-tensor diagnostics (`Algorithm.diagnostics`) as long rows for tensors.parquet."""
    if not tensors:
        return None
    return [
        {
            "step": row["step"],
            "worker": row["worker"],
            "tensor": name,
            "tensor_index": i,
            **{k: v[i] for k, v in tensors.items()},
        }
        for i, name in enumerate(names)
    ]


class Ledger:
    """Records commit rows in clock order, though they arrive out of order (each worker sends its own rows,
    in batches). A commit whose worker was lost before it sent the row gets a row that says so (`lost_row`),
    so that the clock in metrics.parquet has no gap."""

    def __init__(self, recorder, tensor_names: list[str], steps: int = 0, last_time: float = 0.0):
        self.recorder, self.tensor_names = recorder, tensor_names
        self.rows: list = []  # heap of (step, tiebreak, row, tensors) not yet recorded
        self.steps = steps  # the last step recorded
        self.last_time = last_time  # its time_s

    def add(self, row: dict, tensors=None) -> None:
        if row["step"] <= self.steps:  # recorded already, or marked lost (a lost worker's late row): drop it
            return
        heapq.heappush(self.rows, (row["step"], id(row), row, tensors))

    def lost(self, step: int) -> None:
        """The commit at `step` was applied but its row will never come: its worker is gone."""
        self.add(
            {
                "step": step,
                "worker": -1,
                "worker_step": -1,
                "staleness": -1,
                "loss": float("nan"),
                "time_s": None,
                "lost_row": True,
            }
        )

    def record(self) -> None:
        """Record the rows that are next in clock order."""
        while self.rows and self.rows[0][0] == self.steps + 1:
            step, _, row, tensors = heapq.heappop(self.rows)
            if row.get("lost_row"):
                row["time_s"] = self.last_time  # no later than the rows around it
            self.recorder.commit(row, tensor_rows(row, self.tensor_names, tensors))
            self.steps, self.last_time = step, row["time_s"]

    def fill_gaps(self, upto: int) -> None:
        """Once every live worker has sent its rows, a commit up to `upto` without a row was made by a worker
        that died before sending it: record a row that says so."""
        while self.steps < upto:
            self.record()
            if self.steps < upto and not (self.rows and self.rows[0][0] == self.steps + 1):
                self.lost(self.steps + 1)


class Coordinator:
    def __init__(self, job, recorder, server: Server, evaluate, resumed: dict | None = None):
        self.job, self.recorder, self.server, self.evaluate = job, recorder, server, evaluate
        past = (resumed or {}).get("coordinator", {})
        self.finished: list[int] = list(past.get("finished", []))
        self.lost: list[str] = list(past.get("lost", []))  # why each worker was lost, for the summary's reason
        self.lost_workers: list[int] = list(past.get("lost_workers", []))
        self.silence = Silence.of(job.engine)  # started by an engine with real workers when its race starts
        self.diverged = ""
        self.sim_capped = False  # the sim engine stopped its workers at budget.sim_time
        self.sim_time: float | None = None  # the sim engine's simulated clock at the last commit, for eval rows
        self.resumed = resumed is not None
        # one origin for time_s: workers stamp with the wall clock, the evaluations with perf_counter; a resumed
        # run carries on its clock, so that time_s keeps increasing
        elapsed = float(job.resume.get("time_s", 0.0)) if job.resume else 0.0
        self.t0_wall, self.t0 = time.time() - elapsed, time.perf_counter() - elapsed
        self.ledger = Ledger(recorder, evaluate.model.tensor_names, server.t, last_time=elapsed)
        self.window = server.algo.commit_every(job.hp)  # λ: an evaluation's worker_step is t·λ/n
        every, ck = job.eval_every, (job.checkpoint_every if job.run_dir else 0)
        self.next_eval = (self.steps // every + 1) * every
        self.next_checkpoint = (self.steps // ck + 1) * ck if ck else None

    @property
    def steps(self) -> int:  # the last commit recorded
        return self.ledger.steps

    def now(self) -> float:
        return time.time() - self.t0_wall

    def pending_workers(self) -> list[int]:
        """Workers that still have work: neither finished nor lost (before the checkpoint a run resumes from)."""
        return [w for w in range(self.job.workers) if w not in self.finished and w not in self.lost_workers]

    # --- bookkeeping

    def start(self) -> None:
        if not self.resumed:
            self.record_eval(0, self.server.theta)

    def lose(self, w: int, why: str) -> bool:
        """Record worker w as lost; False if it had finished or was lost already."""
        if w in self.lost_workers or w in self.finished:
            return False
        msg = f"worker {w} lost at commit {self.server.t} ({why})"
        self.lost.append(msg)
        self.lost_workers.append(w)
        self.silence.forget(w)
        print(f"gem: {msg}; the run goes on with the others", flush=True)
        return True

    def finish(self, w: int) -> None:
        if w not in self.finished:
            self.finished.append(w)
        self.silence.forget(w)

    def diverge(self, why: str) -> None:
        self.diverged = self.diverged or why

    def evaluate_at(self, step: int, theta: torch.Tensor) -> None:
        if not finite(theta):
            self.diverge(f"non-finite central variable at commit {step}")
            return
        self.record_eval(step, theta)

    def record_eval(self, step: int, theta: torch.Tensor) -> None:
        """Evaluate θ as of commit `step` and record the row, with its worker_step (the module's docstring)."""
        extra = {} if self.sim_time is None else {"sim_time": self.sim_time}
        self.recorder.eval(
            self.evaluate(theta, step, self.t0, worker_step=step * self.window / self.job.workers, **extra)
        )

    # Both follow the server's clock, not the recorded rows: rows arrive in batches, and an evaluation should be
    # taken when its commit is applied, not when its row is recorded.
    def evaluation_due(self) -> bool:
        t = self.server.t
        if t < self.next_eval:
            return False
        self.next_eval = (t // self.job.eval_every + 1) * self.job.eval_every
        return True

    def checkpoint_due(self) -> bool:
        t = self.server.t
        if self.next_checkpoint is None or t < self.next_checkpoint:
            return False
        ck = self.job.checkpoint_every
        self.next_checkpoint = (t // ck + 1) * ck
        return True

    def write_checkpoint(self, folder, step: int, engine_state: dict | None = None) -> None:
        """Every worker's file is in `folder` and θ is as of `step`: flush the rows, write central.pt, name it."""
        if not finite(self.server.theta):
            self.diverge(f"non-finite central variable at commit {step}")
            return
        self.ledger.record()
        self.recorder.flush()  # the rows up to the checkpoint are on disk before it is named
        central = {
            **self.server.state_dict(),
            "engine": engine_state or {},
            "coordinator": {"finished": self.finished, "lost": self.lost, "lost_workers": self.lost_workers},
        }
        ckpt.finish(self.job.run_dir, folder, step, central, self.job, time.perf_counter() - self.t0)

    def conclude(self, extra: dict | None = None) -> Result:
        """The end: diverged, failed (no worker finished) or completed, with a final evaluation of the central
        variable unless one was taken at this very commit."""
        extra = {"lost_workers": sorted(self.lost_workers), **(extra or {})}
        steps, theta = self.steps, self.server.theta
        if self.diverged:
            return Result("diverged", steps, reason=self.diverged, extra=extra)
        if not finite(theta):
            return Result("diverged", steps, reason=f"non-finite central variable at commit {steps}", extra=extra)
        if not self.finished:
            return Result("failed", steps, reason="; ".join(self.lost) or "no worker finished", extra=extra)
        full = steps >= self.job.workers * commits_per_worker(self.job, self.window)  # every worker's whole length
        extra["stopped_by"] = stopped_by(self.job, steps, self.now(), self.sim_capped, full)
        if self.recorder.last_eval is None or self.recorder.last_eval["step"] != steps:
            self.record_eval(steps, theta)
        extra.update(self.evaluate.test(theta))
        if self.job.run_dir:
            shutil.rmtree(Path(self.job.run_dir) / ckpt.CHECKPOINT, ignore_errors=True)
        return Result("completed", steps, reason="; ".join(self.lost), extra=extra)

    # --- the loop of an engine with real workers

    def serve(self) -> Result:
        self.start()
        while self.running():
            self.look_after(POLL_S)
            if self.diverged:
                break
            self.sync()
            if self.evaluation_due():
                taken = self.snapshot()
                if taken is not None:
                    self.evaluate_at(*taken)
            if self.checkpoint_due():
                self.checkpoint()
            if self.diverged:
                break
        return self.wrap_up()

    def look_after(self, timeout: float) -> None:
        """Read what the workers sent (for up to `timeout` s), record it, and lose the dead and the silent."""
        self.poll(timeout)
        self.ledger.record()
        self.watch()

    def wait_on(self, attempt, timeout_s: float | None = None, give_up=None):
        """The one way a coordinator waits on what it shares with its workers (the server's turn): `attempt()`, one
        bounded try (turn.Ticket.step, Turn.try_release, ...: None until it succeeds), again and again, and between
        two tries the workers looked after (`look_after`), which may lose one and take back its turn
        (Turn.recover), never from inside a wait of the turn's. Returns what the attempt returned, or None after
        `timeout_s`, or once `give_up()` says so."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (done := attempt()) is None:
            self.look_after(0)
            if (give_up is not None and give_up()) or (deadline is not None and time.monotonic() > deadline):
                return None
        return done

    # engine hooks
    def running(self) -> bool: ...
    def poll(self, timeout: float) -> None: ...
    def watch(self) -> None: ...
    def sync(self) -> None: ...
    def snapshot(self) -> tuple[int, torch.Tensor] | None: ...
    def checkpoint(self) -> None: ...
    def wrap_up(self) -> Result: ...
