"""The `distributed` engine: the parameter server is rank 0 of a torch.distributed group, the workers are the
other ranks, on one machine or many, over TCP (DESIGN §3).

Launch it with torchrun (`torchrun --nproc_per_node=N+1 run.py engine=distributed workers=N`, multi-node
forms in the README), under SLURM with Hydra's submitit launcher, or from one command on one machine:
`python run.py engine=distributed workers=N` starts the N workers itself (from the forkserver of
gem.engines.worker's `worker_context`, as the process engine does), bound to loopback.

Transport: gloo point-to-point (BENCHMARKS.md, "Transport for the distributed engine": against
torch.distributed.rpc it moves an AlexNet commit 2.5x faster, and it serves first come, first served where
rpc's server lock is not first in, first out). Each rank builds its own `ProcessGroupGloo` on the job's store,
so nothing global is touched and several runs can follow one another in one process (a sweep).

Each worker runs the shared worker cycle (gem.engines.worker); its `_RemoteLink` makes one commit one exchange
with the server, the `process` engine's turn over the wire:

    worker                                   server (rank 0, one exchange at a time)
    ASK [+ its last commit rows]  ─────────▶ takes headers from any source, in arrival order
                                  ◀───────── GO t, τ, the live θ and the algorithm's server tensors
    worker_rule(…, view of θ)
    COMMIT Δ [+ payload]          ─────────▶ server.apply: server_rule(θ, Δ, τ), t ← t + 1
    server.apply on its replica of θ: the same θ the server now holds; pull.

So a commit costs two model-sized messages, and the algorithms run unchanged: the worker rule sees the live θ
and the server state, exactly as in the process engine, and staleness is measured on the server's clock. A
windowed algorithm talks to the server only when it commits. Nothing on the wire is a pickle, in either
direction, so no rank runs code a peer sends: headers are int64 tensors, rows, tensor specs and the job JSON,
tensors raw (the job: its fields and the algorithm's hyperparameters as JSON, the training set as raw tensors).

A local launch listens on loopback. Another address (`engine.host=0.0.0.0`) lets anyone who can reach it join the
run and send it commits, so it needs `engine.allow_remote=true`; the address and an explicit `engine.port` are
checked before anything starts (check_address, called by the config's validation).

The server's exchanges run on a thread of rank 0; its main thread (the coordinator, gem.engines.coordinator)
records rows in clock order, evaluates θ, writes checkpoints and watches the workers. For a checkpoint the server
stops handing out turns: each worker, when it next asks, is answered SAVE and sends its state (the run directory
is rank 0's, perhaps on another machine); asking again, it is told to WAIT and asks again shortly, until every
live worker has sent its state, the coordinator has written the checkpoint, and turns are handed out again. (A
worker is not left waiting on a reply: gloo's receive from any source does not wake when one peer dies, so the
server, blocked on it, would never learn that the last worker it waits for is gone.) A worker lost
mid-exchange (its connection closes) or silent is recorded and the run goes on: its commits whose rows never
came are marked (`lost_row`). Silent is the `process` engine's rule, written once (gem.engines.coordinator's
`Silence`): no progress for longer than max(engine.timeout_s, engine.silent_cycles x the median time between two
commits of a worker), where rank 0 times every commit it applies. A worker waiting for the server (for its turn,
or behind a worker that holds the server up) is not silent through its own fault, and says so on the job's store
while it waits (`_Waiting`): the server, stuck on a frozen worker, cannot hear the others, and gloo's receive from
any source can be stuck on a frozen worker's header. A silent worker of a local launch is killed, which closes its
connection and ends any wait on it. Every wait has a timeout. gloo aborts the whole group when one of its waits
times out, so the server's waits on a worker last well beyond the silence limit (`_patience`; each reply tells the
workers the server's patience, and they wait twice that for the server), and one expires only when no worker can
be heard from at all, in which case the run ends.
At the end every worker gets an answer (BYE or STOP) and exits; workers also exit when the server disappears.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import itertools
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from collections import deque

import torch
import torch.distributed as dist

from gem import algorithms
from gem.algorithms import Commit
from gem.data import Dataset, load_dataset
from gem.engines import Job, Result
from gem.engines import checkpoint as ckpt
from gem.engines.coordinator import POLL_S, TIMEOUT_S, Coordinator, start_server
from gem.engines.core import Evaluator, build_flat_model
from gem.engines.server import Server
from gem.engines.worker import Diverged, Worker, barrier_pauses, setup_process, threads_per_process, worker_context
from gem.files import WriteError
from gem.models import ModelSpec

START_TIMEOUT_S = 300.0  # a rank imports torch, loads the data and builds its model before it connects
BYE_TIMEOUT_S = 30.0  # a worker waits this long for the server's last answer
ROWS_PER_MESSAGE, ROWS_SECONDS = 16, 0.25  # a worker sends its commit rows in batches (as in the process engine)

TAG_ASK, TAG_X, TAG_JOB = 1, 2, 3  # worker→server headers (any source); one exchange's messages; the job
# header kinds, worker → server on TAG_ASK
ASK, READY, FINISHED, DIVERGED, ERROR, SAVED, PULL = range(7)  # PULL: θ once the clock reaches t (a barrier)
# server → worker, first word of the reply to an ASK, PULL or FINISHED: [kind, t, τ]
GO, STOP, BYE, SAVE, WAIT = range(5)
WAIT_S = 0.02  # a worker told to WAIT while a checkpoint is being taken asks again after this long (at a barrier:
# worker.barrier_pauses)
HEADER = 4  # int64 words: [kind, rows_nbytes, rows_count, extra_nbytes]
DONE = {"done": True}  # instead of a worker's state: the run resumes from a checkpoint in which it had no work left
# the dtypes a state or payload may have on the wire
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.uint8, torch.bool)}


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


WAITING_S = 0.5  # a worker waiting for the server says so on the store this often


def _waiting_key(rank: int) -> str:
    return f"gem-waiting/{rank}"


class _Waiting(threading.Thread):
    """While its worker waits for the server, add 1 to the worker's key on the job's store every WAITING_S: the
    coordinator does not count a wait for the server as the worker's silence (the process engine's line). A frozen
    worker's thread is frozen with it, and a worker hung anywhere else is not waiting: neither says anything."""

    def __init__(self, store, rank: int):
        super().__init__(name="gem-waiting", daemon=True)
        self.store, self.key = store, _waiting_key(rank)
        self.waiting = False

    def run(self) -> None:
        while True:
            time.sleep(WAITING_S)
            if self.waiting:
                try:
                    self.store.add(self.key, 1)
                except Exception:  # noqa: BLE001 - the store went with rank 0: the worker finds out itself
                    return


