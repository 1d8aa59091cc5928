"""A worker rank: it joins the group, proves the run's secret, takes the job from rank 0 (importing only what its
own side allows: job.allowed_imports) and runs the shared worker cycle (gem.engines.worker) with the Link its
transport gives: link_wire.WireLink (each commit one exchange with rank 0) or, for a local launch's workers given
the server's turn, link_turn.TurnLink (they commit in rank 0's shared-memory window). A rank after the n workers
serves one of θ's shards instead (engine.servers > 1: shards.ShardServer)."""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist

from gem.engines.distributed.bounds import TEXT_BYTES
from gem.engines.distributed.doors import listening, refuse_newcomers
from gem.engines.distributed.group import NO_SECRET, form_group, launched_group, leave, timedelta_of
from gem.engines.distributed.job import DONE, allowed_imports, decode_job, decode_start, recv_job
from gem.engines.distributed.link import ServerGone, send_header
from gem.engines.distributed.link_turn import TurnLink
from gem.engines.distributed.link_wire import WireLink
from gem.engines.distributed.messages import ERROR, TAG_JOB, recv_packed
from gem.engines.distributed.secret import SECRET_ENV, launched_secret, prove
from gem.engines.distributed.shards import ShardServer
from gem.engines.turn import Turn
from gem.engines.worker import START_TIMEOUT_S, setup_process, threads_per_process


def worker_main(timeout_s: float = START_TIMEOUT_S, allowed=()) -> int:
    """A rank > 0 started by torchrun or SLURM: join the group, prove the run's secret, take the job from rank 0,
    work, exit. `allowed`: the import paths its own command line names (job.allowed_imports)."""
    try:
        secret = launched_secret()  # before joining: a worker without it would only be refused
    except ValueError as e:  # rank 0 hears of it at once, and the node's output says it once (group.leave)
        line = f"error: {e}"
        leave(NO_SECRET, lambda: print(line, file=sys.stderr, flush=True))
        return 2
    threads = threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    store, pg, rank, _world = launched_group(timeout_s)
    return _work(pg, rank, threads, secret, allowed_imports(allowed), ignore_sigint=False, store=store)


def local_worker(
    rank: int,
    world: int,
    host: str,
    port: int,
    timeout_s: float,
    threads: int,
    secret: str,
    allowed: tuple[str, ...],
    turn: Turn | None = None,
    alive=None,
    handed: dict | None = None,
) -> None:
    """A worker of a local launch (`python run.py engine=distributed`): rank 0, its parent, hands it the run's
    secret and the import paths of its job as arguments, never over the network; and, where θ is in shared
    memory, the server's turn, which the workers then pass among themselves (window.py), with `alive`, the read
    end of a pipe only rank 0 writes to (end of file once rank 0 is gone: a worker waiting in line exits), and
    `handed`: θ and the server's tensors where they live on the workers' GPU (CUDA IPC handles)."""
    try:
        before = listening()
        store = dist.TCPStore(host, port, world, False, timeout=timedelta_of(timeout_s))
        pg = form_group(store, rank, world, host, timeout_s)
        refuse_newcomers(before)  # gloo's listener: nobody is left to connect to it (doors.py)
        _work(pg, rank, threads, secret, allowed_imports(allowed), store=store, turn=turn, alive=alive, handed=handed)
    finally:
        # rank 0 can free GPU memory it shared only once every process that received it has let go of it; this
        # process ends in os._exit, which runs no finaliser, and its Process object holds `handed` to the end
        if handed is not None:
            handed.clear()
            gc.collect()


def _work(
    pg,
    rank: int,
    threads: int,
    secret: str,
    allowed: frozenset[str],
    ignore_sigint: bool = True,
    store=None,
    turn: Turn | None = None,
    alive=None,
    handed: dict | None = None,
) -> int:
    setup_process(threads, ignore_sigint)
    try:
        prove(pg, rank, secret, START_TIMEOUT_S, getattr(store, "port", None))
        text, tensors = recv_job(pg, START_TIMEOUT_S)
        saved = recv_packed(pg, 0, TAG_JOB, START_TIMEOUT_S)  # this worker's state, when the run resumes
    except RuntimeError as e:
        print(
            f"gem: worker rank {rank}: no job from rank 0 ({str(e).splitlines()[0] if str(e) else e!r}); rank 0 "
            f"sends none to a worker that does not prove the run's secret ({SECRET_ENV})",
            file=sys.stderr,
        )
        return 1
    try:
        job, start = decode_job(text, tensors, allowed), decode_start(text)
        if start is None:
            raise ValueError("rank 0 sent no Start with the job")
    except (ValueError, TypeError, KeyError) as e:  # rank 0 records the worker lost, with this line
        why = f"{type(e).__name__}: {e}"
        print(f"gem: worker rank {rank} refuses its job: {why}", file=sys.stderr, flush=True)
        try:
            send_header(pg, ERROR, b"", 0, why.encode()[:TEXT_BYTES], START_TIMEOUT_S)
        except RuntimeError:
            pass
        return 1
    if rank > job.workers:  # not a worker: the server of one of θ's shards (engine.servers; shards.py)
        try:
            ShardServer(pg, rank, job, saved).serve()
        except (RuntimeError, ValueError) as e:
            print(f"gem: shard server rank {rank}: {str(e).splitlines()[0] if str(e) else e!r}", file=sys.stderr)
            return 1
        return 0
    if saved == DONE:  # a resumed run whose checkpoint has this worker finished, or lost: nothing to do
        return 0
    if turn is None:
        link = WireLink(pg, rank, job, start, store)
    else:
        link = TurnLink(pg, rank, job, start, store, turn=turn, alive=alive, handed=handed)
    try:
        link.run(saved)
    except ServerGone:
        return 1
    return 0
