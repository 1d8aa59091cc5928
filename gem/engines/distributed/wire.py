"""The distributed engine's wire: the group every rank joins, the messages its ranks exchange, and what both
sides agree on (message kinds, timeouts, the store key a waiting worker writes).

Nothing on the wire is a pickle, in either direction: headers are int64 tensors; rows, tensor specs and the job
are JSON; tensors travel raw, and a receiver makes buffers only of the dtypes in DTYPES. So no rank runs code a
peer sends. What a worker imports is named by the job, and it imports only what its own side allows
(job.allowed_imports).

Rank 0 holds a worker to what it expects (`Bounds`, built from the job): every size a worker announces is checked
before a byte is allocated or received, every message's kind against what the worker may send now, every row and
tensor spec against the schema. A worker that sends anything else is lost, with a reason that says what it sent
(`Malformed`), and the run goes on with the others. A worker proves the run's secret (`run_secret`,
`GEM_RUN_SECRET`) before it gets the job or θ (`_proof`).

Every wait has a timeout, and gloo aborts the whole group (closes every connection) when one of its waits times
out: so rank 0's waits on a worker last well beyond the silence limit (`_patience`), and one expires only when no
worker can be heard from at all.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import json
import math
import os
import queue
import re
import secrets
import socket
import threading
import time

import torch
import torch.distributed as dist

from gem.engines.distributed.doors import ENDPOINTS_BYTES, held_endpoints, listening, parse_endpoints, refuse_newcomers
from gem.engines.worker import ROWS_PER_MESSAGE

BYE_TIMEOUT_S = 30.0  # a worker waits this long for the server's last answer

TAG_ASK, TAG_X, TAG_JOB = 1, 2, 3  # worker→server headers; one exchange's messages; the job
# header kinds, worker → server on TAG_ASK
# PULL: θ once the clock reaches t (a barrier); ROWS: commit rows alone, from a worker that takes its turn in shared
# memory (a local launch: window.py)
ASK, READY, FINISHED, DIVERGED, ERROR, SAVED, PULL, ROWS = range(8)
# server → worker, first word of the reply to an ASK, PULL or FINISHED: [kind, t, τ]
GO, STOP, BYE, SAVE, WAIT = range(5)
HEADER = 4  # int64 words: [kind, rows_nbytes, rows_count, extra_nbytes]
KINDS = {ASK: "ASK", READY: "READY", FINISHED: "FINISHED", DIVERGED: "DIVERGED", ERROR: "ERROR", SAVED: "SAVED",
         PULL: "PULL", ROWS: "ROWS"}
# the dtypes a state or payload may have on the wire
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.uint8, torch.bool)}

SECRET_ENV, SECRET_FILE_ENV = "GEM_RUN_SECRET", "GEM_RUN_SECRET_FILE"
SECRET_MIN_CHARS = 16  # a proof travels in the clear: a short secret could be found from one by trying them all
NONCE_BYTES = 32  # rank 0's challenge to each worker, fresh for each run: a proof seen once cannot be replayed
SECRET_HINT = (f'export {SECRET_ENV}=$(python -c "import secrets; print(secrets.token_hex(16))") on every host '
               f"(the same value), or name a file that holds it in {SECRET_FILE_ENV}")


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _patience(limit_s: float) -> float:
    """How long rank 0 waits on one worker's message, given the silence limit: long enough that a silent worker
    is lost (and, launched locally, killed, which ends the wait) before the wait expires, which would make gloo
    abort the whole group; the coordinator may be busy (an evaluation) when the limit passes."""
    return 2.0 * limit_s + 10.0


def _waiting_key(rank: int) -> str:
    """The key on the job's store that a worker adds to while it waits for the server (link._Waiting), and that
    the coordinator reads (launch._Coordinator)."""
    return f"gem-waiting/{rank}"


# ------------------------------------------------------------------------------------- the group


def launched() -> bool:
    """True when a launcher (torchrun, or SLURM through submitit) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def export_submitit_env() -> None:
    """Inside a job of several tasks started by Hydra's submitit launcher (SLURM, or submitit's local executor),
    set RANK, WORLD_SIZE, MASTER_ADDR, ... from the job's environment, as torchrun would: submitit's
    TorchDistributedEnvironment (rank 0's store on the job's first node, at a port drawn from the job's id unless
    MASTER_PORT is set). The local executor's tasks all run here: rank 0's store is reached on loopback. A
    MASTER_ADDR inherited from the shell that started the sweep is replaced. Does nothing elsewhere."""
    if launched() or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    if env.world_size > 1:
        if os.environ["SUBMITIT_EXECUTOR"] == "local":
            env.master_addr = "127.0.0.1"
        env.export(set_cuda_visible_devices=False, overwrite=True)