def _patience(limit_s: float) -> float:
    """How long rank 0 waits on one worker's message, given the silence limit: long enough that a silent worker
    is lost (and, launched locally, killed, which ends the wait) before the wait expires, which would make gloo
    abort the whole group; the coordinator may be busy (an evaluation) when the limit passes."""
    return 2.0 * limit_s + 10.0


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


# ------------------------------------------------------------------------------------ tensors on the wire


def _pack(d: dict, prefix: str = "") -> tuple[dict, list[torch.Tensor]]:
    """A nested dict of tensors and numbers as (JSON-able spec, tensors): nothing needs unpickling."""
    spec: dict = {"numbers": {}, "tensors": []}
    tensors: list[torch.Tensor] = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and not v:
            spec["numbers"][path] = {}  # an empty state (downpour's) must come back as one
        elif isinstance(v, dict):
            sub, ts = _pack(v, path + "/")
            spec["numbers"].update(sub["numbers"])
            spec["tensors"] += sub["tensors"]
            tensors += ts
        elif isinstance(v, torch.Tensor):
            spec["tensors"].append([path, str(v.dtype), list(v.shape)])
            tensors.append(v.detach().cpu().contiguous())
        else:
            spec["numbers"][path] = v
    return spec, tensors


def _unpack(spec: dict, tensors: list[torch.Tensor]) -> dict:
    out: dict = {}

    def put(path: str, value) -> None:
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    for path, value in spec["numbers"].items():
        put(path, value)
    for (path, _, _), t in zip(spec["tensors"], tensors, strict=True):
        put(path, t)
    return out


def _empty(spec: dict) -> list[torch.Tensor]:
    """Buffers for the tensors a spec announces, of allowed dtypes only."""
    out = []
    for path, dtype, shape in spec["tensors"]:
        if dtype not in DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"bad tensor {path!r} on the wire: dtype {dtype}, shape {shape}")
        out.append(torch.empty(shape, dtype=DTYPES[dtype]))
    return out


def _send_packed(pg, d: dict | None, dst: int, tag: int, timeout_s: float) -> None:
    """A nested dict of tensors and numbers, or None (a header of zero)."""
    spec, tensors = _pack(d or {})
    data = json.dumps(spec).encode() if d else b""
    _wait(pg.send([torch.tensor([len(data), 0, 0, 0], dtype=torch.long)], dst, tag), timeout_s)
    if not data:
        return
    _send_bytes(pg, data, dst, tag, timeout_s)
    works = [pg.send([t], dst, tag) for t in tensors]
    for w in works:
        _wait(w, timeout_s)


def _recv_spec_and_tensors(pg, spec_bytes: bytes, src: int, tag: int, timeout_s: float) -> dict:
    spec = json.loads(spec_bytes)
    tensors = _empty(spec)
    for t in tensors:
        _wait(pg.recv([t], src, tag), timeout_s)
    return _unpack(spec, tensors)


def _recv_packed(pg, src: int, tag: int, timeout_s: float) -> dict | None:
    header = torch.zeros(HEADER, dtype=torch.long)
    _wait(pg.recv([header], src, tag), timeout_s)
    if not int(header[0]):
        return None
    return _recv_spec_and_tensors(pg, _recv_bytes(pg, int(header[0]), src, tag, timeout_s), src, tag, timeout_s)


def _rows_json(rows: list) -> bytes:
    return json.dumps([[row, tensors] for row, tensors in rows]).encode()


# ------------------------------------------------------------------------------------- the job on the wire

DATASET_TENSORS = ("train_x", "train_y", "val_x", "val_y")  # raw on the wire; gem.data.Dataset's other fields: JSON


def encode_job(job: Job) -> tuple[bytes, dict[str, torch.Tensor] | None]:
    """The job as JSON, and its dataset's tensors (None without a dataset), to be sent raw: every field of Job,
    the algorithm's hyperparameters as a dict, the dataset's name and options. decode_job rebuilds it."""
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    fields["hp"] = _hp_fields(job)
    if isinstance(job.model, ModelSpec):  # its name, factory and keyword arguments: JSON, rebuilt by decode_job
        fields["model"] = {"spec": dataclasses.asdict(job.model)}
    tensors = None
    if job.data is not None:
        if type(job.data) is not Dataset:  # a subclass's own behaviour would not travel with its fields
            raise TypeError(f"engine=distributed sends a gem.data.Dataset, not a {type(job.data).__name__}")
        fields["data"] = {f.name: getattr(job.data, f.name) for f in dataclasses.fields(Dataset)
                          if f.name not in DATASET_TENSORS}
        tensors = {k: getattr(job.data, k) for k in DATASET_TENSORS}
    for name, value in fields.items():  # name the field that cannot travel, rather than fail somewhere in json
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"engine=distributed sends the job as JSON, and Job.{name} is not JSON ({e})") from None
    return json.dumps(fields).encode(), tensors


