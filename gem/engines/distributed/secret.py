"""The run's secret and a worker's proof of it. A worker proves the run's secret (`run_secret`, GEM_RUN_SECRET)
before it gets the job or θ: rank 0 sends each worker a fresh nonce, and admits only those that answer with the
nonce signed with the secret (`admit`; the worker's side: `prove`). The proof travels in the clear (gloo's traffic
is not encrypted): it cannot be made without the secret, and, the nonce being fresh, it is of no use a second time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import torch

from gem.engines.distributed.doors import ENDPOINTS_BYTES, held_endpoints, parse_endpoints
from gem.engines.distributed.group import single_node
from gem.engines.distributed.messages import TAG_JOB, connection_closed, recv_bytes, send_bytes, wait

SECRET_ENV, SECRET_FILE_ENV = "GEM_RUN_SECRET", "GEM_RUN_SECRET_FILE"
SECRET_MIN_CHARS = 16  # a proof travels in the clear: a short secret could be found from one by trying them all
NONCE_BYTES = 32  # rank 0's challenge to each worker, fresh for each run: a proof seen once cannot be replayed
SECRET_HINT = (
    f'export {SECRET_ENV}=$(python -c "import secrets; print(secrets.token_hex(16))") on every host '
    f"(the same value), or name a file that holds it in {SECRET_FILE_ENV}"
)


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
        raise ValueError(
            f"{where} holds a secret of {len(secret)} characters, and the run's secret needs at least "
            f"{SECRET_MIN_CHARS}: {SECRET_HINT}"
        )
    return secret


def launched_secret() -> str:
    """The secret of a rank that a launcher started. Required when the ranks span machines: a worker is then any
    process that reaches rank 0 over the network. On one machine it is optional ('' proves nothing): gloo's
    connections are bound to loopback there (group.launched_group), so every peer is a process of this machine, as
    in a local launch (torchrun's store may listen wider, but no process elsewhere can open a gloo connection to a
    rank bound to loopback); set one all the same where other users share the machine."""
    secret = run_secret()
    if secret is None and not single_node():
        raise ValueError(
            f"{SECRET_ENV} is not set, and a launch over several machines needs the run's secret so that "
            f"only its own workers can join: {SECRET_HINT}"
        )
    return secret or ""


def _proof(secret: str, nonce: bytes, rank: int) -> bytes:
    """Worker `rank`'s answer to rank 0's nonce: HMAC-SHA256 keyed with the run's secret. It cannot be made without
    the secret, and, the nonce being fresh, one seen on the wire (gloo's traffic is not encrypted) is of no use
    to anyone later."""
    return hmac.new(secret.encode(), f"gem-worker/{rank}/".encode() + nonce, hashlib.sha256).digest()


PROOF_BYTES = hashlib.sha256().digest_size


def admit(pg, ranks: list[int], secret: str, timeout_s: float) -> tuple[dict[int, str], set[tuple[str, int]]]:
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
            wait(sends[r], timeout_s)
            wait(pg.recv([proof], r, TAG_JOB), timeout_s)
            ends = recv_bytes(pg, ENDPOINTS_BYTES, r, TAG_JOB, timeout_s)  # taken in any case: its send returns
            if hmac.compare_digest(proof.numpy().tobytes(), _proof(secret, nonces[r], r)):
                held |= parse_endpoints(ends)
            else:
                refused[r] = f"rank {r} refused: it did not prove the run's secret ({SECRET_ENV})"
        except RuntimeError as e:
            if not connection_closed(e):
                raise RuntimeError(
                    f"worker rank {r} did not answer rank 0's challenge within {timeout_s:.0f} s; "
                    "gloo gives up on the whole group after such a wait"
                ) from None
            refused[r] = f"rank {r} refused: its connection closed before it proved the run's secret"
    return refused, held


def prove(pg, rank: int, secret: str, timeout_s: float, store_port: int | None = None) -> None:
    """A worker: answer rank 0's nonce (admit), and name its connections to the job's store at `store_port`."""
    nonce = torch.zeros(NONCE_BYTES, dtype=torch.uint8)
    wait(pg.recv([nonce], 0, TAG_JOB), timeout_s)
    send_bytes(pg, _proof(secret, nonce.numpy().tobytes(), rank), 0, TAG_JOB, timeout_s)
    send_bytes(pg, held_endpoints(store_port), 0, TAG_JOB, timeout_s)