def _devices(host: str | None) -> list:
    """gloo's network devices: the given address (loopback for a local launch, or one node), else, for a
    multi-node launch, the interfaces GLOO_SOCKET_IFNAME names (comma-separated, as torch.distributed reads it),
    else the address this host's name resolves to. A name that resolves only to loopback (127.0.1.1 in many
    /etc/hosts) would make every rank tell the others to reach it on their own loopback, and the group would
    time out: it is refused in one line that names GLOO_SOCKET_IFNAME."""
    if host:
        return [dist.ProcessGroupGloo.create_device(hostname=host)]
    interfaces = [i.strip() for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i.strip()]
    if interfaces:
        return [dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces]
    name = socket.gethostname()
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(name, None)}
    except OSError:
        addresses = set()
    if not [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback]:
        raise ValueError(f"this host's name {name!r} resolves to no address other nodes can reach "
                         f"({', '.join(sorted(addresses)) or 'none'}); set GLOO_SOCKET_IFNAME to the network "
                         "interface the nodes share (e.g. GLOO_SOCKET_IFNAME=eth0) on every node")
    return [dist.ProcessGroupGloo.create_default_device()]


def _group(store, rank: int, world: int, host: str | None, timeout_s: float):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _td(timeout_s)
    opts._devices = _devices(host)
    return dist.ProcessGroupGloo(dist.PrefixStore("gem/", store), rank, world, opts)


