"""The messages the ranks of a distributed run exchange: their tags, the kinds of header a worker sends and of reply
rank 0 sends, the header's layout, and how bytes, nested dicts of tensors and commit rows travel.

Nothing on the wire is a pickle, in either direction: headers are int64 tensors; rows, tensor specs and the job
are JSON; tensors travel raw, and a receiver makes buffers only of the dtypes in DTYPES. So no rank runs code a
peer sends. What a worker imports is named by the job, and it imports only what its own side allows
(job.allowed_imports). What rank 0 accepts of what a worker sends is bounds.py's.
"""

from __future__ import annotations

import json

import torch

from gem.engines.distributed.group import timedelta_of

TAG_ASK, TAG_X, TAG_JOB = 1, 2, 3  # worker→server headers; one exchange's messages; the job
# sharded servers (shards.py): a shard's answers to rank 0; the word a shard sends rank 0 at its end
TAG_SHARD, TAG_ALIVE = 4, 5
# header kinds, worker → server on TAG_ASK
# PULL: θ once the clock reaches t (a barrier); ROWS: commit rows alone, from a worker that takes its turn in shared
# memory (a local launch: window.py)
ASK, READY, FINISHED, DIVERGED, ERROR, SAVED, PULL, ROWS = range(8)
# to a shard's rank on TAG_ASK (shards.py): a worker's PUSH (its slice of a commit follows); rank 0's requests
# (FETCH_KEPT: a worker's tensors kept there, the worker's rank in the header's second word)
PUSH, FETCH_THETA, FETCH_STATE, END, FETCH_KEPT = range(8, 13)
# server → worker, first word of the reply to an ASK, PULL or FINISHED: [kind, t, τ]
GO, STOP, BYE, SAVE, WAIT = range(5)
HEADER = 4  # int64 words: [kind, rows_nbytes, rows_count, extra_nbytes]
KINDS = {
    ASK: "ASK",
    READY: "READY",
    FINISHED: "FINISHED",
    DIVERGED: "DIVERGED",
    ERROR: "ERROR",
    SAVED: "SAVED",
    PULL: "PULL",
    ROWS: "ROWS",
}
# the dtypes a state or payload may have on the wire
DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


class Malformed(ValueError):
    """A worker sent what rank 0 does not accept: the worker is lost. The message says what it sent, after 'it
    sent' (the lost worker's reason). Raised by the checks of bounds.py, and here by a tensor spec whose paths
    collide."""


def wait(work, timeout_s: float) -> None:
    work.wait(timedelta_of(timeout_s))


def send_bytes(pg, data: bytes, dst: int, tag: int, timeout_s: float) -> None:
    wait(pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, tag), timeout_s)


def recv_bytes(pg, nbytes: int, src: int, tag: int, timeout_s: float) -> bytes:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    wait(pg.recv([buf], src, tag), timeout_s)
    return buf.numpy().tobytes()


def connection_closed(e: Exception) -> bool:
    """A gloo error that means the peer's connection is gone (it died), not that the group timed out."""
    text = str(e)
    return "Connection closed" in text or "Connection reset" in text or "Broken pipe" in text


# ------------------------------------------------------------------------------------ tensors on the wire


def pack(d: dict, prefix: str = "") -> tuple[dict, list[torch.Tensor]]:
    """A nested dict of tensors and numbers as (JSON-able spec, tensors): nothing needs unpickling."""
    spec: dict = {"numbers": {}, "tensors": []}
    tensors: list[torch.Tensor] = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and not v:
            spec["numbers"][path] = {}  # an empty state (downpour's) must come back as one
        elif isinstance(v, dict):
            sub, ts = pack(v, path + "/")
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


def _empty(spec: dict) -> list[torch.Tensor]:
    """Buffers for the tensors a spec announces (checked by bounds.Bounds where a worker sent it)."""
    return [torch.empty(shape, dtype=DTYPES[dtype]) for _, dtype, shape in spec["tensors"]]


def send_packed(pg, d: dict | None, dst: int, tag: int, timeout_s: float) -> None:
    """A nested dict of tensors and numbers, or None (a header of zero)."""
    spec, tensors = pack(d or {})
    data = json.dumps(spec).encode() if d else b""
    wait(pg.send([torch.tensor([len(data), 0, 0, 0], dtype=torch.long)], dst, tag), timeout_s)
    if not data:
        return
    send_bytes(pg, data, dst, tag, timeout_s)
    works = [pg.send([t], dst, tag) for t in tensors]
    for w in works:
        wait(w, timeout_s)


def recv_tensors(pg, spec: dict, src: int, tag: int, timeout_s: float) -> dict:
    """The tensors a (checked) spec announces, as the nested dict that was packed."""
    tensors = _empty(spec)
    for t in tensors:
        wait(pg.recv([t], src, tag), timeout_s)
    return _unpack(spec, tensors)


def recv_packed(pg, src: int, tag: int, timeout_s: float) -> dict | None:
    header = torch.zeros(HEADER, dtype=torch.long)
    wait(pg.recv([header], src, tag), timeout_s)
    if not int(header[0]):
        return None
    return recv_tensors(pg, json.loads(recv_bytes(pg, int(header[0]), src, tag, timeout_s)), src, tag, timeout_s)


def rows_json(rows: list) -> bytes:
    return json.dumps([[row, tensors] for row, tensors in rows]).encode()
