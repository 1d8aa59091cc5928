"""The distributed engine's wire: the group every rank joins, the messages its ranks exchange, and what both
sides agree on (message kinds, timeouts, the store key a waiting worker writes).

Nothing on the wire is a pickle, in either direction, so no rank runs code a peer sends: headers are int64
tensors; rows, tensor specs and the job are JSON; tensors travel raw, and a receiver makes buffers only of the
dtypes in DTYPES.

Every wait has a timeout, and gloo aborts the whole group (closes every connection) when one of its waits times
out: so rank 0's waits on a worker last well beyond the silence limit (`_patience`), and one expires only when no
worker can be heard from at all.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket

import torch
import torch.distributed as dist

START_TIMEOUT_S = 300.0  # a rank imports torch, loads the data and builds its model before it connects
BYE_TIMEOUT_S = 30.0  # a worker waits this long for the server's last answer

TAG_ASK, TAG_X, TAG_JOB = 1, 2, 3  # worker→server headers (any source); one exchange's messages; the job
# header kinds, worker → server on TAG_ASK
ASK, READY, FINISHED, DIVERGED, ERROR, SAVED, PULL = range(7)  # PULL: θ once the clock reaches t (a barrier)
# server → worker, first word of the reply to an ASK, PULL or FINISHED: [kind, t, τ]
GO, STOP, BYE, SAVE, WAIT = range(5)
HEADER = 4  # int64 words: [kind, rows_nbytes, rows_count, extra_nbytes]
# the dtypes a state or payload may have on the wire
DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.uint8, torch.bool)}


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
    """Inside a SLURM job started by Hydra's submitit launcher, set RANK, WORLD_SIZE, MASTER_ADDR, ... from the
    job's environment, as torchrun would. Does nothing elsewhere."""
    if launched() or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    if env.world_size > 1:
        env.export(set_cuda_visible_devices=False)


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

