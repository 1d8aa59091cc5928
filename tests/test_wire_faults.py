"""A peer cannot break a run (engine=distributed): a worker rank that sends what the protocol does not allow is lost,
with a reason that names what it sent, and the run completes with the others; a peer without the run's secret is
refused before it gets the job or θ; a job cannot make a worker import what its own side does not allow.

Rank 0 runs as `launch.run` runs it once the group has formed (`launch._serve`: the handshake, the jobs, the
coordinator and its server thread); its workers are threads of this process, each with its own gloo group on one
store: an honest worker (`rank._work`, the real one) and a `Peer` that speaks the protocol by hand.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers.paths import ROOT
from helpers.procs import is_cut, stranger

from gem import algorithms
from gem.algorithms import gem
from gem.data import make_synthetic
from gem.engines import Job
from gem.engines.coordinator import start_server
from gem.engines.core import Evaluator, build_flat_model
from gem.engines.distributed import bounds, doors, group, launch, rank, secret, server
from gem.engines.distributed import job as wire_job
from gem.engines.distributed.group import form_group, timedelta_of
from gem.engines.distributed.job import Start, decode_job, encode_job, job_for_workers, recv_job
from gem.engines.distributed.launch import _Coordinator
from gem.engines.distributed.messages import (
    ASK,
    ERROR,
    FINISHED,
    GO,
    PULL,
    READY,
    SAVE,
    SAVED,
    TAG_ASK,
    TAG_JOB,
    TAG_X,
    recv_packed,
    send_bytes,
    wait,
)
from gem.engines.distributed.secret import prove
from gem.engines.distributed.window import Window
from gem.engines.server import Server
from gem.metrics import Recorder, read_table
from gem.models import MnistCNN, ModelSpec

SECRET = "a-test-secret-of-32-characters.."
WAIT_S = 30.0


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=128, val_size=32, seed=1)


@pytest.fixture(autouse=True)
def worker_threads(monkeypatch):
    """The honest worker runs in a thread of this process: it must leave the process's signals and heap as they
    are (setup_process is for a worker process of its own)."""
    monkeypatch.setattr(rank, "setup_process", lambda threads, ignore_sigint=True: None)


def job(data, hp=None, model="mnist_cnn", full_duplex=False, **kw):
    """GEM's job for two workers. The Peers below speak the exchange served whole (θ with GO, the commit back),
    which `full_duplex=False` keeps for GEM; `full_duplex=True`: GEM's rule runs at rank 0, and a worker sends its
    gradient in place of its commit (server_wire.py)."""
    return Job(
        algorithm="gem",
        hp=hp or gem.Params(workers=2),
        model=model,
        data=data,
        workers=2,
        batch_size=32,
        epochs=1,
        seed=0,
        engine={"name": "distributed", "timeout_s": 60, "full_duplex": full_duplex},
        eval_every=100,
        eval_train_size=32,
        **kw,
    )


class Peer:
    """A worker rank that speaks the protocol by hand, to send what a real worker never would. What it sends
    that rank 0 will not take is posted and not waited on, and so are the receives of answers that may not come
    (`posted`)."""

    def __init__(self, pg, rank: int = 2, secret: str = SECRET, allowed=frozenset()):
        self.pg, self.rank, self.secret, self.allowed = pg, rank, secret, allowed
        self.posted: list = []  # works kept alive, never waited on
        self.steps: list[int] = []  # the steps of its commits, from the GO replies

    def join(self) -> None:
        prove(self.pg, self.rank, self.secret, WAIT_S)
        text, tensors = recv_job(self.pg, WAIT_S)
        recv_packed(self.pg, 0, TAG_JOB, WAIT_S)
        job = decode_job(text, tensors, self.allowed)
        theta = build_flat_model(job, device="cpu").param.clone()
        self.server = Server.create(algorithms.get(job.algorithm), job.hp, theta, job.workers)

    def header(self, kind: int, rows_nbytes: int = 0, rows_count: int = 0, extra_nbytes: int = 0) -> None:
        """A header, which rank 0's header thread for this rank takes."""
        h = torch.tensor([kind, rows_nbytes, rows_count, extra_nbytes], dtype=torch.long)
        wait(self.pg.send([h], 0, TAG_ASK), WAIT_S)

    def send(self, data: bytes, taken: bool = False) -> None:
        """Bytes on the exchange's tag, waited on where rank 0 takes them."""
        if taken:
            send_bytes(self.pg, data, 0, TAG_X, WAIT_S)
        else:
            self.posted.append(self.pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], 0, TAG_X))

    def post_answer(self) -> None:
        """A receive for an answer that may never come (BYE, or nothing once rank 0 has banned this rank)."""
        self.posted.append(self.pg.recv([torch.zeros(4, dtype=torch.long)], 0, TAG_X))

    def turn(self, duplex: bool = False) -> None:
        """ASK, then GO with θ and the server's tensors (once every worker is ready); `duplex` (an algorithm whose
        worker rule reads no θ): GO alone."""
        self.header(ASK)
        reply = torch.zeros(4, dtype=torch.long)
        wait(self.pg.recv([reply], 0, TAG_X), WAIT_S)
        assert int(reply[0]) == GO, reply
        self.steps.append(int(reply[1]) + 1)  # the clock before this commit
        for t in () if duplex else (self.server.theta, *self.server.state.values()):
            wait(self.pg.recv([t], 0, TAG_X), WAIT_S)

    def commit(self, spec_nbytes: int = 0, refused: bool = False, delta=None) -> None:
        """A commit of Δ (0 unless given) announcing a payload spec of `spec_nbytes` bytes; `refused`: rank 0 will
        not take Δ."""
        wait(self.pg.send([torch.tensor([spec_nbytes, 0], dtype=torch.long)], 0, TAG_X), WAIT_S)
        delta = torch.zeros_like(self.server.theta) if delta is None else delta
        if refused:
            self.posted.append(self.pg.send([delta], 0, TAG_X))
        else:
            wait(self.pg.send([delta], 0, TAG_X), WAIT_S)

    def pulled(self) -> torch.Tensor:
        """Full duplex: θ as rank 0 sends it back once this worker's commit is applied."""
        wait(self.pg.recv([self.server.theta], 0, TAG_X), WAIT_S)
        return self.server.theta

    def rows(self, **changes) -> bytes:
        """The rows a real worker sends for its commits so far (with `changes` to each)."""
        return json.dumps(
            [
                [
                    {
                        "step": t,
                        "worker": self.rank - 1,
                        "worker_step": k + 1,
                        "staleness": 1,
                        "loss": 2.3,
                        "time_s": 0.1 * k,
                        "wait_s": 0.0,
                        **changes,
                    },
                    None,
                ]
                for k, t in enumerate(self.steps)
            ]
        ).encode()

    def finish(self, rows: bytes) -> None:
        """Its last word, FINISHED, with `rows` for its commits; rank 0's BYE may never come."""
        self.header(FINISHED, len(rows), len(self.steps) if rows else 0)
        if rows:
            self.send(rows, taken=True)
        self.post_answer()


