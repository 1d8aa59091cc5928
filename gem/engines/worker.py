"""One worker's cycle, the same on every engine (docs/design.md, "Engines").

A worker repeats: a gradient of the loss at its local copy x on its next mini-batch; a local step if that gradient
does not end the algorithm's window (no server involved); else the commit, under the server's turn:

    view = link.acquire(w)                       # the turn: the live θ, the server tensors, t, τ
    commit = worker_rule(state, x, grad, view)   # only what the commit needs
    link.submit(view, commit)                    # distributed: the commit travels to the server
    link.server.apply(view, commit)              # server_rule, t ← t + 1 (on the worker's replica, if remote)
    pull: x ← θ                                  # unless the commit says otherwise (EASGD)
    link.release()
    diagnostics, the commit row                  # after the turn: GEM's π statistics cost the others nothing

On engine=distributed over the wire, a rule that reads θ and declares the part that does to run at the server
(`Algorithm.at_server`; the link then has `at_server`) runs there: the worker sends what the part declares
(`link.commit_at_server`) where it would run the rule, and the commit comes back made, θ (or the commit's delta,
which the part's `finish` applies here) with it, and its metrics and statistics, computed there.

A commit with a barrier (`Commit.pull_at`, synchronous SGD's round) defers the pull: before its next gradient the
worker waits until the server's clock has reached pull_at (`link.await_clock`; on `process` it holds the turn while
it copies θ), and pulls. The sim engine parks such a worker and pulls it at the commit that reaches its barrier.

An engine supplies only the `Link`: how the turn is taken, where the server's state lives, how rows travel.
So the data stream, the random streams, the device, the row and the checkpointed state are the same everywhere,
and with one worker every engine gives the same losses.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import os
import signal
import threading
import time
from typing import Protocol

import torch

from gem.algorithms import Algorithm, Commit, View
from gem.data import WorkerStream
from gem.engines.core import build_flat_model, capped, device_of, worker_steps
from gem.engines.pinned import Pinned, pinned_for
from gem.engines.server import Server
from gem.models import FlatModel

# What every engine's worker processes keep to (process, distributed), defined here once:
START_TIMEOUT_S = 300.0  # a worker's start: it unpickles its job (process) or imports torch, loads the data and
# connects (distributed), and builds its model, slow on a loaded machine with many workers; one not ready after this
# long is lost, and the others start without it
# a worker sends its commit rows in batches of this many, or what it holds once this long has passed: each message
# wakes the coordinator, which on a machine with as many workers as cores takes CPU from a worker. Over the
# distributed engine's wire a worker sends them with its ASK once it holds this many, and with any other header at
# once: so no message carries more, and no more of its commits than that await their rows but briefly
ROWS_PER_MESSAGE, ROWS_SECONDS = 16, 0.25
STOP_GRACE_S = 5.0  # a worker process asked to stop, or answered at the end of the run, has this long to exit; then
# it is terminated, and killed if it is still there EXIT_WAIT_S later
EXIT_WAIT_S = 2.0  # how long a terminated or killed worker process is waited for


class Diverged(Exception):
    """A non-finite loss: the run stops with status diverged."""


class Link(Protocol):
    """How a worker reaches the parameter server; each engine has one."""

    server: Server  # where the server step runs: the live server, or (distributed) the worker's replica of it
    extra: dict  # engine-specific fields for the next commit row (process: wait_commits; sim: sim_time)

    def acquire(self, worker: int) -> View: ...  # wait for the server's turn; a view of the live θ
    def submit(self, view: View, commit: Commit) -> None: ...  # send the commit, where the server is remote
    def release(self) -> None: ...  # hand the turn on
    def now(self) -> float: ...  # seconds since the run started, for time_s
    def clock(self) -> float: ...  # what a worker's pace is measured on: the simulated time of the commit on sim,
    # now() elsewhere (optional: now() stands in)
    def rows(self, row: dict, tensors: dict | None) -> None: ...  # a commit row, on its way to the recorder
    def await_clock(self, worker: int, t: int) -> View: ...  # a view of θ once the server's clock has reached t,

    # held until release (process: the turn); the worker pulls then (the server marks the pull: server.pull)
    # (optional, distributed over the wire) `at_server`: the part of the rule run at the server, or None; then
    # commit_at_server(view, sent) -> (the commit made there, its per-tensor statistics)


# ------------------------------------------------------------------------------------ one worker process


def threads_per_process(processes: int) -> int:
    """floor(cores / processes), at least 1 (docs/design.md), and at most OMP_NUM_THREADS where it is set: the cap on
    torch's threads that torch itself honours in a process that sets none (the sim engine's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, processes))
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(cap)) if cap.isdigit() and int(cap) >= 1 else threads


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap() -> None:
    """Stop glibc from returning the heap to the kernel after every step.

    A step's activations are freed at its end; glibc then trims the top of the heap, and the next step faults the
    same pages back in, zero-filled: about 1,000 page faults per `mnist_cnn` step, which made each gradient 30%
    slower in a worker process (BENCHMARKS.md). A process that happened to free a large block early (loading a
    dataset) has raised glibc's adaptive thresholds and does not trim; a worker that maps its data from shared
    memory never does. Fixing the thresholds keeps the heap at its working size. Elsewhere than glibc: nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's upper limit: blocks up to 32 MB come from the heap
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


def uses_torchvision(job) -> bool:
    """Whether the job's model is built with torchvision (resnet18_cifar, or a `_target_` in torchvision): its
    workers then find torchvision imported in the forkserver. A model of the user's own that imports torchvision
    inside still works; each of its workers imports torchvision itself."""
    import json

    model = job.model
    if isinstance(model, str):  # a built-in model's name
        return model == "resnet18_cifar"
    return (
        model.name == "resnet18_cifar"
        or "torchvision" in model.factory
        or "torchvision" in json.dumps(model.kwargs, default=str)
    )


def worker_context(job=None):
    """The multiprocessing context that starts worker processes (process, and distributed's local launch): forked
    from a forkserver that has imported torch and gem once (gem.engines.preload), so that a worker holds only what
    it computes with (BENCHMARKS.md, "Lean worker processes"). The forkserver is a fresh process, started once per
    coordinating process and kept for its later runs: no worker is forked from a parent that runs threads (the
    coordinator may run W&B's, or tqdm's). Where there is no forkserver (Windows): spawn.

    A forked worker's parent is the forkserver, which outlives the coordinator while workers are left, so
    `multiprocessing.parent_process()` cannot tell a worker that the coordinator is gone: the engine gives each
    worker the read end of a pipe whose write end only the coordinator holds, and which reads end of file once the
    coordinator has exited.

    The forkserver's imports are fixed when it starts (with this process's first run): torchvision is among them
    when that run's model uses it (`uses_torchvision`)."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    import torch.multiprocessing as tmp

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return tmp.get_context("spawn")
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(["gem.engines.preload"] + (["torchvision"] if job and uses_torchvision(job) else []))
    # started here with Ctrl-C blocked, which it inherits (a blocked signal stays blocked across fork and exec): a
    # terminal's Ctrl-C reaches the whole process group, and the forkserver, which ignores it only once it has
    # imported torch (seconds), died of it with a traceback under the coordinator's own lines. There it waits,
    # pending, until the forkserver ignores it, which discards it. Here it is held (interrupts_held: the mask is
    # this thread's only, and the kernel gives a process's signal to any thread not blocking it) and acted on once
    # the forkserver is recorded: raised inside ensure_running, it left a forkserver nobody knew of, and a notebook
    # kernel started a second. Ignoring it here instead, as before, lost it: the run went on (seen on a loaded
    # machine). multiprocessing's resource tracker, which the forkserver needs, starts first: it blocks Ctrl-C for
    # its own start the same way, but unblocks it after (Python 3.11), which would end this block early. A
    # forkserver running already is kept
    multiprocessing.resource_tracker.ensure_running()
    with interrupts_held():
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") else None
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return ctx


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C and SIGTERM wait until the block is done, then do what they would have done (their Python handlers;
    a second one acts at once). For starting a worker and recording it: `Process.start` waits for the forkserver,
    which imports torch first (seconds), and interrupted there the coordinator exited without knowing of the child
    the forkserver made next, which ran on alone (or, its semaphores gone, printed a traceback under the run's last
    line: every Ctrl-C or SIGTERM in the first seconds of a run on this machine)."""
    held: list = []

    def hold(signum, frame):
        held.append((signum, frame))
        if len(held) > 1:  # asked twice: leave now (and the first is not acted on again below)
            old[signum](signum, frame)

    old = {}
    if _main_thread():  # (where Python handles signals)
        for s in (signal.SIGINT, signal.SIGTERM):
            if callable(handler := signal.getsignal(s)):  # a default or ignored signal is left as it is
                old[s] = handler
                signal.signal(s, hold)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if len(held) == 1:
            old[held[0][0]](*held[0])


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def setup_process(threads: int, ignore_sigint: bool = True) -> None:
    """The start of every worker process: its torch threads, its heap, and Ctrl-C left to the coordinator (a
    terminal's Ctrl-C reaches the whole process group; the coordinator stops its workers itself)."""
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # a worker forked from the forkserver inherits its blocked Ctrl-C
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    torch.set_num_threads(threads)
    keep_heap()


# ------------------------------------------------------------------------------------------ the worker


def to_device(commit: Commit, device: torch.device, pinned: Pinned | None = None) -> Commit:
    """The commit's tensors for the server rule, on the server's device (the same commit when already there);
    to the host through `pinned`'s page-locked buffers where a GPU worker has them (overwritten at its next commit:
    the server has applied this one by then). `aux` stays: diagnostics run on the worker."""
    if commit.delta.device == device:
        return commit
    if pinned is not None and device.type == "cpu":
        delta = pinned.out("delta", commit.delta).copy_(commit.delta)
        payload = {k: pinned.out(f"payload.{k}", v).copy_(v) for k, v in commit.payload.items()}
    else:
        delta, payload = commit.delta.to(device), {k: v.to(device) for k, v in commit.payload.items()}
    return dataclasses.replace(commit, delta=delta, payload=payload)


def on_host(tensors: dict[str, torch.Tensor], pinned: Pinned | None = None) -> dict[str, torch.Tensor]:
    """`tensors` in host memory, for the wire: as they are where they are there; from a GPU through `pinned`'s
    page-locked buffers where the worker has them (overwritten at its next commit, once these have been sent)."""
    out = {}
    for k, v in tensors.items():
        if v.device.type == "cpu":
            out[k] = v
        elif pinned is not None:
            out[k] = pinned.out(f"sent.{k}", v).copy_(v)
        else:
            out[k] = v.to("cpu")
    return out


def barrier_pauses(first: float = 0.0005, most: float = 0.02):
    """The pauses of a worker looking for the clock to reach its barrier (process, distributed): doubling from
    0.5 ms to 20 ms, so a short wait is noticed soon and a long one costs the others little."""
    pause = first
    while True:
        yield pause
        pause = min(2 * pause, most)


def dropout_seed(seed: int, worker: int) -> int:
    # distinct from the data stream's seed (gem.data), so that the two streams are not the same numbers
    return (seed * 1_000_003 + 7919 * (worker + 1)) % (2**63)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class Worker:
    """One worker: its local copy x, algorithm state, data stream and random stream, and its cycle.

    `model` is where gradients are computed (the sim engine's virtual workers share one); `x` holds θ₀ when the
    worker is built (the model's own parameters, where a worker has the model to itself).
    """

    def __init__(self, w: int, job, algo: Algorithm, model: FlatModel | None = None, x: torch.Tensor | None = None):
        self.w, self.job, self.algo, self.hp = w, job, algo, job.hp
        self.device = device_of(job, w)
        self.model = model if model is not None else build_flat_model(job, self.device)
        self.x = self.model.param if x is None else x
        self.layout = self.model.layout
        self.state = algo.init_state(self.x, self.hp)
        self.data = job.data
        self.stream = WorkerStream(len(self.data.train_y), job.batch_size, job.seed, w)
        # dropout draws from the default generator: each worker swaps its own state in around its gradient, so the
        # draws depend on the worker alone, not on who else runs in the process (sim) or how often models are built
        seeded = torch.Generator(self.device).manual_seed(dropout_seed(job.seed, w))
        self.rng = seeded.get_state()
        self.window = algo.commit_every(self.hp)
        self.budget = worker_steps(job)
        self.capped = bool((job.budget or {}).get("commits") or (job.budget or {}).get("seconds"))
        self.step = 0  # local gradients taken
        self.loss_sum, self.local = 0.0, 0  # since the last commit
        self.before: dict = {}  # the state before the gradient in hand (for a checkpoint taken at the turn)
        self.pull_at = -1  # a barrier this worker waits at before its next gradient (Commit.pull_at); −1: none
        self.pace = 0.0  # its local steps per unit of link.clock() since its first commit (0: not yet measured)
        self.paced_from: tuple[int, float] | None = None  # (its steps, link.clock()) at its first commit
        self._stage: dict | None = None  # the server's tensors on this worker's device, if they live elsewhere
        # a GPU worker whose θ stays in host memory copies it through page-locked memory (pinned.py)
        self._pinned = pinned_for(self.device, f"worker {w}")

    def gradient(self) -> float:
        _set_rng_state(self.rng, self.device)
        xb, yb = self.data.batch(self.stream.next_indices(), self.stream.generator)
        # the data stays where the engine put it (shared host memory, or the sim engine's device): the batch moves
        xb, yb = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        self.model.load(self.x)
        loss = self.model.loss_and_grad(xb, yb)
        self.rng = _rng_state(self.device)
        return loss

    def cycle(self, link: Link) -> bool:
        """Local steps up to the commit boundary, then the commit. False once the budget is spent (a window cut
        short by the end of the budget commits nothing)."""
        while self.step < self.budget:
            if self.capped and capped(self.job, link.server.t, link.now()):
                return False  # budget.commits or budget.seconds reached: no new gradient
            if self.pull_at >= 0:
                self.await_pull(link)
            k = (self.local + 1) % self.window  # this gradient's place in its window; 0: it ends the window
            if k == 0:
                self.before = self._progress()
            loss = self.gradient()
            self.step += 1
            self.loss_sum += loss
            self.local += 1
            if not math.isfinite(loss):
                raise Diverged(f"non-finite loss {loss} at worker {self.w}, worker step {self.step}")
            if k:
                self.algo.local_step(self.state, self.x, self.model.grad, self.hp, k)
                continue
            self.commit(link)
            return True
        return False

    def commit(self, link: Link) -> None:
        # distributed over the wire: the part of the rule that reads θ runs where θ lives (Algorithm.at_server), and
        # the commit comes back made, with its metrics and statistics (its prepare runs there too)
        part = getattr(link, "at_server", None)
        if self.algo.prepare is not None and part is None:  # what does not read θ, before the turn
            self.algo.prepare(self.state, self.x, self.model.grad, self.hp)
        # its pace, measured from its first commit on: one cycle's would carry that cycle's noise (a Gamma draw on
        # sim, a loaded machine elsewhere), and the time before the first commit its start (sim staggers the first
        # cycles; a process loads its data). The clock goes on across a resume, as the steps do
        clock = getattr(link, "clock", link.now)()
        if self.paced_from is None:
            self.paced_from = (self.step, clock)
        elif clock > self.paced_from[1]:
            self.pace = (self.step - self.paced_from[0]) / (clock - self.paced_from[1])
        asked = time.monotonic()
        view = link.acquire(self.w)
        tensors = None
        try:
            waited, stamp = time.monotonic() - asked, link.now()  # stamped in turn: times follow the clock
            if part is None:
                staged = self.staged(view)
                staged.window, staged.pace = self.window, self.pace
                commit = self.algo.worker_rule(self.state, self.x, self.model.grad, staged, self.hp)
                # the server gets the commit on its device; the diagnostics below read the one made here, beside aux
                sent = to_device(commit, view.theta.device, self._pinned)
                link.submit(view, sent)
            else:
                sends = part.sends(self.state, self.x, self.model.grad, self.hp)
                commit, tensors = link.commit_at_server(view, on_host(sends, self._pinned))
                sent = commit
            applied = time.perf_counter()
            t = link.server.apply(view, sent)
            applied = time.perf_counter() - applied
            if commit.window is not None:
                if not (isinstance(commit.window, int) and commit.window >= 1):
                    raise ValueError(
                        f"{self.algo.name}: a commit set the next window to {commit.window!r}; it must be an "
                        "integer >= 1"
                    )
                self.window = commit.window
            if commit.pull_at is not None and commit.pull_at > t:
                self.pull_at = commit.pull_at  # a barrier: pull before the next gradient, once t has reached it
            elif commit.pull:
                self.x.copy_(view.theta)
            elif part is not None:  # the rest of the rule, with the commit's delta that came back (EASGD's E)
                part.finish(self.state, self.x, self.model.grad, commit.delta.to(self.device), self.hp)
        finally:
            link.release()
        row = {
            "step": t,
            "worker": self.w,
            "worker_step": self.step,
            "staleness": view.staleness,
            "loss": self.loss_sum / self.local,
            "time_s": stamp,
            "wait_s": waited,
            "apply_s": applied,
            **link.extra,
            **commit.metrics,
        }
        if self.algo.diagnostics is not None and part is None:  # (else computed with the rule, in commit.metrics)
            metrics, tensors = self.algo.diagnostics(commit, self.layout, self.hp)
            row.update(metrics)
        self.loss_sum, self.local = 0.0, 0
        link.rows(row, tensors or None)

    def await_pull(self, link: Link) -> None:
        """Wait at the barrier of the last commit, then pull. A checkpoint taken meanwhile saves this worker as it
        is, barrier included: it has no gradient in hand."""
        self.before = self._progress()
        view = link.await_clock(self.w, self.pull_at)
        try:
            self.x.copy_(view.theta)
        finally:
            link.release()
        self.pull_at = -1

    def staged(self, view: View) -> View:
        """The view on this worker's device. Where the server's tensors live elsewhere (a GPU worker of the
        process engine, whose θ is in shared host memory), the worker rule reads copies of them here, and its
        commit goes back to the server's device (`to_device`): the algorithms never see two devices."""
        if view.theta.device == self.device:
            return view
        if self._pinned is not None:  # once per host tensor: this copy and the pull's then run at PCIe speed
            self._pinned.host({"θ": view.theta, **view.server})
        if self._stage is None:
            self._stage = {
                k: torch.empty_like(v, device=self.device) for k, v in {"theta": view.theta, **view.server}.items()
            }
        theta = self._stage["theta"].copy_(view.theta)
        server = {k: self._stage[k].copy_(v) for k, v in view.server.items()}
        return View(theta, server, view.t, view.staleness, view.worker)

    # --- checkpoints: tensors and numbers only

    def _progress(self) -> dict:
        s = self.stream
        return {
            "step": self.step,
            "loss_sum": self.loss_sum,
            "local": self.local,
            "epoch": s.epoch,
            "pos": s.pos,
            "perm": s.perm,
            "generator": s.generator.get_state(),
            "rng": self.rng,
            "pull_at": self.pull_at,
            "window": self.window,
            "pace": self.pace,
            # numbers only (a distributed worker's state travels as JSON numbers and tensors): −1, not yet
            "paced_from_step": self.paced_from[0] if self.paced_from is not None else -1,
            "paced_from_clock": self.paced_from[1] if self.paced_from is not None else 0.0,
        }

    def state_dict(self, in_hand: bool = False) -> dict:
        """`in_hand`: the worker waits for the turn with a gradient it has not committed yet; its state is then
        as it was before that gradient, which a resumed worker takes again. x and the algorithm state do not
        change while a gradient is taken, so only the stream, the random state and the counters go back."""
        return {"x": self.x, "state": dict(self.state), **(self.before if in_hand else self._progress())}

    def load_state_dict(self, saved: dict) -> None:
        self.x.copy_(saved["x"])
        for k, v in saved["state"].items():
            self.state[k].copy_(v)
        s = self.stream
        s.epoch, s.pos, s.perm = int(saved["epoch"]), int(saved["pos"]), saved["perm"]
        s.generator.set_state(saved["generator"])
        self.rng = saved["rng"]
        self.step, self.loss_sum, self.local = int(saved["step"]), float(saved["loss_sum"]), int(saved["local"])
        self.pull_at = int(saved.get("pull_at", -1))
        self.window = int(saved.get("window", self.window))
        self.pace = float(saved.get("pace", 0.0))
        paced = int(saved.get("paced_from_step", -1))
        self.paced_from = (paced, float(saved["paced_from_clock"])) if paced >= 0 else None