def single_node() -> bool:
    """Every rank of the launch runs on this machine (torchrun's LOCAL_WORLD_SIZE is the world's size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world


def _launched_group(timeout_s: float):
    """(store, group, rank, world) from the launcher's environment (torchrun's, or submitit's exported). Once
    the group has formed, what this rank listens on (gloo's port, and the store's if it holds it) takes nobody
    new (doors.py)."""
    before = listening()
    store, rank, world = next(dist.rendezvous("env://", timeout=_td(timeout_s)))
    # one node: loopback; several: each rank's own address, so that the others can reach it
    pg = _group(store, rank, world, "127.0.0.1" if single_node() else None, timeout_s)
    refuse_newcomers(before)
    return store, pg, rank, world


# ------------------------------------------------------------------------------------------ the run's secret


def run_secret() -> str | None:
    """The run's secret from this process's environment: GEM_RUN_SECRET, else the first line of the file that
    GEM_RUN_SECRET_FILE names; None when neither is set. ValueError, in one line, for a file that cannot be read or
    a secret too short to keep."""
    secret, where = os.environ.get(SECRET_ENV, ""), SECRET_ENV
    path = os.environ.get(SECRET_FILE_ENV, "")
    if not secret and path:
        where = f"the file {SECRET_FILE_ENV}={path}"
        try:
            with open(path) as f:
                secret = f.readline().strip()
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV}={path} cannot be read ({e.strerror or e}); {SECRET_HINT}") from None
    if not secret:
        return None
    if len(secret) < SECRET_MIN_CHARS:
        raise ValueError(f"{where} holds a secret of {len(secret)} characters, and the run's secret needs at least "
                         f"{SECRET_MIN_CHARS}: {SECRET_HINT}")
    return secret


def launched_secret() -> str:
    """The secret of a rank that a launcher started. Required when the ranks span machines: a worker is then any
    process that reaches rank 0 over the network. On one machine it is optional ('' proves nothing): gloo's
    connections are bound to loopback there (_launched_group), so every peer is a process of this machine, as in a
    local launch (torchrun's store may listen wider, but no process elsewhere can open a gloo connection to a rank
    bound to loopback); set one all the same where other users share the machine."""
    secret = run_secret()
    if secret is None and not single_node():
        raise ValueError(f"{SECRET_ENV} is not set, and a launch over several machines needs the run's secret so that "
                         f"only its own workers can join: {SECRET_HINT}")
    return secret or ""


def _proof(secret: str, nonce: bytes, rank: int) -> bytes:
    """Worker `rank`'s answer to rank 0's nonce: HMAC-SHA256 keyed with the run's secret. It cannot be made without
    the secret, and, the nonce being fresh, one seen on the wire (gloo's traffic is not encrypted) is of no use
    to anyone later."""
    return hmac.new(secret.encode(), f"gem-worker/{rank}/".encode() + nonce, hashlib.sha256).digest()


PROOF_BYTES = hashlib.sha256().digest_size


def _admit(pg, ranks: list[int], secret: str, timeout_s: float) -> tuple[dict[int, str], set[tuple[str, int]]]:
    """Rank 0, before anything else goes to a worker: a fresh nonce to each, and its proof back, with the
    endpoints of its connections to the job's store. Returns the ranks refused, with why, and the store endpoints
    of those admitted (doors.cut_strangers). (A rank that neither answers nor closes its connection holds the
    start up until the wait expires, which makes gloo drop the group, and the run fails: that much a peer without
    the secret can still do.)"""
    nonces = {r: secrets.token_bytes(NONCE_BYTES) for r in ranks}
    sends = {r: pg.send([torch.frombuffer(bytearray(nonces[r]), dtype=torch.uint8)], r, TAG_JOB) for r in ranks}
    refused, held = {}, set()
    for r in ranks:
        proof = torch.zeros(PROOF_BYTES, dtype=torch.uint8)
        try:
            _wait(sends[r], timeout_s)
            _wait(pg.recv([proof], r, TAG_JOB), timeout_s)
            ends = _recv_bytes(pg, ENDPOINTS_BYTES, r, TAG_JOB, timeout_s)  # taken in any case: its send returns
            if hmac.compare_digest(proof.numpy().tobytes(), _proof(secret, nonces[r], r)):
                held |= parse_endpoints(ends)
            else:
                refused[r] = f"rank {r} refused: it did not prove the run's secret ({SECRET_ENV})"
        except RuntimeError as e:
            if not _closed(e):
                raise RuntimeError(f"worker rank {r} did not answer rank 0's challenge within {timeout_s:.0f} s; "
                                   "gloo gives up on the whole group after such a wait") from None
            refused[r] = f"rank {r} refused: its connection closed before it proved the run's secret"
    return refused, held


def _prove(pg, rank: int, secret: str, timeout_s: float, store_port: int | None = None) -> None:
    """A worker: answer rank 0's nonce (_admit), and name its connections to the job's store at `store_port`."""
    nonce = torch.zeros(NONCE_BYTES, dtype=torch.uint8)
    _wait(pg.recv([nonce], 0, TAG_JOB), timeout_s)
    _send_bytes(pg, _proof(secret, nonce.numpy().tobytes(), rank), 0, TAG_JOB, timeout_s)
    _send_bytes(pg, held_endpoints(store_port), 0, TAG_JOB, timeout_s)


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
            if not isinstance(node, dict):
                raise Malformed(f"a tensor spec whose paths collide ({path!r})")
        if leaf in node:
            raise Malformed(f"a tensor spec whose paths collide ({path!r})")
        node[leaf] = value

    for path, value in spec["numbers"].items():
        put(path, value)
    for (path, _, _), t in zip(spec["tensors"], tensors, strict=True):
        put(path, t)
    return out


def _parse_spec(data: bytes, max_bytes: int) -> dict:
    """A tensor spec (_pack's) that a worker sent, checked before any buffer is made: JSON of the right form, each
    tensor named, of a dtype in DTYPES and of a valid shape, max_bytes in all at most, numbers plain. Malformed
    otherwise."""
    try:
        spec = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Malformed(f"a tensor spec that is not JSON ({e})") from None
    if not (isinstance(spec, dict) and set(spec) == {"numbers", "tensors"} and isinstance(spec["numbers"], dict)
            and isinstance(spec["tensors"], list)):
        raise Malformed("a tensor spec that is not {numbers, tensors}")
    if len(spec["tensors"]) > SPEC_TENSORS:
        raise Malformed(f"a tensor spec of {len(spec['tensors'])} tensors (at most {SPEC_TENSORS} allowed)")
    total = 0
    for entry in spec["tensors"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in DTYPES
                and isinstance(entry[2], list) and len(entry[2]) <= 8
                and all(type(d) is int and 0 <= d < INT64 for d in entry[2])):
            raise Malformed(f"a tensor spec entry that is not [name, dtype, shape] of the wire's ({str(entry)[:80]})")
        total += math.prod(entry[2]) * DTYPES[entry[1]].itemsize
    if total > max_bytes:
        raise Malformed(f"a tensor spec announcing {total} bytes of tensors (at most {max_bytes} allowed)")
    for path, value in spec["numbers"].items():
        if not (_number(value) or value is None or value == {}):
            raise Malformed(f"a tensor spec whose number {path!r} is {str(value)[:40]}")
    return spec


def _empty(spec: dict) -> list[torch.Tensor]:
    """Buffers for the tensors a spec announces (checked by _parse_spec where a worker sent it)."""
    return [torch.empty(shape, dtype=DTYPES[dtype]) for _, dtype, shape in spec["tensors"]]


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


def _recv_tensors(pg, spec: dict, src: int, tag: int, timeout_s: float) -> dict:
    """The tensors a (checked) spec announces, as the nested dict that was packed."""
    tensors = _empty(spec)
    for t in tensors:
        _wait(pg.recv([t], src, tag), timeout_s)
    return _unpack(spec, tensors)


def _recv_packed(pg, src: int, tag: int, timeout_s: float) -> dict | None:
    header = torch.zeros(HEADER, dtype=torch.long)
    _wait(pg.recv([header], src, tag), timeout_s)
    if not int(header[0]):
        return None
    return _recv_tensors(pg, json.loads(_recv_bytes(pg, int(header[0]), src, tag, timeout_s)), src, tag, timeout_s)


def _rows_json(rows: list) -> bytes:
    return json.dumps([[row, tensors] for row, tensors in rows]).encode()



# ------------------------------------------------------------------------------ the headers, at rank 0

HEADER_WAIT_S = 30 * 24 * 3600.0  # a header thread's receive: a worker may be silent for long (its evaluation, a
# checkpoint's wait), and a receive that times out makes gloo drop the whole group; the server's own wait on the
# queue is what gives up (_patience), and a dead worker's receive fails at once (its connection closes)


class Headers:
    """(rank 0) Every worker's next header, from a thread per rank blocked in a receive from that rank, in the
    order they arrive (not gloo's receive from any source: once a rank dies with a header sent and not yet received,
    that receive fails at every try, offering the dead rank's notice first, and the whole run would fail for one
    lost worker): `get` returns (rank, header), or (rank, the gloo error) once that rank's connection has failed. A
    thread receives a rank's next header only once the server has acted on its last (`next`), so each worker has
    one header in hand at most; a banned worker's is never received (`drop`)."""

    def __init__(self, pg, ranks: list[int]):
        self.pg, self.arrived = pg, queue.Queue()
        self.arrived_at: dict[int, float] = {}  # when each rank's last header came (time.monotonic)
        self.go_on = {r: threading.Semaphore(0) for r in ranks}
        self.dropped: set[int] = set()
        self.threads = [threading.Thread(target=self._receive, args=(r,), name=f"gem-headers-{r}", daemon=True)
                        for r in ranks]
        for t in self.threads:
            t.start()

    def _receive(self, rank: int) -> None:
        while rank not in self.dropped:
            header = torch.zeros(HEADER, dtype=torch.long)
            try:
                _wait(self.pg.recv([header], rank, TAG_ASK), HEADER_WAIT_S)
            except RuntimeError as e:
                # its text only: the error's traceback holds the failed receive and, through this frame, the group,
                # in a cycle that the garbage collector frees at some later time; freed that way, in the middle of
                # the next run of the process, they aborted it (SIGABRT, seen in the test suite, 3 times in 3)
                why = str(e)
            else:
                self.arrived_at[rank] = time.monotonic()
                self.arrived.put((rank, header))
                self.go_on[rank].acquire()
                continue
            self.arrived.put((rank, RuntimeError(why)))
            return

    def get(self, timeout_s: float):
        return self.arrived.get(timeout=timeout_s)

    def next(self, rank: int) -> None:
        """The server has acted on `rank`'s header: receive its next one."""
        self.go_on[rank].release()

    def drop(self, rank: int) -> None:
        """Receive nothing more from `rank` (banned, or the run is over)."""
        self.dropped.add(rank)
        self.go_on[rank].release()

    def close(self) -> None:
        """The run is over: a thread whose worker is still to send exits once it has (or its connection closes)."""
        for r in list(self.go_on):
            self.drop(r)

    def join(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) for every thread to end. Why: a thread whose receive ends (its
        worker's connection closes) while the interpreter is being torn down is ended by Python from inside torch's
        wait, where C++ cannot unwind, and the process aborts (`terminate called without an active exception`,
        pytorch/pytorch#38228): rank 0, interrupted, exited with 134 instead of 143 once the workers it had just
        killed closed their connections."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


# ------------------------------------------------------------------------------ what rank 0 accepts from a worker

# Every limit on what a worker sends, each with the reason for its value. Sizes that depend on the run (the model,
# the algorithm, the data) are worked out from the job in Bounds.of.
ROWS_PENDING = 4 * ROWS_PER_MESSAGE  # a worker's commits whose rows have not come: ROWS_PER_MESSAGE, and one in
# flight, for a worker that keeps the protocol; it is lost for holding back more
ROW_BYTES = 4096  # one row's dict: some twenty keys (step, worker, times, loss, the algorithm's metrics), each a
# name and a number, under 100 bytes of JSON apiece (its per-tensor lists are counted apart)
ROW_KEYS = 64  # keys of one row, a column each in metrics.parquet
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a row's key or a per-tensor statistic's: a column's name
NAME_BYTES = 72  # such a name in JSON, with its quotes and separators
NUMBER_BYTES = 32  # a number in JSON with its separator: a float64 takes at most 24 characters
TENSOR_SERIES = 16  # per-tensor statistics one row may carry (GEM's: 3), a list of one number per tensor each
TEXT_BYTES = 1 << 16  # a DIVERGED's reason or an ERROR's traceback (a worker cuts it there): the reason of the
# lost worker keeps its first line
CLOCK_DIGITS = 19  # a PULL's barrier, a clock value in decimal: an int64
SPEC_BYTES = 1 << 16  # a tensor spec: a name, a dtype and a shape per tensor, and a saved state's counters
SPEC_TENSORS = 256  # tensors in one spec: a worker state has its algorithm's few, x and its random streams'
STATE_SLACK = 1 << 20  # a saved worker state beside x, its algorithm state and its data order: its random states
INT64 = 1 << 63  # an integer in a row or a spec must fit an int64 column or shape
# how many bytes may follow a header of each kind (its `extra`): (at least, at most); READY's is b"1" from a worker
# that maps θ from shared memory (window.py)
EXTRA = {ASK: (0, 0), READY: (0, 1), FINISHED: (0, 0), DIVERGED: (1, TEXT_BYTES), ERROR: (1, TEXT_BYTES),
         SAVED: (1, SPEC_BYTES), PULL: (1, CLOCK_DIGITS), ROWS: (0, 0)}
# the keys a commit row must have, for the ledger and the recorder, and their types
ROW_SCHEMA = {"step": int, "worker": int, "worker_step": int, "staleness": int, "loss": float, "time_s": float}


class Malformed(ValueError):
    """A worker sent what rank 0 does not accept: the worker is lost. The message says what it sent, after 'it
    sent' (the lost worker's reason)."""


def _number(v) -> bool:
    """A JSON number that a parquet column holds: a float (NaN and infinities included), or an int64."""
    return type(v) is float or (type(v) is int and -INT64 <= v < INT64)


def payload_spec(algo, theta: torch.Tensor, hp) -> dict[str, list]:
    """The payload every commit of the algorithm carries, as name → [dtype, shape], from its record's `payload`
    (gem.algorithms.Algorithm); {} when it declares none."""
    declared = algo.payload(theta, hp) if algo.payload is not None else {}
    return {name: [str(t.dtype), list(t.shape)] for name, t in declared.items()}


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What rank 0 accepts from a worker, worked out from the job: each message is checked against it before
    anything it announces is allocated, received or applied (Malformed otherwise)."""

    algorithm: str
    tensors: int  # the model's parameter tensors: a per-tensor statistic has one number for each
    row_bytes: int  # one row in JSON, its per-tensor statistics included
    state_bytes: int  # a saved worker state's tensors, in all
    payload: dict  # a commit's payload, exactly: payload_spec

    @classmethod
    def of(cls, algo, hp, theta: torch.Tensor, tensors: int, train_examples: int) -> Bounds:
        # a worker's state is x (θ's size), its algorithm state (measured: init_state on θ), the order of its
        # examples (one int64 each) and its counters and random states (STATE_SLACK)
        state = algo.init_state(theta, hp)
        nbytes = theta.nbytes + sum(v.nbytes for v in state.values()) + 8 * train_examples + STATE_SLACK
        row = ROW_BYTES + TENSOR_SERIES * (NAME_BYTES + tensors * NUMBER_BYTES)
        return cls(algo.name, tensors, row, nbytes, payload_spec(algo, theta, hp))

    def header(self, kind: int, rows_nbytes: int, rows_count: int, extra_nbytes: int, pending: int) -> None:
        """A header's sizes, before anything that follows it is received; `pending`: the worker's commits whose
        rows have not come."""
        name = KINDS.get(kind)
        if name is None:
            raise Malformed(f"a header of unknown kind {kind}")
        header = f"{'an' if name[0] in 'AEIOU' else 'a'} {name} header"
        if min(rows_nbytes, rows_count, extra_nbytes) < 0:
            raise Malformed(f"{header} with a negative size ({rows_nbytes} bytes of rows, {rows_count} rows, "
                            f"{extra_nbytes} extra bytes)")
        if rows_count > pending:
            raise Malformed(f"{header} announcing the rows of {rows_count} commits, where {pending} of its commits "
                            "await rows")
        if kind == ROWS and not rows_count:
            raise Malformed(f"{header} with no rows")
        limit = rows_count * self.row_bytes
        if rows_nbytes > limit or (rows_nbytes == 0) != (rows_count == 0):
            raise Malformed(f"{header} announcing {rows_nbytes} bytes of rows for {rows_count} commits (at most "
                            f"{limit} allowed)")
        low, high = EXTRA[kind]
        if not low <= extra_nbytes <= high:
            raise Malformed(f"{header} announcing {extra_nbytes} bytes after its rows ({low} to {high} allowed)")

    def clock(self, extra: bytes) -> int:
        """A PULL's barrier: a clock value, a non-negative int64 in decimal."""
        if not re.fullmatch(rb"[0-9]{1,%d}" % CLOCK_DIGITS, extra) or int(extra) >= INT64:
            raise Malformed(f"a PULL whose clock is not a non-negative int64 ({extra[:CLOCK_DIGITS]!r})")
        return int(extra)

    def state(self, data: bytes) -> dict:
        """A SAVED's spec: no more tensors than a worker state has."""
        return _parse_spec(data, self.state_bytes)

    def commit(self, spec_nbytes: int) -> None:
        """A commit's first word: the length of its payload's spec, none where its commits carry no payload."""
        if not 0 <= spec_nbytes <= (SPEC_BYTES if self.payload else 0):
            raise Malformed(f"a commit announcing a payload spec of {spec_nbytes} bytes "
                            f"({f'at most {SPEC_BYTES}' if self.payload else 'none'} allowed: algorithm "
                            f"{self.algorithm}'s commits carry {self.payload or 'no payload'})")

    def payload_of(self, data: bytes) -> dict:
        """A commit's payload spec: exactly the tensors the algorithm's commits carry."""
        spec = _parse_spec(data, INT64)  # nothing is allocated unless it is exactly the payload declared
        got = {path: [dtype, shape] for path, dtype, shape in spec["tensors"]}
        if got != self.payload or spec["numbers"]:
            raise Malformed(f"a commit whose payload is {str(got or spec['numbers'])[:200]}, where algorithm "
                            f"{self.algorithm}'s commits carry {self.payload}")
        return spec

    def rows(self, text: bytes, worker: int, steps: list[int]) -> list[tuple[dict, dict | None]]:
        """A message's rows, [[row, per-tensor statistics or null], ...]: one for each commit in `steps`, which
        the header announced, in order, each of the schema the ledger and the recorder read."""
        try:
            rows = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise Malformed(f"rows that are not JSON ({str(e)[:100]})") from None
        if not isinstance(rows, list) or len(rows) != len(steps):
            raise Malformed(f"rows that are not a list of the {len(steps)} its header announced")
        out = []
        for entry, step in zip(rows, steps, strict=True):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], dict)):
                raise Malformed(f"a row that is not [row, tensors] ({str(entry)[:80]})")
            row, tensors = entry
            for key, kind in ROW_SCHEMA.items():
                if key not in row:
                    raise Malformed(f"a row without {key!r}")
                if not (_number(row[key]) and (kind is float or type(row[key]) is int)):
                    raise Malformed(f"a row whose {key!r} is {str(row[key])[:40]} (a {kind.__name__} is expected)")
            if (row["step"], row["worker"]) != (step, worker):
                raise Malformed(f"a row of worker {row['worker']} for commit {row['step']}, where its next row is "
                                f"worker {worker}'s for commit {step}")
            if len(row) > ROW_KEYS:
                raise Malformed(f"a row of {len(row)} keys (at most {ROW_KEYS} allowed)")
            for key, value in row.items():
                if not NAME.fullmatch(key) or key == "lost_row" or not (_number(value) or value is None):
                    raise Malformed(f"a row whose {key[:70]!r} is {str(value)[:40]} (a column name and a number "
                                    "are expected)")
            if tensors is not None:
                self.tensor_statistics(tensors)
            out.append((row, tensors))
        return out

    def tensor_statistics(self, tensors) -> None:
        """A row's per-tensor statistics: {name: [one number per parameter tensor]}."""
        if not (isinstance(tensors, dict) and 0 < len(tensors) <= TENSOR_SERIES):
            raise Malformed(f"per-tensor statistics that are not a dict of 1 to {TENSOR_SERIES} lists")
        for key, values in tensors.items():
            if not (NAME.fullmatch(key) and isinstance(values, list) and len(values) == self.tensors
                    and all(_number(v) for v in values)):
                raise Malformed(f"a per-tensor statistic {key[:70]!r} that is not {self.tensors} numbers")