def _groups_beside(port: int, ranks, world: int) -> dict:
    """The gloo groups of `ranks`, formed in threads of this process on the TCPStore at `port`, beside a rank that
    another process forms there: a store client each (one client is not shared across threads)."""
    pgs: dict = {}
    threads = [
        threading.Thread(
            target=lambda r=r: pgs.__setitem__(
                r, form_group(dist.TCPStore("127.0.0.1", port, world, False), r, world, "127.0.0.1", WAIT_S)
            )
        )
        for r in ranks
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pgs


def _groups(world: int) -> dict:
    """Every rank's gloo group, on one store, formed at once (each rank's constructor waits for the others)."""
    store, pgs = dist.HashStore(), {}
    threads = [
        threading.Thread(target=lambda r=r: pgs.__setitem__(r, form_group(store, r, world, "127.0.0.1", WAIT_S)))
        for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return pgs


def rank0(j: Job, run_dir, pg, slots: int = 0):
    """Rank 0 as launch.run runs it once its group (`pg`) has formed, serving `j` to ranks 1 and 2 until the run
    ends; returns its result. `slots`: θ in shared memory (window.py) for workers 0 .. slots - 1; 0: none."""
    rec = Recorder(run_dir)
    srv, _ = start_server(j, algorithms.get(j.algorithm), build_flat_model(j, device="cpu").param.clone())
    window = Window.create(srv, slots) if slots else None
    if window is not None:
        srv = window.adopt(srv)
    coord = _Coordinator(j, rec, srv, Evaluator(j, j.data), None)
    start = Start(t0_wall=coord.t0_wall, train_examples=len(j.data.train_y), window=window and window.described())
    try:
        return launch._serve(
            coord, pg, SECRET, encode_job(job_for_workers(j), start), {1: None, 2: None}, [], None, window
        )
    finally:
        rec.close()
        if window is not None:
            window.unlink()


def serve(j: Job, run_dir, peer_script, honest_allowed=frozenset(), peer_allowed=frozenset(), slots: int = 0):
    """Rank 0 serves `j` to an honest worker (rank 1, worker 0) and to a Peer (rank 2, worker 1) that runs
    `peer_script`; returns the result and the run's rows. What fails in the Peer's thread is raised here."""
    pgs = _groups(3)
    peer, failed = Peer(pgs[2], allowed=peer_allowed), []

    def run_peer():
        try:
            peer_script(peer)
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            failed.append(e)

    honest = threading.Thread(
        target=rank._work, args=(pgs[1], 1, 1, SECRET, honest_allowed), kwargs={"ignore_sigint": False}, daemon=True
    )
    other = threading.Thread(target=run_peer, daemon=True)
    honest.start()
    other.start()
    result = rank0(j, run_dir, pgs[0], slots)
    honest.join(WAIT_S)
    other.join(WAIT_S)
    assert not honest.is_alive() and not other.is_alive()
    if failed:
        raise failed[0]
    return result, read_table(run_dir)


def lost_peer(result, m, sent: str | tuple[str, ...]) -> None:
    """Worker 1 (the Peer) lost for what it sent (`sent`, or one of them), and only it; worker 0 did all its work,
    and the clock in the rows has no gap."""
    assert result.status == "completed", result
    assert result.extra["lost_workers"] == [1], result
    assert result.reason.startswith("worker 1 lost at commit "), result.reason
    assert any(f"(it sent {s}" in result.reason for s in ((sent,) if isinstance(sent, str) else sent)), result.reason
    assert result.reason.count("lost at commit") == 1, result.reason
    honest = m[m["worker"] == 0]
    assert sorted(honest["worker_step"]) == [1, 2, 3, 4]  # 128 examples, batches of 32
    assert sorted(m["step"]) == list(range(1, len(m) + 1))


def ready(p) -> None:
    p.join()
    p.header(READY)


def works(p) -> None:
    """A Peer that does what a worker does: its 4 commits (128 examples, batches of 32), then FINISHED with their
    rows."""
    ready(p)
    for _ in range(4):
        p.turn()
        p.commit()
    p.finish(p.rows())


# --------------------------------------------------------------------------------- faulty messages, one by one


def test_rows_of_more_commits_than_it_made_lose_only_that_worker(data, tmp_path):
    """It was: IndexError (pop from an empty deque) in the server thread; the run failed, and a live worker's
    rows were marked lost."""

    def script(p):
        ready(p)
        p.turn()
        p.commit()
        p.header(ASK, 100, 5)  # the rows of 5 commits: it made 1
        p.send(b"x" * 100)

    result, m = serve(job(data), tmp_path, script)
    lost_peer(result, m, "an ASK header announcing the rows of 5 commits, where 1 of its commits await rows)")
    assert m.loc[m["worker"] == -1, "lost_row"].tolist() == [True]  # the Peer's commit, whose row never came
    assert m.loc[m["worker"] == 0, "lost_row"].isna().all()


@pytest.mark.parametrize(
    "rows, sent",
    [
        (b"not json", "rows that are not JSON (Expecting value: line 1 column 1 (char 0))"),
        # nested past Python 3.11's recursion limit; 3.12's json decoder reads it (seen on the GPU machine's 3.12), and
        # the row check refuses it: either way only that worker is lost, for what it sent
        (
            b"[" * 3000 + b"]" * 3000,
            ("rows that are not JSON (maximum recursion depth exceeded", "a row that is not [row, tensors] ([[[["),
        ),
        (b'{"rows": 1}', "rows that are not a list of the 1 its header announced"),
        (b'[[{"worker": 1}, null]]', "a row without 'step'"),
        (None, "a row of worker 0 for commit"),  # another worker's row
        ({"loss": "low"}, "a row whose 'loss' is low (a float is expected)"),
        ({"lost_row": True}, "a row whose 'lost_row' is True (a column name and a number are expected)"),
        ({"x" * 65: 1}, "a row whose 'xxxxx"),
    ],
    ids=["not-json", "nested", "not-a-list", "no-step", "another-workers", "a-string", "lost_row", "a-long-key"],
)
def test_rows_that_are_not_rows_lose_only_that_worker(data, tmp_path, rows, sent):
    """It was: JSONDecodeError or KeyError in the coordinator, which decodes the rows, and the run failed. The
    rows come with the Peer's last word, FINISHED, as a worker's last rows do."""

    def script(p):
        ready(p)
        p.turn()
        p.commit()
        if rows is None:
            text = p.rows(worker=0)
        elif isinstance(rows, dict):
            text = p.rows(**rows)
        else:
            text = rows
        p.finish(text)

    result, m = serve(job(data), tmp_path, script)
    lost_peer(result, m, sent)
    assert m.loc[m["worker"] == -1, "lost_row"].tolist() == [True]


def test_rows_as_a_worker_sends_them_pass(data, tmp_path):
    """The checks let through what workers send: the honest worker's (GEM's metrics and per-tensor statistics)
    and the Peer's rows for its own commits."""
    result, m = serve(job(data), tmp_path, works)
    assert result.status == "completed" and result.extra["lost_workers"] == [], result
    assert sorted(m["worker"]) == [0] * 4 + [1] * 4 and m.loc[m["worker"] == 0, "pi_median"].notna().all()
    assert len(read_table(tmp_path, "tensors")) == 4 * len(dict(MnistCNN().named_parameters()))


def test_a_saved_state_nobody_asked_for_loses_only_that_worker(data, tmp_path):
    """It was: TypeError ('NoneType' object is not subscriptable) in the server thread, and the run failed."""

    def script(p):
        ready(p)
        p.header(SAVED, extra_nbytes=40)
        p.send(json.dumps({"numbers": {}, "tensors": []}).encode().ljust(40))

    result, m = serve(job(data), tmp_path, script)
    lost_peer(result, m, "its state (SAVED) though no checkpoint asked it for its state")


@pytest.mark.parametrize(
    "header, sent",
    [
        ((ASK, -1, 0, 0), "an ASK header with a negative size (-1 bytes of rows, 0 rows, 0 extra bytes)"),
        ((ERROR, 0, 0, 1 << 40), "an ERROR header announcing 1099511627776 bytes after its rows (1 to 65536 allowed)"),
        ((ERROR, 0, 0, 0), "an ERROR header announcing 0 bytes after its rows (1 to 65536 allowed)"),  # no reason
        ((ASK, 0, 0, 4 << 30), "an ASK header announcing 4294967296 bytes after its rows (0 to 0 allowed)"),
        ((99, 0, 0, 0), "a header of unknown kind 99"),
        ((READY, 0, 0, 0), "READY a second time"),
        ((PULL, 0, 0, 25), "a PULL header announcing 25 bytes after its rows (1 to 19 allowed)"),
    ],
)
def test_a_header_out_of_bounds_loses_only_that_worker(data, tmp_path, monkeypatch, header, sent):
    """A negative size, or a terabyte announced, was 'did not answer for 30 s' and the run failed; 4 GiB
    announced and 10 bytes sent grew rank 0 to 9 GB. Now nothing that follows such a header is received or
    allocated, and what the banned Peer sends afterwards (three more ASKs) is read and dropped, never answered."""
    taken = []
    real = server.recv_bytes
    monkeypatch.setattr(server, "recv_bytes", lambda pg, n, *a: taken.append(n) or real(pg, n, *a))

    def script(p):
        ready(p)
        p.header(*header)
        p.send(b"0123456789")
        for _ in range(3):
            p.posted.append(p.pg.send([torch.tensor([ASK, 0, 0, 0])], 0, TAG_ASK))

    result, m = serve(job(data), tmp_path, script)
    lost_peer(result, m, sent)
    assert max(taken) < 1 << 16  # the honest worker's rows: what rank 0 took from its workers, message by message


@pytest.mark.parametrize(
    "slots, extra, sent",
    [
        (0, b"1", "a READY header saying that it maps θ from shared memory, where rank 0 keeps none"),
        (1, b"1", "a READY header saying that it maps θ from shared memory, where only workers 0 to 0 have a slot"),
        (2, b"x", "a READY header followed by b'x' (b'1', that it maps θ from shared memory, or nothing)"),
    ],
)
def test_a_ready_claiming_a_slot_it_has_not_loses_only_that_worker(data, tmp_path, slots, extra, sent):
    """Only a worker that rank 0's window gives a slot may say it maps θ (it would commit a Δ nobody sent);
    the honest worker beside it maps the window where it has a slot, and works as over the wire."""

    def script(p):
        p.join()
        p.header(READY, extra_nbytes=len(extra))
        p.send(extra, taken=True)

    result, m = serve(job(data), tmp_path, script, slots=slots)
    lost_peer(result, m, sent)
    assert result.extra["shared_memory_workers"] == ([0] if slots else [])


@pytest.mark.parametrize("clock", [b"-5", b"1e3", b"9" * 19])
def test_a_pull_whose_clock_is_not_a_clock_loses_only_that_worker(data, tmp_path, clock):
    def script(p):
        ready(p)
        p.header(PULL, extra_nbytes=len(clock))
        p.send(clock, taken=True)

    result, m = serve(job(data), tmp_path, script)
    lost_peer(result, m, f"a PULL whose clock is not a non-negative int64 ({clock!r})")


def test_a_commit_with_a_payload_its_algorithm_has_not_loses_only_that_worker(data, tmp_path):
    def script(p):
        ready(p)
        p.turn()
        p.commit(spec_nbytes=1 << 30, refused=True)

    result, m = serve(job(data), tmp_path, script)
    lost_peer(
        result,
        m,
        "a commit announcing a payload spec of 1073741824 bytes (none allowed: algorithm gem's "
        "commits carry no payload)",
    )
    assert (m["worker"] >= 0).all()  # its commit was not applied: no step waits for its row


@pytest.mark.parametrize("proxy", ["local", "global"])
def test_a_commit_announcing_a_payload_to_a_rule_run_at_rank_0_loses_only_that_worker(data, tmp_path, proxy):
    """GEM's rule runs at rank 0 over the wire (full duplex): a worker sends exactly its gradient, and the payload
    (the global proxy's m) is made at rank 0. A commit that announces a payload spec is refused before anything
    after it is received, and not applied, under either proxy."""
    size = build_flat_model(job(data), device="cpu").param.numel()

    def script(p):
        ready(p)
        p.turn(duplex=True)
        p.commit(spec_nbytes=64, refused=True)

    result, m = serve(job(data, hp=gem.Params(workers=2, proxy=proxy), full_duplex=True), tmp_path, script)
    lost_peer(
        result,
        m,
        f"a commit announcing a payload spec of 64 bytes (none allowed: algorithm gem's rule runs at the server, "
        f"which takes {{'grad': ['torch.float32', [{size}]]}} from a worker)",
    )
    assert (m["worker"] >= 0).all()  # its commit was not applied: no step waits for its row
    assert m["pi_median"].notna().all()  # the honest worker's rows have the statistics rank 0 computed


def test_a_saved_state_with_no_algorithm_state_for_rank_0s_m_and_s_loses_only_that_worker(data, tmp_path):
    """Where GEM's rule runs at rank 0, rank 0 puts the m and s it keeps into each worker's saved state: one whose
    state has no algorithm state to put them into is lost for it (it was a KeyError in the server thread, and the
    run failed). The Peer commits a zero gradient until a checkpoint asks it for its state."""
    size = build_flat_model(job(data), device="cpu").param.numel()

    def script(p):
        ready(p)
        reply = torch.zeros(4, dtype=torch.long)
        for _ in range(400):  # (the coordinator asks for the checkpoint when it next looks at the clock)
            p.header(ASK)
            wait(p.pg.recv([reply], 0, TAG_X), WAIT_S)
            if int(reply[0]) == SAVE:
                break
            assert int(reply[0]) == GO, reply
            p.steps.append(int(reply[1]) + 1)
            p.commit()  # its gradient: zeros
            for back in (p.server.theta, nbytes := torch.zeros(1, dtype=torch.long)):
                wait(p.pg.recv([back], 0, TAG_X), WAIT_S)
            wait(p.pg.recv([torch.empty(int(nbytes[0]), dtype=torch.uint8)], 0, TAG_X), WAIT_S)
            time.sleep(0.05)
        assert int(reply[0]) == SAVE, "no checkpoint asked for the Peer's state"
        spec = json.dumps({"numbers": {"step": 0}, "tensors": [["x", "torch.float32", [size]]]}).encode()
        p.header(SAVED, extra_nbytes=len(spec))
        p.send(spec, taken=True)
        p.posted.append(p.pg.send([torch.zeros(size)], 0, TAG_X))
        p.post_answer()

    j = job(data, full_duplex=True, run_dir=str(tmp_path), checkpoint_every=1)
    result, m = serve(j, tmp_path, script)
    lost_peer(result, m, "a saved state without its algorithm state (a dict of tensors)")


def test_a_payload_other_than_the_algorithms_is_refused_before_it_is_allocated(data, tmp_path):
    """GEM's global proxy: each commit carries m, of θ's shape; a spec that announces a billion floats is
    refused, where it was allocated (4 GB)."""
    size = build_flat_model(job(data), device="cpu").param.numel()

    def script(p):
        ready(p)
        p.turn()
        spec = json.dumps({"numbers": {}, "tensors": [["m", "torch.float32", [10**9]]]}).encode()
        p.commit(spec_nbytes=len(spec))
        p.send(spec, taken=True)

    result, m = serve(job(data, hp=gem.Params(workers=2, proxy="global")), tmp_path, script)
    lost_peer(
        result,
        m,
        f"a commit whose payload is {{'m': ['torch.float32', [1000000000]]}}, where algorithm "
        f"gem's commits carry {{'m': ['torch.float32', [{size}]]}}",
    )


def test_a_worker_that_holds_back_its_rows_is_lost(data, tmp_path):
    """A worker sends its rows at least every ROWS_PER_MESSAGE commits; rank 0 keeps no more than ROWS_PENDING of
    a worker's commits waiting for their rows (their steps, and every later row, in memory)."""

    def script(p):
        ready(p)
        for _ in range(bounds.ROWS_PENDING + 1):
            p.turn()
            p.commit()

    result, m = serve(job(data), tmp_path, script)
    lost_peer(
        result,
        m,
        f"no rows for its last {bounds.ROWS_PENDING + 1} commits (at most {bounds.ROWS_PENDING} may await rows)",
    )
    assert (m["worker"] == -1).sum() == bounds.ROWS_PENDING + 1


# ------------------------------------------------------------------------------------------------ the secret


def test_a_peer_without_the_runs_secret_is_refused_and_gets_nothing(data, tmp_path):
    job_header = torch.zeros(4, dtype=torch.long)

    def script(p):
        prove(p.pg, 2, "not-the-secret-but-long-enough", WAIT_S)
        p.posted.append(p.pg.recv([job_header], 0, TAG_JOB))  # the job's header: it never comes

    result, m = serve(job(data), tmp_path, script)
    assert result.status == "completed" and result.extra["lost_workers"] == [1], result
    assert result.reason == (
        "worker 1 lost at commit 0 (rank 2 refused: it did not prove the run's secret (GEM_RUN_SECRET))"
    )
    assert job_header.tolist() == [0, 0, 0, 0]  # nothing came: neither the job nor θ
    assert sorted(m.loc[m["worker"] == 0, "worker_step"]) == [1, 2, 3, 4]


def test_the_proof_is_bound_to_the_secret_the_nonce_and_the_rank():
    nonce = b"n" * secret.NONCE_BYTES
    proof = secret._proof(SECRET, nonce, 2)
    assert len(proof) == secret.PROOF_BYTES
    assert proof == secret._proof(SECRET, nonce, 2)
    for other in (
        secret._proof(SECRET + "x", nonce, 2),
        secret._proof(SECRET, b"m" * secret.NONCE_BYTES, 2),
        secret._proof(SECRET, nonce, 3),
    ):
        assert other != proof


@pytest.mark.parametrize(
    "sent",
    [
        b"\xff\xfe",
        b"not json",
        b"{}",
        b'"127.0.0.1"',
        b"[[1, 2]]",
        b'[["x", 80]]',
        b'[["127.0.0.1", 0]]',
        b'[["127.0.0.1", 70000]]',
        b'[["127.0.0.1", "80"]]',
        json.dumps([["127.0.0.1", p] for p in range(1, doors.MAX_ENDPOINTS + 2)]).encode(),
        b'[["127.0.0.1", true]]',
        b"[" * 300,
    ],
)
def test_the_store_endpoints_a_worker_names_are_a_peers_bytes(sent):
    """What a worker sends with its proof (doors.cut_strangers keeps its store connections): anything but a short
    list of [address, port] names nothing, and a worker that sends it keeps no store connection, and nothing else
    changes."""
    assert doors.parse_endpoints(sent.ljust(doors.ENDPOINTS_BYTES)) == set()


def test_a_store_endpoint_is_one_socket_end_however_its_family_shows_it():
    sent = json.dumps([["::ffff:10.0.0.2", 5000], ["10.0.0.3", 5001], ["fe80::1%eth0", 5002]]).encode()
    assert doors.parse_endpoints(sent.ljust(doors.ENDPOINTS_BYTES)) == {
        ("10.0.0.2", 5000),
        ("10.0.0.3", 5001),
        ("fe80::1", 5002),
    }


# ------------------------------------------------------- once the group has formed, nobody new reaches a rank

linux_only = pytest.mark.skipif(not doors.LINUX, reason="doors.py works on Linux only (/proc, socket filters)")


def _connects(port: int) -> bool:
    """Whether a connection to `port` completes within half a second."""
    s = socket.socket()
    s.settimeout(0.5)
    try:
        s.connect(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _accepted(port: int, ends: set[str]) -> None:
    """Wait until the store (its own thread) has accepted the connections from `ends`: the kernel completes a
    connection before then, and one not yet accepted has no socket in this process to cut."""
    deadline = time.monotonic() + 30
    while ends - {"{}:{}".format(*far) for _, _, _, local, far in doors._tcp_sockets() if far and local[1] == port}:
        assert time.monotonic() < deadline, f"the store did not accept {ends}"
        time.sleep(0.02)


@linux_only
def test_a_launched_rank_refuses_newcomers_once_its_group_has_formed(monkeypatch):
    """torchrun's or SLURM's rank (`launched_group`, here a group of one holding its env:// store): its listeners,
    the store's and gloo's, complete no new connection; a listener it had before is left alone."""
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(k, v)
    kept = socket.create_server(("127.0.0.1", 0))
    try:
        store, pg, _, _ = group.launched_group(WAIT_S)
        assert store.port == port and not _connects(port)
        gloo = [q for q in _ports_listening() if q != kept.getsockname()[1]]
        assert gloo and not any(_connects(q) for q in gloo if q != port)
        assert _connects(kept.getsockname()[1])
    finally:
        kept.close()


def _ports_listening() -> set[int]:
    """The ports this process listens on now."""
    return {local[1] for _, _, listens, local, _ in doors._tcp_sockets() if listens}


@linux_only
def test_rank_0_cuts_the_store_connections_no_admitted_worker_holds():
    """A store that torch made (listening on IPv6's any address: IPv4 peers show as ::ffff:...): a connection
    from another process is cut unless an admitted worker named its end (as that process sees it); rank 0's own
    connection to its store goes on working."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta_of(WAIT_S), wait_for_workers=False)
    admitted, its_end = stranger(store.port)
    other, other_end = stranger(store.port)
    try:
        _accepted(store.port, {its_end, other_end})
        address, port = its_end.rsplit(":", 1)
        keep = doors.parse_endpoints(json.dumps([[address, int(port)]]).encode())
        assert doors.cut_strangers(store.port, keep) == [other_end]
        assert is_cut(other)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert doors.cut_strangers(store.port, keep) == []  # the admitted one stays
        assert doors.cut_strangers(int(port), set()) == []  # a port this process does not listen on
    finally:
        for p in (admitted, other):
            p.kill()
            p.wait()


@linux_only
def test_rank_0_empties_its_store_once_the_workers_are_admitted(monkeypatch):
    """What anyone stored on rank 0's store before the workers were admitted (a stranger's values, the group's
    formation keys) is deleted, and its memory given back; gem's later keys work. Not where this process does not
    hold the store, nor with lazy gloo, whose pairs still need the formation's keys."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta_of(WAIT_S), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta_of(WAIT_S), wait_for_workers=False)
    for i in range(5):
        client.set(f"stranger/{i}", b"x" * 4096)
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    assert doors.empty_store(store, store.port) == 0 and store.num_keys() >= 5
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT")
    other = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta_of(WAIT_S), wait_for_workers=False)
    other.set("k", b"v")
    with socket.create_server(("127.0.0.1", 0)) as gone:
        port = gone.getsockname()[1]
    assert doors.empty_store(other, port) == 0 and other.get("k") == b"v"  # a port this process does not listen on
    assert doors.empty_store(store, store.port) == 5
    assert not store.check([f"stranger/{i}" for i in range(5)]) and store.list_keys() == []
    assert int(client.add(group.waiting_key(1), 1)) == 1  # gem's own keys, after


@linux_only
def test_a_store_that_cannot_list_its_keys_is_left_as_it_is_in_one_line(capsys):
    """A torch whose store has no list_keys (older than pip may find): rank 0 says so once, and goes on."""
    import types

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta_of(WAIT_S), wait_for_workers=False)
    store.set("k", b"v")
    assert doors.empty_store(types.SimpleNamespace(port=store.port), store.port) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("gem: rank 0 cannot empty the job's store")
        and err[0].endswith("it stays for the run")
    )
    assert store.get("k") == b"v"