def _hp_fields(job: Job) -> dict:
    """The algorithm's Params as a dict that rebuilds them exactly (Params(**d)); checked here, on rank 0, so that
    a Params that JSON would change (a tuple, a nested dataclass) fails the run in one line before it starts."""
    params = algorithms.get(job.algorithm).Params
    d = dataclasses.asdict(job.hp)
    try:
        same = params(**json.loads(json.dumps(d))) == job.hp
    except (TypeError, ValueError):
        same = False
    if not same:
        raise TypeError(f"engine=distributed sends algorithm={job.algorithm}'s Params as JSON, and {d} does not "
                        "come back the same")
    return d


def decode_job(text: bytes, tensors: dict[str, torch.Tensor] | None) -> Job:
    """The Job that encode_job encoded: the same value in every field."""
    fields = json.loads(text)
    fields["hp"] = algorithms.get(fields["algorithm"]).Params(**fields["hp"])
    if isinstance(fields["model"], dict):
        fields["model"] = ModelSpec(**fields["model"]["spec"])
    if fields["data"] is not None:
        fields["data"] = Dataset(**fields["data"], **tensors)
    source = fields["data_source"]
    if source is not None and source.get("shape") is not None:
        source["shape"] = tuple(source["shape"])  # the model's input shape: a tuple, which JSON makes a list
    return Job(**fields)


def _send_job(pg, encoded: tuple[bytes, dict | None], dst: int, timeout_s: float) -> None:
    text, tensors = encoded
    _wait(pg.send([torch.tensor([len(text), 0, 0, 0], dtype=torch.long)], dst, TAG_JOB), timeout_s)
    _send_bytes(pg, text, dst, TAG_JOB, timeout_s)
    _send_packed(pg, tensors, dst, TAG_JOB, timeout_s)


def _recv_job(pg, timeout_s: float) -> Job:
    header = torch.zeros(HEADER, dtype=torch.long)
    _wait(pg.recv([header], 0, TAG_JOB), timeout_s)
    text = _recv_bytes(pg, int(header[0]), 0, TAG_JOB, timeout_s)
    return decode_job(text, _recv_packed(pg, 0, TAG_JOB, timeout_s))


# ------------------------------------------------------------------------------------------ worker


def worker_main(timeout_s: float = START_TIMEOUT_S) -> int:
    """A rank > 0 started by torchrun or SLURM: join the group, take the job from rank 0, work, exit."""
    threads = threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    store, pg, rank, _world = _launched_group(timeout_s)
    return _work(pg, rank, threads, ignore_sigint=False, store=store)


def _local_worker(rank: int, world: int, host: str, port: int, timeout_s: float, threads: int) -> None:
    """A worker of a local launch (`python run.py engine=distributed`)."""
    store = dist.TCPStore(host, port, world, False, timeout=_td(timeout_s))
    pg = _group(store, rank, world, host, timeout_s)
    _work(pg, rank, threads, store=store)


def _work(pg, rank: int, threads: int, ignore_sigint: bool = True, store=None) -> int:
    setup_process(threads, ignore_sigint)
    try:
        job = _recv_job(pg, START_TIMEOUT_S)
        saved = _recv_packed(pg, 0, TAG_JOB, START_TIMEOUT_S)  # this worker's state, when the run resumes
    except RuntimeError:
        return 1
    if saved == DONE:  # a resumed run whose checkpoint has this worker finished, or lost: nothing to do
        return 0
    link = _RemoteLink(pg, rank, job, store)
    try:
        link.run(saved)
    except _ServerGone:
        return 1
    return 0


class _ServerGone(Exception):
    pass


class _Stopped(Exception):
    """The server answered STOP: the run is ending."""


