"""The `distributed` engine: the parameter server is rank 0 of a torch.distributed group, the workers are the
other ranks, on one machine or many, over TCP (DESIGN §3).

Launch it with torchrun (`torchrun --nproc_per_node=N+1 run.py engine=distributed workers=N`, multi-node
forms in the README), under SLURM with Hydra's submitit launcher, or from one command on one machine:
`python run.py engine=distributed workers=N` spawns the N workers itself, bound to loopback.

Transport: gloo point-to-point (BENCHMARKS.md, "Transport for the distributed engine": against
torch.distributed.rpc it moves an AlexNet commit 2.5x faster, and it serves first come, first served where
rpc's server lock is not first in, first out). Each rank builds its own `ProcessGroupGloo` on the job's store,
so nothing global is touched and several runs can follow one another in one process (a sweep).

One commit is one exchange between a worker and the server, the `process` engine's turn over the wire:

    worker                                   server (rank 0, one exchange at a time)
    ASK [+ its last commit rows]  ─────────▶ takes headers from any source, in arrival order
                                  ◀───────── GO t, the live θ and the algorithm's server tensors
    worker_rule(…, θ, server)
    COMMIT Δ [+ payload]          ─────────▶ τ = t − (t at the worker's pull); server_rule(θ, Δ, τ); t ← t + 1
    server_rule on its copy of θ: the same θ the server now holds; pull.

So a commit costs two model-sized messages, and the algorithms run unchanged: the worker rule sees the live θ
and the server state, exactly as in the process engine, and staleness is measured under the server's clock.
An algorithm with a communication window (`hp.window` = λ) commits on every λ-th local step only; the worker
talks to the server on those steps and runs its other steps alone.

The server's exchanges run on a thread of rank 0; its main thread records rows in clock order, evaluates θ and
watches the workers. A worker lost mid-exchange (its connection closes) or silent for `engine.timeout_s` is
recorded and the run goes on: its commits whose rows never came are marked (`lost_row`). Every wait has a
timeout. gloo aborts the whole group when one of its waits times out, so the server never lets one expire
unless no worker has spoken for `timeout_s`, in which case the run ends. At the end every worker gets an answer
(BYE or STOP) and exits; workers also exit when the server disappears.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from collections import deque

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from gem import algorithms
from gem.algorithms import Commit
from gem.data import WorkerStream, load_dataset
from gem.engines import Job, Result
from gem.engines.core import Evaluator, Ledger, build_flat_model, conclude, finite, worker_steps
from gem.engines.process import threads_per_process

START_TIMEOUT_S = 300.0  # a rank imports torch, loads the data and builds its model before it connects
BYE_TIMEOUT_S = 30.0  # a worker waits this long for the server's last answer
POLL_S = 0.5  # how often the server's main thread looks at the workers
ROWS_PER_MESSAGE, ROWS_SECONDS = 16, 0.25  # a worker sends its commit rows in batches (as in the process engine)

TAG_ASK, TAG_X, TAG_JOB = 1, 2, 3  # worker→server headers (any source); one exchange's messages; the job
# header kinds, worker → server on TAG_ASK
ASK, READY, FINISHED, DIVERGED, ERROR = range(5)
# server → worker, first word of the reply to an ASK or FINISHED
GO, STOP, BYE = range(3)
# worker → server, after GO
COMMIT, NONE = range(2)
HEADER = 4  # int64 words: [kind, rows_nbytes, rows_count, extra_nbytes]


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# ------------------------------------------------------------------------------------- the group


def launched() -> bool:
    """True when a launcher (torchrun, or SLURM through submitit) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def export_submitit_env() -> None:
    """Inside a SLURM job started by Hydra's submitit launcher, set RANK, WORLD_SIZE, MASTER_ADDR, ... from the
    job's environment, as torchrun would. Does nothing elsewhere."""
    if launched() or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    if env.world_size > 1:
        env.export(set_cuda_visible_devices=False)