@linux_only
def test_looking_at_a_socket_leaves_its_blocking_mode_as_it_was():
    """doors.py reads torch's sockets through their descriptors: a Python socket object made on one would make it
    non-blocking for torch too wherever a default timeout is set (socket.setdefaulttimeout)."""
    s = socket.create_server(("127.0.0.1", 0))
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5.0)
    try:
        s.setblocking(True)
        assert os.get_blocking(s.fileno())
        doors.refuse_newcomers(doors.listening() - {os.fstat(s.fileno()).st_ino})
        assert os.get_blocking(s.fileno()) and not _connects(s.getsockname()[1])
    finally:
        socket.setdefaulttimeout(before)
        s.close()


@linux_only
def test_with_lazy_gloo_pairs_the_listeners_stay_open(monkeypatch):
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "Yes")
    before = doors.listening()
    s = socket.create_server(("127.0.0.1", 0))
    try:
        assert doors.refuse_newcomers(before) == [] and _connects(s.getsockname()[1])
    finally:
        s.close()


@pytest.fixture
def two_machines(monkeypatch):
    """This process as a rank of a torchrun launch over two machines of 2 ranks each, without a secret."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    for k in (secret.SECRET_ENV, secret.SECRET_FILE_ENV):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


NO_SECRET = (
    "GEM_RUN_SECRET is not set, and a launch over several machines needs the run's secret so that only its "
    'own workers can join: export GEM_RUN_SECRET=$(python -c "import secrets; print(secrets.token_hex(16))")'
    " on every host (the same value), or name a file that holds it in GEM_RUN_SECRET_FILE"
)


def test_a_launch_over_several_machines_without_a_secret_is_refused_in_one_line(two_machines):
    from experiments.config import ConfigError, check_job

    with pytest.raises(ConfigError) as e:
        check_job(["engine=distributed", "workers=3"])
    assert str(e.value) == NO_SECRET


def test_a_worker_without_the_secret_says_so_before_it_joins(two_machines, capsys):
    two_machines.setenv("RANK", "1")
    assert rank.worker_main(timeout_s=1) == 2  # it would otherwise wait for the group to form
    assert capsys.readouterr().err.splitlines() == [f"error: {NO_SECRET}"]


NOT_JOINED = "a rank that fails before it joins never will: its node's output says why"
LEFT_WITHOUT_SECRET = (
    "exited before joining without the run's secret (on that node GEM_RUN_SECRET is not set, GEM_RUN_SECRET_FILE "
    "cannot be read, or the secret is shorter than 16 characters: its output says which; export the same "
    "GEM_RUN_SECRET on every node)"
)


def _joined(store, *ranks):
    for r in ranks:
        store.set(group.joining_key(r), "1")


def test_rank_0_names_the_ranks_that_have_not_joined_and_gives_up_at_its_limit(capsys):
    """Gloo's group waits for every rank and says nothing while it does: rank 0 first waits for each to say it
    joins, names those that have not after engine.timeout_s (then twice as long each time), and gives up at the
    start's limit."""
    store = dist.HashStore()
    _joined(store, 0, 1)
    with pytest.raises(RuntimeError) as e:
        group.await_ranks(store, 4, say_after_s=0.2, timeout_s=1.0, poll_s=0.02)
    assert str(e.value) == f"ranks 2-3 did not join within 1 s; {NOT_JOINED}"
    lines = capsys.readouterr().err.splitlines()
    said = f"gem: rank 0: ranks 2-3 have not joined after N s (the run fails at 1 s without them); {NOT_JOINED}"
    assert 1 <= len(lines) <= 3 and {re.sub(r"after \d+ s", "after N s", line) for line in lines} == {said}, lines
    # once every rank has said it joins, rank 0 goes on to form the group
    later = threading.Timer(0.3, _joined, (store, 2, 3))
    later.start()
    group.await_ranks(store, 4, say_after_s=60, timeout_s=30, poll_s=0.02)
    later.join()
    assert capsys.readouterr().err == ""