class _RemoteLink:
    """A worker rank's way to the server: ASK, GO with θ, COMMIT, all over gloo; a replica of the server's state
    that the worker brings up to date by replaying the server step."""

    def __init__(self, pg, rank: int, job: Job, store=None):
        self.pg, self.rank, self.job = pg, rank, job
        self.w = rank - 1  # the worker's index in metrics.parquet, as in the other engines
        self.waiting = _Waiting(store, rank) if store is not None else None
        if self.waiting is not None:
            self.waiting.start()
        self.timeout = float(job.engine["timeout_s"])
        # how long to wait for the server: twice its own patience with a worker, which each reply updates (it may
        # be held up by a silent worker until that one is lost)
        self.wait_s = 2.0 * _patience(self.timeout)
        self.t0_wall = float(job.engine["t0_wall"])
        self.buffer: list = []
        self.sent_at = time.monotonic()
        self.reply = torch.zeros(4, dtype=torch.long)  # [kind, t, τ, the server's patience in ms]
        self.extra: dict = {}
        self.worker: Worker | None = None
        self.server: Server | None = None

    # --- messages to the server; any failure means it is gone
    def header(self, kind: int, extra: bytes = b"") -> None:
        """A header to the server, with the commit rows not yet sent: always with the last word, else in
        batches, so that most ASKs are one small message."""
        batch = kind != ASK or len(self.buffer) >= ROWS_PER_MESSAGE or time.monotonic() - self.sent_at > ROWS_SECONDS
        rows = _rows_json(self.buffer) if batch and self.buffer else b""
        h = torch.tensor([kind, len(rows), len(self.buffer) if rows else 0, len(extra)], dtype=torch.long)
        try:
            _wait(self.pg.send([h], 0, TAG_ASK), self.wait_s)
            if rows:
                _send_bytes(self.pg, rows, 0, TAG_X, self.wait_s)
            if extra:
                _send_bytes(self.pg, extra, 0, TAG_X, self.wait_s)
        except RuntimeError as e:
            raise _ServerGone() from e
        if rows:
            self.buffer, self.sent_at = [], time.monotonic()

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
                _wait(work, self.wait_s)
        except RuntimeError as e:
            raise _ServerGone() from e

    # --- the Link of the worker cycle
    def acquire(self, w: int):
        t, staleness = self._request(ASK, b"", itertools.repeat(WAIT_S))
        return self._receive_view(w, t, t - staleness)

    def await_clock(self, w: int, t: int):
        """A barrier: PULL until the server's clock has reached t; the server then sends θ and its tensors (no
        turn is held: nothing is committed) and marks the pull."""
        clock, _ = self._request(PULL, str(t).encode(), barrier_pauses())
        return self._receive_view(w, clock, clock)

    def _request(self, kind: int, extra: bytes, pauses) -> tuple[int, int]:
        """Ask (ASK or PULL) until the server answers GO; returns its (t, τ). Meanwhile a SAVE is answered with our
        state, and a WAIT (a checkpoint is being taken, or the barrier not reached) with the next of `pauses` before
        asking again: asking keeps the server awake, so that it notices when a worker it waits for has died
        (gloo's wait would not wake). The worker says it is waiting, so it is not blamed for the others' silence."""
        if self.waiting is not None:
            self.waiting.waiting = True
        try:
            while True:
                self.header(kind, extra)
                self._recv([self.reply], self.wait_s)
                answer, t, staleness, patience_ms = (int(v) for v in self.reply)
                self.wait_s = 2.0 * max(patience_ms / 1000, _patience(self.timeout))
                if answer == STOP:
                    raise _Stopped()
                if answer == GO:
                    return t, staleness
                if answer == SAVE:  # a checkpoint: our state as of before the gradient in hand, then ask again
                    self._save()
                else:
                    time.sleep(next(pauses))
        finally:
            if self.waiting is not None:
                self.waiting.waiting = False

    def _receive_view(self, w: int, t: int, pulled_at: int):
        """θ and the server's tensors as the GO that follows sends them, into this worker's replica."""
        server = self.server
        self._recv([server.theta, *server.state.values()], self.wait_s)
        server.clock.fill_(t)
        server.pulled_at[w] = pulled_at
        return server.view(w)

    def _save(self) -> None:
        """A checkpoint: our state as of before the gradient in hand (or at the barrier)."""
        spec, tensors = _pack(self.worker.state_dict(in_hand=True))
        self.header(SAVED, json.dumps(spec).encode())
        self._send(tensors)

    def submit(self, view, commit: Commit) -> None:
        spec = json.dumps(_pack(commit.payload)[0]).encode() if commit.payload else b""
        tensors = [torch.tensor([len(spec), 0], dtype=torch.long), commit.delta.contiguous()]
        if spec:
            tensors += [torch.frombuffer(bytearray(spec), dtype=torch.uint8),
                        *(v.contiguous() for v in commit.payload.values())]
        self._send(tensors)

    def release(self) -> None:
        pass

    def now(self) -> float:
        return time.time() - self.t0_wall

    def rows(self, row: dict, tensors) -> None:
        self.buffer.append((row, tensors))

    def run(self, saved: dict | None) -> None:
        try:
            job = self.job
            data = job.data if job.data_source is None else load_dataset(**job.data_source)
            job = self.job = dataclasses.replace(job, data=data)
            if len(data.train_y) != job.engine["train_examples"]:
                raise ValueError(f"this rank loaded {len(data.train_y)} training examples of data={data.name}, rank "
                                 f"0 has {job.engine['train_examples']}: every node needs the same data.root")
            algo = algorithms.get(job.algorithm)
            worker = self.worker = Worker(self.w, job, algo)  # its model: θ₀ from the seed, as on every rank
            # the replica of the server's state stays on the host, where gloo sends and receives it
            self.server = Server.create(algo, job.hp, worker.x.detach().to("cpu", copy=True), job.workers)
            if saved is not None:
                worker.load_state_dict(saved)
            self.header(READY)
            while worker.cycle(self):
                pass
        except Diverged as e:
            self.header(DIVERGED, str(e).encode())
            return
        except _Stopped:
            return
        except _ServerGone:
            raise
        except Exception as e:  # tell the server why, then stop
            self.header(ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc()}".encode())
            return
        self.header(FINISHED)
        try:  # the server's last word: it has everything; then nobody waits for anybody
            self._recv([self.reply], BYE_TIMEOUT_S)
        except _ServerGone:
            pass


# ------------------------------------------------------------------------------------------ server