def _device(host: str | None):
    """gloo's network device: the given address (loopback for a local launch), else, for a multi-node launch,
    the host's own (GLOO_SOCKET_IFNAME picks the interface)."""
    if host:
        return dist.ProcessGroupGloo.create_device(hostname=host)
    return dist.ProcessGroupGloo.create_default_device()


def _group(store, rank: int, world: int, host: str | None, timeout_s: float):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _td(timeout_s)
    opts._devices = [_device(host)]
    return dist.ProcessGroupGloo(dist.PrefixStore("gem/", store), rank, world, opts)


def _launched_group(timeout_s: float):
    """(store, group, rank, world) from the launcher's environment (torchrun's, or submitit's exported)."""
    store, rank, world = next(dist.rendezvous("env://", timeout=_td(timeout_s)))
    single_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    # one node: loopback; several: each rank's own address, so that the others can reach it
    return store, _group(store, rank, world, "127.0.0.1" if single_node else None, timeout_s), rank, world


def _wait(work, timeout_s: float) -> None:
    work.wait(_td(timeout_s))


def _send_bytes(pg, data: bytes, dst: int, tag: int, timeout_s: float) -> None:
    _wait(pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, tag), timeout_s)


def _recv_bytes(pg, nbytes: int, src: int, tag: int, timeout_s: float) -> bytes:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    _wait(pg.recv([buf], src, tag), timeout_s)
    return buf.numpy().tobytes()


def _closed(e: Exception) -> bool:
    """A gloo error that means the peer's connection is gone (it died), not that the group timed out."""
    text = str(e)
    return "Connection closed" in text or "Connection reset" in text or "Broken pipe" in text


# ------------------------------------------------------------------------------------------ worker


def worker_main(timeout_s: float = START_TIMEOUT_S) -> int:
    """A rank > 0 started by torchrun or SLURM: join the group, take the job from rank 0, work, exit."""
    threads = threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    _store, pg, rank, _world = _launched_group(timeout_s)
    return _work(pg, rank, threads)