def test_rank_0_ends_the_start_at_once_when_a_rank_leaves_word_that_it_has_no_secret():
    store = dist.HashStore()
    _joined(store, 0, 1)
    store.set(group.leaving_key(2), group.NO_SECRET)
    store.add(group.LEAVING_COUNT, 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        group.await_ranks(store, 4, say_after_s=60, timeout_s=300)
    assert time.monotonic() - started < 5
    assert str(e.value) == f"rank 2 {LEFT_WITHOUT_SECRET}; rank 3 has not joined either; the group needs every rank"
    # what a rank left is never printed: rank 0 says it in its own words
    store.set(group.leaving_key(3), "\x1b[2J anything at all")
    store.add(group.LEAVING_COUNT, 1)
    with pytest.raises(RuntimeError) as e:
        group.await_ranks(store, 4, say_after_s=60, timeout_s=300)
    assert str(e.value) == (
        f"rank 2 {LEFT_WITHOUT_SECRET}; rank 3 exited before joining with an error (that node's output says "
        "which); the group needs every rank"
    )


def test_a_nodes_ranks_without_the_secret_say_so_once(two_machines):
    """torchrun's agent starts a node's ranks with one environment: each finds no secret, and one line per node
    says so (the first to reach the job's store; on rank 0's node, rank 0); each leaves word for rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta_of(WAIT_S), wait_for_workers=False)
    two_machines.setenv("MASTER_ADDR", "127.0.0.1")
    two_machines.setenv("MASTER_PORT", str(store.port))
    said = []
    for node, r in [(1, 2), (1, 3), (2, 4), (2, 5)]:
        two_machines.setenv("GROUP_RANK", str(node))
        two_machines.setenv("RANK", str(r))
        group.leave(group.NO_SECRET, lambda r=r: said.append(r), timeout_s=5)
    assert said == [2, 4]
    assert [store.get(group.leaving_key(r)) for r in (2, 3, 4, 5)] == [group.NO_SECRET.encode()] * 4
    # on rank 0's node, rank 0 says it (it refuses the run), and torchrun then stops the others: the first of
    # them says it only if that has not happened within the wait
    two_machines.setenv("GROUP_RANK", "0")
    two_machines.setenv("RANK", "1")
    started = time.monotonic()
    group.leave(group.NO_SECRET, lambda: said.append(1), timeout_s=0.5)
    assert said == [2, 4, 1] and time.monotonic() - started >= 0.5
    # a rank that cannot reach the store says it all the same
    two_machines.delenv("MASTER_ADDR")
    group.leave(group.NO_SECRET, lambda: said.append("here"), timeout_s=5)
    assert said == [2, 4, 1, "here"]


def _torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not on PATH")
    return exe


@pytest.mark.slow  # two torchrun nodes of 2 processes each, on loopback: 15 s
def test_a_node_without_the_secret_ends_the_run_at_once_and_says_so_once(tmp_path):
    """docs/distributed.md's multi-node command, both nodes on this machine's loopback, node 1 without
    GEM_RUN_SECRET: its ranks exit 2 before they join, and rank 0 ends the run at once, saying why, instead of
    waiting in gloo's silent wait for them to the start's limit (300 s)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free a moment ago: torchrun's agent on node 0 listens on it
    d = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in (secret.SECRET_ENV, secret.SECRET_FILE_ENV)}
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    procs = []
    for i, secret_env in enumerate([{secret.SECRET_ENV: SECRET}, {}]):
        argv = [
            _torchrun(),
            "--nnodes=2",
            "--nproc_per_node=2",
            f"--node_rank={i}",
            "--rdzv_backend=static",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "run.py",
            "engine=distributed",
            "workers=3",
            "data=synthetic",
            "data.synthetic.train_size=256",
            "data.synthetic.val_size=128",
            "batch_size=32",
            "logger.wandb.mode=disabled",
            "logger.progress=false",
            f"hydra.run.dir={d}",
        ]
        with open(tmp_path / f"node{i}.log", "w") as out:
            procs.append(
                subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env={**env, **secret_env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        for i, p in enumerate(procs):
            try:
                p.wait(120)  # before: node 0 waited 300 s, and said nothing
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {i} still runs after 120 s:\n{(tmp_path / f'node{i}.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = [(tmp_path / f"node{i}.log").read_text(errors="replace") for i in range(2)]
    assert [p.returncode for p in procs] == [1, 1], logs
    # node 1: the error once, not once per rank
    assert [line for line in logs[1].splitlines() if line.startswith("error:")] == [f"error: {NO_SECRET}"], logs[1]
    # node 0: rank 0 ends the run, failed, naming the ranks and why
    errors = [line for line in logs[0].splitlines() if line.startswith("error:")]
    # (the second of node 1's ranks may be stopped by its torchrun before it leaves word too)
    left = rf"(rank [23]|ranks 2-3) {re.escape(LEFT_WITHOUT_SECRET)}"
    said = rf"{left}(; rank [23] has not joined either)?; the group needs every rank"
    where = re.escape(str(d / "error.txt"))
    assert len(errors) == 1 and re.fullmatch(
        rf"error: run failed with RuntimeError: the group did not form: {said} \(traceback in {where}\)", errors[0]
    ), logs[0]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "failed" and LEFT_WITHOUT_SECRET in summary["reason"]


def test_the_secret_comes_from_the_environment_or_a_file(two_machines, tmp_path):
    two_machines.setenv(secret.SECRET_ENV, SECRET)
    assert secret.launched_secret() == SECRET
    two_machines.delenv(secret.SECRET_ENV)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    two_machines.setenv(secret.SECRET_FILE_ENV, str(path))
    assert secret.launched_secret() == SECRET
    path.write_text("short\n")
    with pytest.raises(ValueError, match=r"holds a secret of 5 characters, and the run's secret needs at least 16"):
        secret.launched_secret()
    two_machines.setenv(secret.SECRET_FILE_ENV, str(tmp_path / "none"))
    with pytest.raises(ValueError, match=r"^GEM_RUN_SECRET_FILE=.*none cannot be read"):
        secret.launched_secret()
    two_machines.delenv(secret.SECRET_FILE_ENV)
    two_machines.setenv("LOCAL_WORLD_SIZE", "4")  # one machine: gloo on loopback, and the secret is optional
    assert secret.launched_secret() == ""


# --------------------------------------------------------------------------- what a job may make a worker import


class OutsideNet(MnistCNN):
    """A model outside gem's own, by import path (this test module's)."""


def _naming(data, algorithm=None, model=None) -> tuple[bytes, dict]:
    """A job as rank 0 sends it, naming `algorithm` or `model` (JSON, as a peer speaking for rank 0 could)."""
    text, tensors = encode_job(job_for_workers(job(data)))
    message = json.loads(text)
    fields = message["job"]
    if algorithm is not None:
        fields["algorithm"] = algorithm
    if model is not None:
        fields["model"] = {"spec": dataclasses.asdict(model)}
    return json.dumps(message).encode(), tensors


def test_a_job_naming_code_outside_the_allowed_set_is_refused_before_any_import(data, monkeypatch):
    monkeypatch.delenv(wire_job.IMPORTS_ENV, raising=False)
    module = "email.mime.audio"  # stands for a module that a job must not make a worker import
    sys.modules.pop(module, None)
    hydra = {"_target_": "gem.models.MnistCNN", "inner": [{"_target_": f"{module}:MIMEAudio"}]}
    for named, text in [
        (f"{module}.MIMEAudio", _naming(data, model=ModelSpec("x", f"{module}.MIMEAudio"))),
        (f"{module}:MIMEAudio", _naming(data, model=ModelSpec("x", wire_job.INSTANTIATE, {"config": hydra}))),
        (module, _naming(data, algorithm=module)),
    ]:
        with pytest.raises(ValueError, match=rf"^the job names {named}, which this worker does not import"):
            decode_job(*text)
        assert module not in sys.modules
    # what its own side allows: its command line's paths (given), or GEM_ALLOWED_IMPORTS (a path allows what is
    # under it); gem's own models by import path need neither
    text = _naming(data, model=ModelSpec("x", f"{module}.MIMEAudio"))
    assert decode_job(*text, wire_job.allowed_imports([f"{module}.MIMEAudio"])).model.name == "x"
    monkeypatch.setenv(wire_job.IMPORTS_ENV, "json, email.mime")
    assert decode_job(*text, wire_job.allowed_imports()).model.name == "x"
    own = ModelSpec("m", "gem.models.MnistCNN")
    assert decode_job(*_naming(data, model=own)).model == own


def test_a_worker_refuses_a_job_its_side_does_not_allow_and_the_run_goes_on(data, tmp_path):
    """Rank 0 runs a model by import path; the honest worker's side does not allow it: it says so to rank 0 (an
    ERROR), which records it lost; the Peer's side allows it, and it does the work."""
    j = job(data, model=ModelSpec("outside", f"{__name__}.OutsideNet"))
    result, m = serve(j, tmp_path, works, peer_allowed=wire_job.allowed_imports([f"{__name__}.OutsideNet"]))
    assert result.status == "completed" and result.extra["lost_workers"] == [0], result
    # (the Peer may have made any of its 4 commits before rank 0 has read the refusal: seen loaded, at commit 3)
    assert re.fullmatch(
        rf"worker 0 lost at commit [0-4] \(raised ValueError: the job names {__name__}\.OutsideNet, "
        r"which this worker does not import: a worker imports gem's own algorithms and models, the "
        r"import paths of its own command line and model configs, and those listed in "
        r"GEM_ALLOWED_IMPORTS \(comma-separated\) on its host\)",
        result.reason,
    ), result.reason
    assert sorted(m["worker"]) == [1] * 4


def test_a_worker_allows_what_its_own_command_names():
    """Under torchrun a worker rank composes no config; it allows the import paths of its command line, which is
    every rank's, and of its machine's model configs."""
    from experiments import instantiate

    got = instantiate.worker_imports(
        None,
        [
            "engine=distributed",
            "model._target_=my_models.Net",
            "+model.encoder._target_='my_models.Encoder'",
            "algorithm.name=pkg.algo",
            "lr=0.1",
            "data._target_=torchvision.datasets.KMNIST",
        ],
    )
    assert got == {
        "gem.models.MnistCNN",
        "gem.models.AlexNetCifar",
        "gem.models.resnet18_cifar",
        "my_models.Net",
        "my_models.Encoder",
        "pkg.algo",
    }


# ----------------------------------------------------------------------------- a worker that dies mid-message


def _ask_and_die(port: int, asked) -> None:
    """A worker process (rank 2) that sends its request for the turn and dies before rank 0 has taken it."""
    import os

    pg = form_group(dist.TCPStore("127.0.0.1", port, 3, False), 2, 3, "127.0.0.1", WAIT_S)
    p = Peer(pg)
    ready(p)
    p.posted.append(pg.send([torch.tensor([ASK, 0, 0, 0])], 0, TAG_ASK))
    asked.set()
    os._exit(0)


@pytest.mark.slow  # a process of its own: 4 s
def test_a_worker_that_dies_with_its_request_on_the_way_is_lost_and_the_run_goes_on(data, tmp_path):
    """It was: gloo's receive from any source offers a dead rank's pending send first and fails on it at every
    try, so once a worker died with its request sent and not yet taken, the whole run failed (2 of 10 kills of
    a worker at b = 4). Here it dies while the other worker (a Peer) holds the turn, so that rank 0 cannot have
    taken its request; the Peer then commits four times and finishes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    asked = ctx.Event()
    dying = ctx.Process(target=_ask_and_die, args=(store.port, asked), daemon=True)
    dying.start()
    pgs = _groups_beside(store.port, (0, 1), 3)
    peer, failed = Peer(pgs[1], rank=1), []

    def script():
        try:
            ready(peer)
            peer.turn()  # holds the turn while the other worker asks and dies
            assert asked.wait(WAIT_S)
            dying.join(WAIT_S)
            peer.commit()
            for _ in range(3):
                peer.turn()
                peer.commit()
            peer.finish(peer.rows())
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            failed.append(e)

    th = threading.Thread(target=script, daemon=True)
    th.start()
    try:
        result = rank0(job(data), tmp_path, pgs[0])
    finally:
        dying.join(WAIT_S)
    th.join(WAIT_S)
    if failed:
        raise failed[0]
    assert dying.exitcode == 0
    assert result.status == "completed" and result.extra["lost_workers"] == [1], result
    assert result.reason.startswith("worker 1 lost at commit ") and "its connection closed" in result.reason, (
        result.reason
    )
    m = read_table(tmp_path)
    assert sorted(m.loc[m["worker"] == 0, "worker_step"]) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------- full duplex


def _commit_and_die(port: int, committed) -> None:
    """A DOWNPOUR worker process (rank 2) that commits Δ = 0.5 and dies before θ comes back to it."""
    pg = form_group(dist.TCPStore("127.0.0.1", port, 3, False), 2, 3, "127.0.0.1", WAIT_S)
    p = Peer(pg)
    ready(p)
    p.turn(duplex=True)
    p.commit(delta=torch.full_like(p.server.theta, 0.5))
    committed.set()
    os._exit(0)


@pytest.mark.slow  # a process of its own: 4 s
def test_a_full_duplex_worker_gets_theta_after_its_commit_and_one_dying_before_it_comes_is_lost_alone(data, tmp_path):
    """DOWNPOUR's worker rule reads no θ, so GO carries none and θ comes back after the commit is applied
    (server_wire.py). A worker that dies with θ on its way back is lost, its commit applied and its row a
    `lost_row`; the other worker's θ is θ₀ plus both commits, as the server applied them, and it finishes."""
    import multiprocessing as mp

    from gem.algorithms import downpour

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    committed = ctx.Event()
    dying = ctx.Process(target=_commit_and_die, args=(store.port, committed), daemon=True)
    dying.start()
    pgs = _groups_beside(store.port, (0, 1), 3)
    peer, failed, pulled = Peer(pgs[1], rank=1), [], []

    def script():
        try:
            ready(peer)
            theta0 = peer.server.theta.clone()
            assert committed.wait(WAIT_S)
            dying.join(WAIT_S)
            for _ in range(4):
                peer.turn(duplex=True)
                peer.commit(delta=torch.full_like(theta0, 0.25))
                pulled.append(peer.pulled().clone())
            pulled.insert(0, theta0)
            peer.finish(peer.rows())
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            failed.append(e)

    th = threading.Thread(target=script, daemon=True)
    th.start()
    try:
        j = dataclasses.replace(job(data, full_duplex=True), algorithm="downpour", hp=downpour.Params())
        result = rank0(j, tmp_path, pgs[0])
    finally:
        dying.join(WAIT_S)
    th.join(WAIT_S)
    if failed:
        raise failed[0]
    assert result.status == "completed" and result.extra["lost_workers"] == [1], result
    assert "its connection closed" in result.reason, result.reason
    m = read_table(tmp_path)
    assert peer.steps == [2, 3, 4, 5] and sorted(m["step"]) == [1, 2, 3, 4, 5]
    assert m.loc[m["step"] == 1, "lost_row"].tolist() == [True]
    expected = pulled[0] + 0.5  # the dead worker's commit, applied first
    for theta in pulled[1:]:
        expected = expected + 0.25
        assert torch.equal(theta, expected)