class _Server(threading.Thread):
    """Rank 0's exchanges with the workers, one at a time, in the order their headers arrive. Talks to the
    coordinator (the main thread) through `events`; `lock` guards the server's state and the bookkeeping."""

    def __init__(self, pg, job: Job, server: Server, workers: list[int], events: queue.Queue):
        super().__init__(name="gem-parameter-server", daemon=True)
        self.pg, self.job, self.server, self.events = pg, job, server, events
        # how long a wait on one worker may last (the coordinator keeps it at _patience of the silence limit)
        self.wait_s = _patience(float(job.engine["timeout_s"]))
        self.lock = threading.Lock()
        self.ranks = workers  # ranks 1..n
        self.pending: dict[int, deque] = {r: deque() for r in workers}  # commits whose rows have not come
        self.heard = dict.fromkeys(workers, time.monotonic())  # each worker's last header: it asked, it waits
        self.commits: list[tuple[int, float]] = []  # (worker, time) of the commits applied since the coordinator looked
        self.ready: set[int] = set()
        self.done: set[int] = set()  # finished, stopped, or lost: the server expects nothing more
        self.lost: set[int] = set()
        self.stopping = ""  # once set, every ASK is answered STOP
        self.early: deque = deque()  # ASKs that came before every worker was ready: all start from one θ
        self.barriers: dict[int, int] = {}  # the barrier each rank last waited at (PULL), until it pulls
        self.saving: dict | None = None  # a checkpoint being taken: {"folder", "saved": ranks that sent their state}
        self.written = threading.Event()
        self.delta = torch.empty_like(server.theta)
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

    def request_save(self, run_dir) -> bool:
        """(coordinator) Stop handing out turns and collect every live worker's state; False while a checkpoint
        is still being taken."""
        with self.lock:
            if self.saving is not None or self.stopping:
                return False
            self.written.clear()
            self.saving = {"folder": ckpt.pending(run_dir), "saved": set()}
            return True

    def run(self) -> None:
        try:
            self.serve()
        except WriteError as e:  # a worker's checkpoint file: the disk failed, and the run ends
            self.events.put(("write_error", str(e)))
        except Exception as e:  # noqa: BLE001 - the coordinator reports it
            if self.open():  # (else every worker had finished or was lost: nobody waited on what failed)
                self.events.put(("fatal", f"parameter server: {type(e).__name__}: {e}"))
        finally:
            self.events.put(("done",))

    def serve(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.long)
        while self.open():
            if self.early and (len(self.ready | self.done) == len(self.ranks)
                               or time.monotonic() - self.started > START_TIMEOUT_S):
                self.exchange(self.early.popleft())
                continue
            if self.saving is not None and self.saving["saved"] >= set(self.ranks) - self.done:
                # the clock now, not when the save was asked for: an exchange in flight then has committed since
                self.events.put(("saved", self.saving["folder"], self.server.t))
                while not self.written.wait(POLL_S) and threading.main_thread().is_alive():
                    pass  # the coordinator writes the checkpoint; θ must stay as saved until it is on disk
                self.saving = None  # the waiting workers are served as they ask again
                continue
            src = self.next_header(header)
            if src is not None:
                self.take(src, *(int(v) for v in header))

    def next_header(self, header: torch.Tensor) -> int | None:
        """The next worker's header, first come, first served: gloo keeps the notices of pending sends to a
        slot in the order they arrive, and a receive from any source takes the first (recvFromAny in gloo's
        tcp transport). Returns its rank, or None if it died while its header was on the way."""
        work = self.pg.recv_anysource([header], TAG_ASK)
        wait_s = self.wait_s
        try:
            _wait(work, wait_s)
        except RuntimeError as e:
            if _closed(e):
                return None  # the coordinator sees it go
            raise RuntimeError(f"no worker sent anything for {wait_s:.0f} s (twice the silence limit + 10 s)") from None
        return work._source_rank()

    def take(self, src: int, kind: int, rows_nbytes: int, rows_count: int, extra_nbytes: int) -> None:
        """Act on a header from `src`, with the rows and message that follow it. The rows are decoded by the
        coordinator: this thread's time is every worker's wait."""
        self.heard[src] = time.monotonic()
        try:
            rows = _recv_bytes(self.pg, rows_nbytes, src, TAG_X, self.wait_s) if rows_nbytes else b""
            extra = _recv_bytes(self.pg, extra_nbytes, src, TAG_X, self.wait_s) if extra_nbytes else b""
            state = _recv_spec_and_tensors(self.pg, extra, src, TAG_X, self.wait_s) if kind == SAVED else None
        except (RuntimeError, ValueError) as e:
            self.gone(src, e)
            return
        with self.lock:
            lost = src in self.lost
            if not lost:
                for _ in range(rows_count):
                    self.pending[src].popleft()
        if lost:  # given up for lost (silent too long) and back: its commits are marked already; it stops
            if kind in (ASK, PULL):
                self.reply(src, STOP)
            return
        if rows:
            self.events.put(("rows", rows))
        if kind == READY:
            self.ready.add(src)
        elif kind == ASK:
            if self.saving is not None:
                self.reply(src, WAIT if src in self.saving["saved"] else SAVE)
            elif len(self.ready | self.done) < len(self.ranks):
                self.early.append(src)
            else:
                self.exchange(src)
        elif kind == PULL:
            try:
                barrier = int(extra.decode("ascii"))
            except ValueError as e:
                self.gone(src, e)
                return
            if self.saving is not None:
                self.reply(src, WAIT if src in self.saving["saved"] else SAVE)
            elif self.stopping:
                with self.lock:
                    self.done.add(src)
                self.reply(src, STOP)
            elif self.server.t < barrier:
                self.barriers[src] = barrier
                if self.unreachable():  # the others are told STOP when they next ask
                    with self.lock:
                        self.done.add(src)
                    self.reply(src, STOP)
                else:
                    self.reply(src, WAIT)
            else:
                self.barriers.pop(src, None)
                self.pull(src)
        elif kind == SAVED:
            ckpt.save_atomic(state, ckpt.worker_file(self.saving["folder"], src - 1))
            self.saving["saved"].add(src)
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

    def reply(self, src: int, kind: int, t: int = 0, staleness: int = 0) -> bool:
        try:
            reply = torch.tensor([kind, t, staleness, int(self.wait_s * 1000)], dtype=torch.long)
            _wait(self.pg.send([reply], src, TAG_X), self.wait_s)
            return True
        except RuntimeError as e:
            self.gone(src, e)
            return False

    def gone(self, src: int, e: Exception) -> None:
        """`src` closed its connection (a RuntimeError from gloo), or sent what cannot be read (a ValueError: a
        malformed spec or JSON): it is lost. Any other gloo error is a timeout, and gloo has dropped the group."""
        if isinstance(e, RuntimeError) and not _closed(e):
            raise RuntimeError(f"worker rank {src} did not answer for {self.wait_s:.0f} s (twice the silence limit "
                               "+ 10 s); gloo gives up on the whole group after such a wait") from None
        with self.lock:  # expect nothing more from it now: a checkpoint in progress must not wait for it
            self.done.add(src)
        why = "its connection closed" if isinstance(e, RuntimeError) else f"it sent what cannot be read ({e})"
        self.events.put(("lost", src, why))

    def unreachable(self) -> bool:
        """Every worker still expected waits at a barrier that only their own commits could reach (a lost worker
        stalls synchronous rounds): end the run now, with the reason, rather than let them ask forever."""
        live = set(self.ranks) - self.done
        if not live or any(self.barriers.get(r, -1) <= self.server.t for r in live):
            return False
        why = (f"workers {sorted(r - 1 for r in live)} wait at a barrier (t={min(self.barriers[r] for r in live)}) "
               f"that no commit can reach (t={self.server.t}, the other workers are lost or finished)")
        self.stop(why)
        self.events.put(("fatal", why))
        return True

    def pull(self, src: int) -> None:
        """A worker at a barrier that the clock has reached: θ and the server's tensors; no commit follows."""
        with self.lock:
            view = self.server.pull(src - 1)
        try:
            go = torch.tensor([GO, view.t, 0, int(self.wait_s * 1000)], dtype=torch.long)
            sends = [self.pg.send([v], src, TAG_X) for v in (go, self.server.theta, *self.server.state.values())]
            for s in sends:
                _wait(s, self.wait_s)
        except RuntimeError as e:
            self.gone(src, e)

    def exchange(self, src: int) -> None:
        if self.stopping or src in self.lost:
            with self.lock:
                self.done.add(src)
            self.reply(src, STOP)
            return
        began = time.perf_counter()
        server = self.server
        view = server.view(src - 1)
        header = torch.zeros(2, dtype=torch.long)
        try:  # GO with the clock and τ, the live θ and the server's tensors, all in flight at once
            wait_s = self.wait_s
            go = torch.tensor([GO, view.t, view.staleness, int(wait_s * 1000)], dtype=torch.long)
            sends = [self.pg.send([v], src, TAG_X) for v in (go, server.theta, *server.state.values())]
            for s in sends:
                _wait(s, wait_s)
            _wait(self.pg.recv([header], src, TAG_X), wait_s)
            _wait(self.pg.recv([self.delta], src, TAG_X), wait_s)
            payload = {}
            if int(header[0]):
                spec = _recv_bytes(self.pg, int(header[0]), src, TAG_X, wait_s)
                payload = _recv_spec_and_tensors(self.pg, spec, src, TAG_X, wait_s)
        except (RuntimeError, ValueError) as e:
            self.gone(src, e)
            return
        with self.lock:
            t = server.apply(view, Commit(delta=self.delta, payload=payload))
            self.commits.append((src - 1, time.monotonic()))  # progress, for the coordinator's Silence
            if src in self.pending:
                self.pending[src].append(t)
            else:  # given up for lost while this exchange ran: its row will never come
                self.events.put(("lost_steps", [t]))
        self.busy_s += time.perf_counter() - began
        self.served += 1