def _spawned(rank: int, world: int, host: str, port: int, timeout_s: float, threads: int) -> None:
    """A worker of a local launch (`python run.py engine=distributed`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops us
    store = dist.TCPStore(host, port, world, False, timeout=_td(timeout_s))
    pg = _group(store, rank, world, host, timeout_s)
    _work(pg, rank, threads)


def _work(pg, rank: int, threads: int) -> int:
    torch.set_num_threads(threads)
    header = torch.zeros(HEADER, dtype=torch.long)
    _wait(pg.recv([header], 0, TAG_JOB), START_TIMEOUT_S)
    job: Job = pickle.loads(_recv_bytes(pg, int(header[0]), 0, TAG_JOB, START_TIMEOUT_S))
    try:
        _Worker(pg, rank, job).run()
    except _ServerGone:
        return 1
    return 0


class _ServerGone(Exception):
    pass


class _Worker:
    def __init__(self, pg, rank: int, job: Job):
        self.pg, self.rank, self.job = pg, rank, job
        self.w = rank - 1  # the worker's index in metrics.parquet, as in the other engines
        self.timeout = float(job.engine["timeout_s"])
        self.rows: list = []
        self.sent_at = time.monotonic()

    # --- messages to the server; any failure means it is gone
    def _header(self, kind: int, extra: bytes = b"") -> None:
        """A header to the server, with the commit rows not yet sent: always with the last word, else in
        batches, so that most ASKs are one small message."""
        batch = kind != ASK or len(self.rows) >= ROWS_PER_MESSAGE or time.monotonic() - self.sent_at > ROWS_SECONDS
        rows = pickle.dumps(self.rows) if batch and self.rows else b""
        h = torch.tensor([kind, len(rows), len(self.rows) if rows else 0, len(extra)], dtype=torch.long)
        try:
            _wait(self.pg.send([h], 0, TAG_ASK), self.timeout)
            if rows:
                _send_bytes(self.pg, rows, 0, TAG_X, self.timeout)
            if extra:
                _send_bytes(self.pg, extra, 0, TAG_X, self.timeout)
        except RuntimeError as e:
            raise _ServerGone() from e
        if rows:
            self.rows, self.sent_at = [], time.monotonic()

    def _recv(self, tensors: list[torch.Tensor], timeout: float) -> None:
        try:
            for t in tensors:
                _wait(self.pg.recv([t], 0, TAG_X), timeout)
        except RuntimeError as e:
            raise _ServerGone() from e

    def _send(self, tensors: list[torch.Tensor]) -> None:
        try:
            works = [self.pg.send([t], 0, TAG_X) for t in tensors]
            for work in works:
                _wait(work, self.timeout)
        except RuntimeError as e:
            raise _ServerGone() from e

    def run(self) -> None:
        try:
            self._run()
        except _ServerGone:
            raise
        except Exception as e:  # tell the server why, then stop
            self._header(ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc()}".encode())

    def _run(self) -> None:
        job, w = self.job, self.w
        algo = algorithms.get(job.algorithm)
        hp = job.hp
        data = job.data if job.data_source is None else load_dataset(**job.data_source)
        job = dataclasses.replace(job, data=data)
        if len(data.train_y) != job.engine["train_examples"]:
            raise ValueError(f"this rank loaded {len(data.train_y)} training examples of data={data.name}, rank 0 "
                             f"has {job.engine['train_examples']}: every node needs the same data.root")
        model = build_flat_model(job)  # the same seed everywhere: every rank starts from the same θ
        torch.manual_seed(job.seed * 1_000_003 + 7919 * (w + 1))  # this worker's dropout draws
        x = model.param
        theta = x.clone()  # this worker's copy of the live θ, as the server last sent it
        server = algorithms.init_server(algo, theta, hp)
        state = algo.init_state(theta, hp, list(zip(model.tensor_names, model.slices, strict=True)))
        stream = WorkerStream(len(data.train_y), job.batch_size, job.seed, w)
        window = int(getattr(hp, "window", 1))
        t0 = float(job.engine["t0_wall"])
        go = torch.zeros(2, dtype=torch.long)
        pulled_at, loss_sum, local = 0, 0.0, 0
        self._header(READY)
        for step in range(1, worker_steps(job) + 1):
            xb, yb = data.batch(stream.next_indices(), stream.generator)
            loss = model.loss_and_grad(xb, yb)
            loss_sum += loss
            local += 1
            if not math.isfinite(loss):
                self._header(DIVERGED, f"non-finite loss {loss} at worker {w}, worker step {step}".encode())
                return
            if step % window:  # a local step: the worker rule does not read θ between its commits
                if algo.worker_rule(state, x, model.grad, theta, hp, server) is not None:
                    raise RuntimeError(f"algorithm={job.algorithm} committed at local step {step}, off its window "
                                       f"of {window}: the distributed engine talks to the server every window")
                continue
            asked = time.monotonic()
            self._header(ASK)
            self._recv([go], self.timeout)
            if int(go[0]) == STOP:
                return
            self._recv([theta, *server.values()], self.timeout)
            # stamped when the turn came: the server hands turns out one after another, so times follow the clock
            stamp, waited = time.time() - t0, time.monotonic() - asked
            t = int(go[1])
            commit = algo.worker_rule(state, x, model.grad, theta, hp, server)
            if commit is None:
                self._send([torch.tensor([NONE, 0], dtype=torch.long)])
                continue
            spec = pickle.dumps([(k, v.shape, v.dtype) for k, v in commit.payload.items()]) if commit.payload else b""
            tensors = [torch.tensor([COMMIT, len(spec)], dtype=torch.long), commit.delta.contiguous()]
            if spec:
                tensors += [torch.frombuffer(bytearray(spec), dtype=torch.uint8),
                            *(v.contiguous() for v in commit.payload.values())]
            self._send(tensors)
            staleness = t - pulled_at
            # the server applies this commit to the θ it just sent: doing the same here gives the θ it now holds
            algo.server_rule(theta, commit, staleness, hp, server)
            t += 1
            if commit.pull:
                x.copy_(theta)
            pulled_at = t
            self.rows.append(({"step": t, "worker": w, "worker_step": step, "staleness": staleness,
                               "loss": loss_sum / local, "time_s": stamp, "wait_s": waited,
                               **commit.metrics}, commit.tensors or None))
            loss_sum, local = 0.0, 0
        self._header(FINISHED)
        try:  # the server's last word: it has everything; then nobody waits for anybody
            self._recv([go], BYE_TIMEOUT_S)
        except _ServerGone:
            pass


# ------------------------------------------------------------------------------------------ server


class _Server(threading.Thread):
    """Rank 0's exchanges with the workers, one at a time, in the order their headers arrive. Talks to the
    coordinator (the main thread) through `events`; `lock` guards θ, the clock and the bookkeeping."""

    def __init__(self, pg, job: Job, algo, theta, server, workers: list[int], events: queue.Queue):
        super().__init__(name="gem-parameter-server", daemon=True)
        self.pg, self.job, self.algo, self.hp = pg, job, algo, job.hp
        self.theta, self.server, self.events = theta, server, events
        self.timeout = float(job.engine["timeout_s"])
        self.lock = threading.Lock()
        self.t = 0
        self.ranks = workers  # ranks 1..n
        self.pulled_at = dict.fromkeys(workers, 0)
        self.pending: dict[int, deque] = {r: deque() for r in workers}  # commits whose rows have not come
        self.heard = dict.fromkeys(workers, time.monotonic())
        self.ready: set[int] = set()
        self.done: set[int] = set()  # finished, stopped, or lost: the server expects nothing more
        self.lost: set[int] = set()
        self.stopping = ""  # once set, every ASK is answered STOP
        self.delta = torch.empty_like(theta)
        self.started = time.monotonic()
        self.busy_s, self.served = 0.0, 0  # seconds spent in exchanges that ended in a commit, and how many

    def stop(self, why: str) -> None:
        self.stopping = self.stopping or why

    def lose(self, rank: int) -> list[int]:
        """(coordinator) Expect nothing more from `rank`; returns its commits whose rows will never come."""
        with self.lock:
            self.lost.add(rank)
            self.done.add(rank)
            return list(self.pending.pop(rank, ()))

    def open(self) -> bool:
        return len(self.done) < len(self.ranks)

    def run(self) -> None:
        try:
            self.serve()
        except Exception as e:  # noqa: BLE001 - the coordinator reports it
            self.events.put(("fatal", f"parameter server: {type(e).__name__}: {e}"))
        finally:
            self.events.put(("done",))

    def serve(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.long)
        self.early: deque = deque()  # ASKs that came before every worker was ready: all start from θ at t = 0
        while self.open():
            if self.early and (len(self.ready | self.done) == len(self.ranks)
                               or time.monotonic() - self.started > START_TIMEOUT_S):
                self.exchange(self.early.popleft())
                continue
            src = self.next_header(header)
            if src is not None:
                self.take(src, *(int(v) for v in header))

    def next_header(self, header: torch.Tensor) -> int | None:
        """The next worker's header, first come, first served: gloo keeps the notices of pending sends to a
        slot in the order they arrive, and a receive from any source takes the first (recvFromAny in gloo's
        tcp transport). Returns its rank, or None if it died while its header was on the way."""
        work = self.pg.recv_anysource([header], TAG_ASK)
        try:
            _wait(work, self.timeout)
        except RuntimeError as e:
            if _closed(e):
                return None  # the coordinator sees it go
            raise RuntimeError(f"no worker sent anything for {self.timeout:.0f} s (engine.timeout_s)") from None
        return work._source_rank()

    def take(self, src: int, kind: int, rows_nbytes: int, rows_count: int, extra_nbytes: int) -> None:
        """Act on a header from `src`, with the rows and message that follow it."""
        self.heard[src] = time.monotonic()
        try:
            rows = _recv_bytes(self.pg, rows_nbytes, src, TAG_X, self.timeout) if rows_nbytes else b""
            extra = _recv_bytes(self.pg, extra_nbytes, src, TAG_X, self.timeout) if extra_nbytes else b""
        except RuntimeError as e:
            self.gone(src, e)
            return
        with self.lock:
            lost = src in self.lost
            if not lost:
                for _ in range(rows_count):
                    self.pending[src].popleft()
        if lost:  # given up for lost (silent too long) and back: its commits are marked already; it stops
            if kind == ASK:
                self.reply(src, STOP)
            return
        if rows:
            self.events.put(("rows", src, rows))
        if kind == READY:
            self.ready.add(src)
        elif kind == ASK:
            if len(self.ready | self.done) < len(self.ranks):
                self.early.append(src)
            else:
                self.exchange(src)
        elif kind == FINISHED:
            with self.lock:
                self.done.add(src)
            self.events.put(("finished", src))
            self.reply(src, BYE)
        elif kind in (DIVERGED, ERROR):
            with self.lock:
                self.done.add(src)
            if kind == DIVERGED:
                self.stop(extra.decode())
                self.events.put(("diverged", src, extra.decode()))
            else:
                self.events.put(("error", src, extra.decode()))

    def reply(self, src: int, kind: int) -> bool:
        try:
            _wait(self.pg.send([torch.tensor([kind, self.t], dtype=torch.long)], src, TAG_X), self.timeout)
            return True
        except RuntimeError as e:
            self.gone(src, e)
            return False

    def gone(self, src: int, e: Exception) -> None:
        if not _closed(e):
            raise RuntimeError(f"worker rank {src} did not answer for {self.timeout:.0f} s (engine.timeout_s); "
                               "gloo gives up on the whole group after such a wait") from None
        self.events.put(("lost", src, "its connection closed"))

    def exchange(self, src: int) -> None:
        if self.stopping or src in self.lost:
            with self.lock:
                self.done.add(src)
            self.reply(src, STOP)
            return
        began = time.perf_counter()
        header = torch.zeros(2, dtype=torch.long)
        try:  # GO with the clock, the live θ and the server's tensors, all in flight at once
            go = torch.tensor([GO, self.t], dtype=torch.long)
            sends = [self.pg.send([v], src, TAG_X) for v in (go, self.theta, *self.server.values())]
            for s in sends:
                _wait(s, self.timeout)
            _wait(self.pg.recv([header], src, TAG_X), self.timeout)
            if int(header[0]) == NONE:
                return
            _wait(self.pg.recv([self.delta], src, TAG_X), self.timeout)
            payload = {}
            if int(header[1]):
                spec = pickle.loads(_recv_bytes(self.pg, int(header[1]), src, TAG_X, self.timeout))
                for name, shape, dtype in spec:
                    payload[name] = torch.empty(shape, dtype=dtype)
                    _wait(self.pg.recv([payload[name]], src, TAG_X), self.timeout)
        except RuntimeError as e:
            self.gone(src, e)
            return
        commit = Commit(delta=self.delta, payload=payload)
        with self.lock:
            staleness = self.t - self.pulled_at[src]
            self.algo.server_rule(self.theta, commit, staleness, self.hp, self.server)
            self.t += 1
            self.pulled_at[src] = self.t
            self.pending[src].append(self.t)
        self.busy_s += time.perf_counter() - began
        self.served += 1


# ------------------------------------------------------------------------------------- rank 0: the run


def _free_listener(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(128)
    return s


def _for_workers(job: Job) -> Job:
    """What travels to the workers: the job without the validation split, and without the training set when
    the workers can load it themselves (job.data_source)."""
    data = None
    if job.data_source is None:
        data = dataclasses.replace(job.data, val_x=job.data.val_x[:0].clone(), val_y=job.data.val_y[:0].clone())
    return dataclasses.replace(job, data=data, resume=None)


def run(job: Job, recorder) -> Result:
    if job.device != "cpu":
        raise ValueError("engine=distributed runs on device=cpu only for now; use engine=sim for device=cuda")
    eng = job.engine
    timeout_s = float(eng.get("timeout_s", 300.0))
    n = job.workers
    algo = algorithms.get(job.algorithm)
    model = build_flat_model(job)
    theta = model.param.clone()
    server = algorithms.init_server(algo, theta, job.hp)
    evaluate = Evaluator(job, job.data)
    t0_wall, t0 = time.time(), time.perf_counter()
    job = dataclasses.replace(job, engine={**eng, "timeout_s": timeout_s, "t0_wall": t0_wall,
                                           "train_examples": len(job.data.train_y)})
    children: list = []
    listener = None
    try:
        if launched():
            world = int(os.environ["WORLD_SIZE"])
            if world != n + 1:
                raise ValueError(f"workers={n} but the launcher started {world} processes; engine=distributed needs "
                                 f"workers + 1 (rank 0 is the parameter server): pass workers={world - 1}")
            torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
            pg = _connect(lambda: _launched_group(START_TIMEOUT_S)[1], [])
        else:
            host, port = str(eng.get("host", "127.0.0.1")), int(eng.get("port", 0))
            listener = _free_listener(host, port)
            port = listener.getsockname()[1]
            store = dist.TCPStore(host, port, n + 1, True, timeout=_td(START_TIMEOUT_S), wait_for_workers=False,
                                  master_listen_fd=listener.fileno())
            threads = threads_per_process(n + 1)
            torch.set_num_threads(threads)
            ctx = tmp.get_context("spawn")
            for r in range(1, n + 1):
                p = ctx.Process(target=_spawned, name=f"gem-worker-{r - 1}", daemon=True,
                                args=(r, n + 1, host, port, START_TIMEOUT_S, threads))
                p.start()
                children.append(p)
            pg = _connect(lambda: _group(store, 0, n + 1, host, START_TIMEOUT_S), children)
        blob = pickle.dumps(_for_workers(job))
        for r in range(1, n + 1):
            _wait(pg.send([torch.tensor([len(blob), 0, 0, 0], dtype=torch.long)], r, TAG_JOB), START_TIMEOUT_S)
            _send_bytes(pg, blob, r, TAG_JOB, START_TIMEOUT_S)
        return _Coordinator(job, recorder, pg, algo, theta, server, evaluate, t0, children).serve()
    finally:
        _stop(children)
        if listener is not None:
            listener.close()


def _connect(make, children: list):
    """Build the group (every rank must join) while watching the local children: one that dies before it
    joins fails the run at once instead of after the start timeout."""
    out: dict = {}

    def target():
        try:
            out["pg"] = make()
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    deadline = time.monotonic() + START_TIMEOUT_S + 10
    while th.is_alive():
        th.join(POLL_S)
        dead = [p for p in children if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode} before it joined the group")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not join within {START_TIMEOUT_S:.0f} s")
    if "error" in out:
        raise RuntimeError(f"the group did not form: {out['error']}")
    return out["pg"]


def _stop(children: list, grace_s: float = 5.0) -> None:
    """Local launch: every worker has had its answer and exits; any that does not is terminated, then killed."""
    deadline = time.monotonic() + grace_s
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in children:
        if p.is_alive():
            p.terminate()
    for p in children:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


class _Coordinator:
    """Rank 0's main thread: rows in clock order, evaluations, the watch over the workers, the end."""

    def __init__(self, job, recorder, pg, algo, theta, server, evaluate, t0, children):
        self.job, self.recorder, self.evaluate, self.t0 = job, recorder, evaluate, t0
        self.theta, self.children = theta, children
        self.events: queue.Queue = queue.Queue()
        self.ranks = list(range(1, job.workers + 1))
        self.ps = _Server(pg, job, algo, theta, server, self.ranks, self.events)
        self.ledger = Ledger(recorder, evaluate.model.tensor_names)
        self.finished: list[int] = []
        self.lost: list[str] = []
        self.lost_ranks: list[int] = []
        self.diverged = ""
        self.fatal = ""
        self.next_eval = job.eval_every

    def lose(self, rank: int, why: str) -> None:
        if rank in self.lost_ranks or rank - 1 in self.finished:
            return
        steps = self.ps.lose(rank)
        for s in steps:
            self.ledger.lost(s)
        self.lost_ranks.append(rank)
        msg = f"worker {rank - 1} lost at commit {self.ps.t} ({why})"
        self.lost.append(msg)
        print(f"gem: {msg}; the run goes on with the others", flush=True)
        if self.children:
            p = self.children[rank - 1]
            if p.is_alive():
                p.kill()

    def handle(self, ev) -> bool:
        kind = ev[0]
        if kind == "rows":
            for row, tensors in pickle.loads(ev[2]):
                self.ledger.add(row, tensors)
        elif kind == "finished":
            self.finished.append(ev[1] - 1)
        elif kind == "diverged":
            self.diverged = self.diverged or ev[2]
        elif kind == "error":
            self.lose(ev[1], f"raised {ev[2].splitlines()[0]}")
        elif kind == "lost":
            self.lose(ev[1], ev[2])
        elif kind == "fatal":
            self.fatal = ev[1]
        elif kind == "done":
            return False
        return True

    def watch(self) -> None:
        """Notice workers that died (local launch: their process) or went silent (any launch)."""
        now = time.monotonic()
        for r in self.ranks:
            if r in self.ps.done:
                continue
            if self.children and self.children[r - 1].exitcode is not None:
                self.lose(r, f"process died, exit code {self.children[r - 1].exitcode}")
            elif now - self.ps.heard[r] > self.ps.timeout:
                self.lose(r, f"silent for {self.ps.timeout:.0f} s (engine.timeout_s)")

    def snapshot_eval(self) -> None:
        with self.ps.lock:
            step, theta = self.ps.t, self.theta.clone()
        if not finite(theta):
            self.diverged = self.diverged or f"non-finite central variable at commit {step}"
            return
        self.recorder.eval(self.evaluate(theta, step, self.t0))

    def serve(self) -> Result:
        self.recorder.eval(self.evaluate(self.theta, 0, self.t0))
        self.ps.start()
        running, last_watch = True, 0.0
        while running:
            try:
                running = self.handle(self.events.get(timeout=POLL_S))
                while running:
                    running = self.handle(self.events.get_nowait())
            except queue.Empty:
                pass
            self.ledger.record()
            if time.monotonic() - last_watch > POLL_S:
                self.watch()
                last_watch = time.monotonic()
                if running and not self.ps.open():
                    # every worker finished or lost: the server ends by itself, unless it is waiting for a
                    # header from a worker that died; then stop waiting for it (it gives up at its timeout)
                    self.ps.join(1.0)
                    running = not self.ps.is_alive()
            if self.ledger.steps >= self.next_eval:
                self.next_eval = (self.ledger.steps // self.job.eval_every + 1) * self.job.eval_every
                self.snapshot_eval()
            if self.diverged:
                self.ps.stop(self.diverged)
        self.ps.join(BYE_TIMEOUT_S)
        while True:  # what came with the last messages
            try:
                self.handle(self.events.get_nowait())
            except queue.Empty:
                break
        with self.ps.lock:
            final = self.ps.t
        self.ledger.fill_gaps(final)
        if self.fatal and not self.diverged:
            reason = "; ".join([self.fatal, *self.lost])
            return Result("failed", self.ledger.steps, reason=reason, extra=self._extra())
        return conclude(self.recorder, self.evaluate, self.theta, self.ledger.steps, self.t0,
                        diverged=self.diverged, finished=bool(self.finished), lost=self.lost,
                        extra=self._extra())

    def _extra(self) -> dict:
        """The summary's engine fields: lost workers, and how loaded the parameter server was (its exchanges
        take `server_commit_s` each; busy close to 1 means the server, not the workers, sets the pace)."""
        ps, wall = self.ps, time.monotonic() - self.ps.started
        return {"lost_workers": sorted(r - 1 for r in self.lost_ranks),
                "server_commit_s": round(ps.busy_s / ps.served, 6) if ps.served else None,
                "server_busy": round(ps.busy_s / wall, 4) if wall > 0 else None}
