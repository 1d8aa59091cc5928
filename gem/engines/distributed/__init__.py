"""The `distributed` engine: the parameter server is rank 0 of a torch.distributed group, the workers are the
other ranks, on one machine or many, over TCP (docs/design.md, "Engines").

Launch it with torchrun (`torchrun --nproc_per_node=N+1 run.py engine=distributed workers=N`, multi-node
forms in docs/distributed.md), under SLURM with Hydra's submitit launcher, or from one command on one machine:
`python run.py engine=distributed workers=N` starts the N workers itself (from the forkserver of
gem.engines.worker's `worker_context`, as the process engine does), bound to loopback.

Transport: gloo point-to-point (BENCHMARKS.md, "Transport for the distributed engine": against
torch.distributed.rpc it moves an AlexNet commit 2.5x faster, and it serves first come, first served where
rpc's server lock is not first in, first out). Each rank builds its own `ProcessGroupGloo` on the job's store,
so nothing global is touched and several runs can follow one another in one process (a sweep).

Each worker runs the shared worker cycle (gem.engines.worker); its link makes one commit one exchange with the
server, the `process` engine's turn over the wire:

    worker                                   server (rank 0, one exchange at a time)
    ASK [+ its last commit rows]  ─────────▶ takes headers in arrival order (a thread per rank)
                                  ◀───────── GO t, τ, the live θ and the algorithm's server tensors
    worker_rule(…, view of θ)
    COMMIT Δ [+ payload]          ─────────▶ server.apply: server_rule(θ, Δ, τ), t ← t + 1
    server.apply on its replica of θ: the same θ the server now holds; pull.

So a commit costs two model-sized messages, and the algorithms run unchanged: the worker rule sees the live θ and the
server state, exactly as in the process engine, and staleness is measured on the server's clock. A windowed algorithm
talks to the server only when it commits. A worker on rank 0's own host takes θ from shared memory instead and leaves
its Δ there (window.py, `engine.shared_memory`): the same exchange, with only its headers on the wire. The workers of
a local launch, all on rank 0's host, do without the exchange: they pass the turn among themselves and apply their
commits to θ in shared memory (or on their GPU, where they all compute on one: CUDA IPC), as on the process engine
(gem.engines.turn), and send only their rows; rank 0 learns who made each commit from the window's log. On one
machine that is what brings `distributed` to the speed of `process` (BENCHMARKS.md): an exchange wakes a thread of
another process at each of its steps, and on a machine whose cores the workers keep busy each wake-up waits for a
core.

The engine by concern, each file read top to bottom; each imports only those above it:

    doors.py     once a rank's group has formed, nobody new reaches it: its listeners (gloo's, the store's)
                 refuse new connections, and rank 0 cuts store connections that no admitted worker holds and
                 empties its store
    group.py     the group every rank joins: the launcher's environment (torchrun's, submitit's), gloo's
                 devices, the group itself, and how long its waits last (rank 0's patience with a worker)
    messages.py  the messages: tags, kinds, the header's layout; bytes, nested dicts of tensors (a JSON spec
                 and raw tensors) and rows as JSON; Malformed, for what rank 0 does not accept
    secret.py    the run's secret, a worker's proof of it, and rank 0's admission of the workers
    headers.py   rank 0's threads that take the workers' headers, one per rank, in arrival order (Headers)
    bounds.py    what rank 0 accepts from a worker: every limit, with its reason, and the checks (Bounds)
    job.py       the job on the wire: JSON and raw tensors, rebuilt field for field by the worker, which imports
                 only what its own side allows
    address.py   a local launch's address: loopback unless engine.allow_remote=true; the port and, for a
                 launch over several machines, the secret checked
    window.py    θ and the server's tensors in shared memory, for the workers on rank 0's host, with a slot
                 for each one's Δ (or, for a local launch's workers, the clock and the commit log)
    link.py      a worker rank's Link to the server, whatever the transport: headers, requests, a
                 checkpoint's state, a barrier's pull, the run of the worker cycle
    link_wire.py   ... each commit one exchange with rank 0 (θ out, Δ back; or through the window's slots)
    link_turn.py   ... a local launch's worker: the server's turn among the workers, θ in the window
    rank.py      a worker rank's process: join, prove the secret, take the job, run with its transport's Link
    server.py    rank 0's server thread, whatever the transport: the headers, where each worker stands, the
                 checkpoint barrier, the answers
    server_wire.py  ... the exchanges over the wire, applied one at a time (in full duplex where the rule allows)
    server_turn.py  ... a local launch: the turn's line, and the commits read from the window's log
    shards.py    θ cut into slices, each served by its own rank (engine.servers): a shard's server, and rank 0's
                 hand on the others
    placement.py where θ lives and how the workers reach it (Placement), decided once from the job and the launch
    launch.py    rank 0: the run (the group, the local workers, the job) and the coordinator
"""

from gem.engines.distributed.address import check_address, check_host, check_port
from gem.engines.distributed.group import export_submitit_env, launched, launched_rank
from gem.engines.distributed.job import decode_job, encode_job
from gem.engines.distributed.launch import run
from gem.engines.distributed.link import WAITING_S
from gem.engines.distributed.messages import ASK
from gem.engines.distributed.rank import worker_main

__all__ = [
    "run",
    "worker_main",
    "launched",
    "launched_rank",
    "export_submitit_env",
    "check_address",
    "check_host",
    "check_port",
    "encode_job",
    "decode_job",
    "ASK",
    "WAITING_S",
]