# ------------------------------------------------------------------------------------- rank 0: the run


def check_address(host: str, port: int, allow_remote: bool) -> None:
    """engine=distributed: refuse, in one line (ValueError), an address a local launch must not or cannot listen
    on, before anything starts; print the warning for an exposed one (once). Under a launcher the addresses are
    the launcher's (MASTER_ADDR, MASTER_PORT): nothing to check."""
    if launched():
        return
    warning = check_host(host, allow_remote)
    check_port(host, port)
    _warn_once(warning)


def check_host(host: str, allow_remote: bool) -> str | None:
    """None for loopback (127.0.0.0/8, ::1, localhost); for any other address, the warning line to print when
    engine.allow_remote=true, else ValueError: whoever can reach rank 0's address can join the run as a worker
    and send it commits."""
    if _loopback(host):
        return None
    if not allow_remote:
        raise ValueError(f"engine.host={host} is not a loopback address, and anyone who can reach it could join the "
                         "run; use engine.host=127.0.0.1 (or localhost, ::1), or set engine.allow_remote=true to "
                         "expose the run on it")
    where = f"every address of this machine ({host or 'all'})" if _any_address(host) else host
    return (f"gem: warning: engine.allow_remote=true: the run listens on {where}, and anyone who can reach it can "
            "join the run and send it commits")


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name: it may resolve to anything
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _any_address(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def _local_address(host: str) -> str:
    """The address a local launch's ranks use for one another: the one rank 0 listens on, or loopback when it
    listens on every address (a connection needs one destination, and gloo one interface)."""
    if not _any_address(host):
        return host
    return "::1" if host == "::" else "127.0.0.1"


_warned: set[str] = set()  # the validation runs once for the preflight and once per run: one warning a process


def _warn_once(line: str | None) -> None:
    if line and line not in _warned:
        _warned.add(line)
        print(line, file=sys.stderr, flush=True)


def check_port(host: str, port: int) -> None:
    """ValueError, in one line, when rank 0 could not listen on (host, port): the port is taken, or the host is
    not an address of this machine. It binds as rank 0 will (_listener) and lets go at once. (SO_REUSEADDR as
    there: without it, a port that the previous run of a sweep used would be refused while its closed
    connections wait out TIME_WAIT, though rank 0 could listen on it.)"""
    _listener(host, port).close()


def _listener(host: str, port: int) -> socket.socket:
    """Rank 0's listening socket for the job's TCPStore (port 0: a free one). A bind that fails, here or when a
    port free at the preflight has been taken since, is one line naming the key."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"engine.port={port} is in use on {host} (another run or program holds it); pick "
                             "another port, or engine.port=0 for a free one") from None
        raise ValueError(f"engine.host={host} cannot be listened on ({e.strerror or e}); give an address of this "
                         "machine, such as 127.0.0.1") from None
    return s


def _for_workers(job: Job) -> Job:
    """What travels to the workers: the job without the validation split, and without the training set when
    the workers can load it themselves (job.data_source)."""
    data = None
    if job.data_source is None:
        data = dataclasses.replace(job.data, val_x=job.data.val_x[:0].clone(), val_y=job.data.val_y[:0].clone())
    return dataclasses.replace(job, data=data, resume=None)


def run(job: Job, recorder) -> Result:
    eng = job.engine
    timeout_s = float(eng.get("timeout_s", TIMEOUT_S))
    n = job.workers
    algo = algorithms.get(job.algorithm)
    # θ on rank 0's host: gloo moves CPU tensors. A GPU worker stages θ on its device at its commits.
    server, resumed = start_server(job, algo, build_flat_model(job, device="cpu").param.clone())
    children: list = []
    listener = None
    coord = None
    try:
        coord = _Coordinator(job, recorder, server, Evaluator(job, job.data), resumed)
        saved = {w: ckpt.load_worker(job.resume, w) for w in coord.pending_workers()} if resumed else {}
        job = dataclasses.replace(job, engine={**eng, "timeout_s": timeout_s, "t0_wall": coord.t0_wall,
                                               "train_examples": len(job.data.train_y)})
        coord.job = job
        encoded = encode_job(_for_workers(job))  # before any worker starts: a field that JSON cannot carry fails here
        if launched():
            world = int(os.environ["WORLD_SIZE"])
            if world != n + 1:
                raise ValueError(f"workers={n} but the launcher started {world} processes; engine=distributed needs "
                                 f"workers + 1 (rank 0 is the parameter server): pass workers={world - 1}")
            torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
            store, pg = _connect(lambda: _launched_group(START_TIMEOUT_S)[:2], [])
        else:
            host, port = str(eng.get("host", "127.0.0.1")), int(eng.get("port", 0))
            # the config's validation has checked the address; again here for a caller of the engine itself
            _warn_once(check_host(host, bool(eng.get("allow_remote", False))))
            listener = _listener(host, port)
            port = listener.getsockname()[1]
            store = dist.TCPStore(host, port, n + 1, True, timeout=_td(START_TIMEOUT_S), wait_for_workers=False,
                                  master_listen_fd=listener.fileno())
            local = _local_address(host)  # where this machine's ranks reach rank 0 and one another
            # as on the process engine, the workers share the cores and the coordinating rank is not counted: it
            # mostly waits on the wire. The same threads as the other engines: the same arithmetic at n = 1.
            threads = threads_per_process(n)
            torch.set_num_threads(threads)
            ctx = worker_context()
            for r in range(1, n + 1):
                p = ctx.Process(target=_local_worker, name=f"gem-worker-{r - 1}", daemon=True,
                                args=(r, n + 1, local, port, START_TIMEOUT_S, threads))
                p.start()
                children.append(p)
            pg = _connect(lambda: _group(store, 0, n + 1, local, START_TIMEOUT_S), children)
        for r in range(1, n + 1):
            _send_job(pg, encoded, r, START_TIMEOUT_S)
            _send_packed(pg, saved.get(r - 1, DONE if resumed else None), r, TAG_JOB, START_TIMEOUT_S)
        coord.attach(pg, children, store)
        return coord.serve()
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


class _Coordinator(Coordinator):
    """Rank 0's main thread: the shared bookkeeping, fed by the server thread's events."""

    def __init__(self, job, recorder, server, evaluate, resumed):
        super().__init__(job, recorder, server, evaluate, resumed)
        self.events: queue.Queue = queue.Queue()
        self.children: list = []
        self.ps: _Server | None = None
        self.fatal = ""
        self.write_error = ""  # a file of the run directory could not be written: the run ends, failed
        self.server_done = False
        self.last_watch = 0.0
        self.racing = False  # every worker is ready (or given up): the silence timers run
        self.store = None  # the job's store, on which a worker waiting for the server says so
        self.waited: dict[int, int] = {}  # each rank's count on it when the coordinator last looked
        self.closed_at: float | None = None  # when every worker had finished or was lost

    def attach(self, pg, children: list, store=None) -> None:
        ranks = [w + 1 for w in range(self.job.workers)]
        self.ps = _Server(pg, self.job, self.server, ranks, self.events)
        self.children, self.store = children, store
        for w in set(range(self.job.workers)) - set(self.pending_workers()):  # done before the checkpoint
            self.ps.done.add(w + 1)
            self.ps.ready.add(w + 1)
        self.ps.start()

    def lose_rank(self, rank: int, why: str) -> None:
        if not self.lose(rank - 1, why):
            return
        for s in self.ps.lose(rank):
            self.ledger.lost(s)
        if self.children:
            p = self.children[rank - 1]
            if p.is_alive():
                p.kill()

    def handle(self, ev) -> None:
        kind = ev[0]
        if kind == "rows":
            for row, tensors in json.loads(ev[1]):
                self.ledger.add(row, tensors)
        elif kind == "finished":
            self.finish(ev[1] - 1)
        elif kind == "diverged":
            self.diverge(ev[2])
        elif kind == "error":
            self.lose_rank(ev[1], f"raised {ev[2].splitlines()[0]}")
        elif kind == "lost":
            self.lose_rank(ev[1], ev[2])
        elif kind == "saved":  # the server waits with every live worker's state in ev[1], θ as of ev[2]
            try:
                if not self.diverged and not self.write_error:  # a diverged run's state is not worth resuming
                    self.ledger.record()
                    self.ledger.fill_gaps(ev[2])
                    self.write_checkpoint(ev[1], ev[2])
            except WriteError as e:
                self.write_error = str(e)
            finally:
                self.ps.written.set()
        elif kind == "lost_steps":
            for step in ev[1]:
                self.ledger.lost(step)
        elif kind == "fatal":
            self.fatal = ev[1]
        elif kind == "write_error":
            self.write_error = ev[1]
        elif kind == "done":
            self.server_done = True

    # --- the engine hooks of Coordinator.serve

    def running(self) -> bool:
        return not self.server_done and not self.write_error

    def poll(self, timeout: float) -> None:
        try:
            self.handle(self.events.get(timeout=timeout))
            while True:
                self.handle(self.events.get_nowait())
        except queue.Empty:
            pass

    def watch(self) -> None:
        """Notice workers that died (local launch: their process) or went silent (any launch): the rule of
        `Silence`, fed with the time of every commit the server applies. A worker whose header the server took,
        or that says on the store that it waits for the server (`_Waiting`), is not silent through its own fault."""
        now = time.monotonic()
        if now - self.last_watch < POLL_S:
            return
        self.last_watch = now
        ps = self.ps
        with ps.lock:
            commits, ps.commits = ps.commits, []
        if not self.racing:
            self.start_race(now)
        for w, at in commits:
            self.silence.progress(w, at)
        for r in ps.ranks:
            self.silence.seen(r - 1, ps.heard[r])
            if self.waited_since_last_look(r):
                self.silence.seen(r - 1, now)
        ps.wait_s = _patience(self.silence.limit())
        for r in ps.ranks:
            if r not in ps.done and self.children and self.children[r - 1].exitcode is not None:
                self.lose_rank(r, f"process died, exit code {self.children[r - 1].exitcode}")
        for w, silent_for in self.silence.silent(now):
            if w + 1 in ps.done:  # finished (its event is on the way) or lost
                self.silence.forget(w)
            else:
                self.lose_rank(w + 1, self.silence.why(silent_for))
        if not ps.open() and not self.server_done:
            # every worker finished or lost: the server ends by itself, unless it waits for a header from a worker
            # that died or was lost (gloo's receive from any source does not wake when a peer dies); it gives up at
            # its own timeout. Wait for it: it holds the group and its store, which must not outlive the run (the
            # store's listening socket is closed at the end, and its number may be reused by the next run's)
            ps.join(1.0)
            self.closed_at = self.closed_at or now
            self.server_done = not ps.is_alive() or now - self.closed_at > ps.wait_s + BYE_TIMEOUT_S

    def waited_since_last_look(self, rank: int) -> bool:
        if self.store is None or rank in self.ps.done:
            return False
        try:
            count = int(self.store.add(_waiting_key(rank), 0))
        except Exception:  # noqa: BLE001 - no store, no excuse: the rule still holds
            return False
        waited, self.waited[rank] = count != self.waited.get(rank, 0), count
        return waited

    def start_race(self, now: float) -> None:
        """The silence timers start once every worker is ready, as the server's turns do: a worker not ready
        START_TIMEOUT_S after the start is lost, and the others start without it."""
        ps = self.ps
        if len(ps.ready | ps.done) < len(ps.ranks):
            if now - ps.started <= START_TIMEOUT_S:
                return
            for r in ps.ranks:
                if r not in ps.ready and r not in ps.done:
                    self.lose_rank(r, f"not ready within {START_TIMEOUT_S:.0f} s of its start")
        self.racing = True
        self.silence.start([r - 1 for r in ps.ranks if r not in ps.done], now)

    def sync(self) -> None:
        pass  # the server knows which commits a lost worker made: they are marked when it is lost

    def snapshot(self):
        with self.ps.lock:
            return self.server.t, self.server.theta.clone()

    def checkpoint(self) -> None:
        self.ps.request_save(self.job.run_dir)

    def wrap_up(self) -> Result:
        if self.diverged or self.write_error:  # every worker that asks is told to stop; wait for them to go
            self.ps.stop(self.diverged or self.write_error)
            deadline = time.monotonic() + BYE_TIMEOUT_S
            while not self.server_done and time.monotonic() < deadline:
                self.poll(POLL_S)
                self.watch()
        self.ps.written.set()  # a checkpoint cut short by the end: the server need not wait for it
        self.ps.join(BYE_TIMEOUT_S)
        self.poll(0)  # what came with the last messages
        with self.ps.lock:
            final = self.server.t
        self.ledger.fill_gaps(final)
        ps, wall = self.ps, time.monotonic() - self.ps.started
        # how loaded the parameter server was: its exchanges take server_commit_s each; busy close to 1 means
        # the server, not the workers, set the pace
        extra = {"server_commit_s": round(ps.busy_s / ps.served, 6) if ps.served else None,
                 "server_busy": round(ps.busy_s / wall, 4) if wall > 0 else None}
        if self.write_error:  # every process has stopped and the rows are recorded: the runner says it, once
            raise WriteError(self.write_error)
        if self.fatal and not self.diverged:
            return Result("failed", self.steps, reason="; ".join([self.fatal, *self.lost]),
                          extra={"lost_workers": sorted(self.lost_workers), **extra})
        return self.conclude(extra)
