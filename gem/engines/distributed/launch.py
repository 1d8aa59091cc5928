"""Rank 0: the run. `run` starts the group (the launcher's ranks, or, for a local launch, N worker processes
forked from gem.engines.worker's `worker_context` and bound to `engine.host`), has each worker prove the run's
secret, sends each worker that did its job, and hands over to the coordinator (`_serve`). A local launch makes
its own secret and hands it to its workers as they start; a launched run takes it from the environment
(secret.launched_secret).

The server's exchanges run on a thread of rank 0 (gem.engines.distributed.server); its main thread, the
coordinator (`_Coordinator`, on gem.engines.coordinator's loop), records rows in clock order, evaluates θ, writes
checkpoints and watches the workers. A local launch with θ in shared memory hands its workers the server's turn
(`Turn`), which they pass among themselves: the coordinator then takes it to read θ for an evaluation, counts a
worker waiting in line as not silent, and, losing a worker, kills it and takes its turn back before it reads the
worker's last commits from the window's log. A worker lost (its connection closes, its process dies) or silent is
recorded and the run goes on. Silent is the `process` engine's rule, written once (gem.engines.coordinator's
`Silence`): no progress for longer than max(engine.timeout_s, engine.silent_cycles x the median time between two
commits of a worker), where rank 0 times every commit it applies; a worker that says on the job's store that it
waits for the server is not to blame. A silent worker of a local launch is killed, which closes its connection
and ends any wait on it. The coordinator keeps the server's waits on a worker at `group.patience` of the silence limit.
At the end every worker gets an answer (BYE or STOP) and exits; workers also exit when the server disappears.
"""

from __future__ import annotations

import os
import queue
import secrets
import sys
import threading
import time

import torch
import torch.distributed as dist

from gem import algorithms
from gem.engines import Job, Result
from gem.engines import checkpoint as ckpt
from gem.engines.coordinator import POLL_S, Coordinator, start_server
from gem.engines.core import Evaluator, build_flat_model
from gem.engines.distributed.address import check_host, local_address, open_listener, warn_once
from gem.engines.distributed.bounds import Bounds
from gem.engines.distributed.doors import cut_strangers, empty_store, listening, refuse_newcomers
from gem.engines.distributed.group import (
    BYE_TIMEOUT_S,
    form_group,
    launched,
    launched_group,
    patience,
    timedelta_of,
    waiting_key,
)
from gem.engines.distributed.job import DONE, Start, encode_job, job_for_workers, named_imports, send_job
from gem.engines.distributed.messages import TAG_JOB, Malformed, send_packed
from gem.engines.distributed.placement import Placement
from gem.engines.distributed.rank import local_worker
from gem.engines.distributed.secret import admit, launched_secret, run_secret
from gem.engines.distributed.server import (
    Fatal,
    Finished,
    Lost,
    NonFinite,
    ParameterServer,
    Raised,
    RowsCame,
    ServerDone,
    Standing,
    StatesSaved,
    StepsLost,
    WriteFailed,
    all_started,
)
from gem.engines.distributed.server_turn import TurnServer
from gem.engines.distributed.server_wire import WireServer
from gem.engines.distributed.shards import Sharded, Shards, pieces
from gem.engines.distributed.window import Window
from gem.engines.options import DistributedOptions
from gem.engines.turn import Ticket, Turn
from gem.engines.worker import (
    EXIT_WAIT_S,
    START_TIMEOUT_S,
    STOP_GRACE_S,
    interrupts_held,
    threads_per_process,
    worker_context,
)
from gem.files import WriteError

SETTLE_S = 2.0  # rank 0's wait at its end for its threads in gloo's waits (ParameterServer.settle)


def run(job: Job, recorder) -> Result:
    eng = job.engine
    if not isinstance(eng, DistributedOptions):
        raise ValueError(f"engine=distributed cannot run a job for engine={eng.name}")
    n = job.workers
    algo = algorithms.get(job.algorithm)
    # θ on rank 0's host: gloo moves CPU tensors. A GPU worker stages θ on its device at its commits.
    theta = build_flat_model(job, device="cpu").param.clone()
    servers = eng.servers  # θ in shards, each served by its own rank (shards.py); rank 0 serves shard 0
    sharded = Sharded(algo, job.hp, theta, n, servers) if servers > 1 else None
    server, resumed = start_server(job, algo, theta, sharded)
    place = Placement.plan(job)
    window = Window.create(server, place.slots, turn=place.local_turn, theta=not place.handed) if place.slots else None
    if window is None:  # no /dev/shm, or no room in it (Window.create says so)
        place = place.without_window()
    if place.handed:
        server = server.to(place.central)
    if window is not None:
        server = window.adopt(server)
    children: list = []
    listener = None
    coord = None
    turn = alive = here = None
    ended = False
    try:
        coord = _Coordinator(job, recorder, server, Evaluator(job, job.data), resumed)
        coord.placement = place
        saved = {w: ckpt.load_worker(job.resume, w) for w in coord.pending_workers()} if resumed else {}
        start = Start(
            t0_wall=coord.t0_wall,
            train_examples=len(job.data.train_y),
            window=window.described() if window is not None else None,
        )
        # before any worker starts: a field that JSON cannot carry fails here
        encoded = encode_job(job_for_workers(job), start)
        if launched():
            world = int(os.environ["WORLD_SIZE"])
            if world != n + servers:
                raise ValueError(
                    f"workers={n} but the launcher started {world} processes; engine=distributed needs "
                    f"workers + engine.servers={servers} (rank 0 is a parameter server): pass workers={world - servers}"
                )
            secret = launched_secret()  # the config's validation has refused a multi-node launch without one
            torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
            # rank 0 says which ranks have not joined after engine.timeout_s (group.await_ranks)
            store, pg = _connect(lambda: launched_group(START_TIMEOUT_S, eng.timeout_s)[:2], [])
        else:
            host, port = eng.host, eng.port
            # the config's validation has checked the address; again here for a caller of the engine itself
            warn_once(check_host(host, eng.allow_remote))
            before = listening()
            listener = open_listener(host, port)
            port = listener.getsockname()[1]
            store = dist.TCPStore(
                host,
                port,
                n + servers,
                True,
                timeout=timedelta_of(START_TIMEOUT_S),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
            # the store owns the listening socket now and closes it when it goes. Closed here as well, its number
            # could belong to another file by then (a parquet part being read, seen as EBADF in the tests)
            listener.detach()
            listener = None
            local = local_address(host)  # where this machine's ranks reach rank 0 and one another
            # as on the process engine, the workers share the cores and the coordinating rank is not counted: it
            # mostly waits on the wire. The same threads as the other engines: the same arithmetic at n = 1.
            threads = threads_per_process(n)
            torch.set_num_threads(threads)
            # this launch's own secret (the environment's, if set), handed to its workers by their parent: a
            # process that reaches engine.host (allow_remote) cannot join without it
            secret = run_secret() or secrets.token_hex(16)
            # the workers import what the job names, as this process does: it is this user's command
            imports = tuple(sorted(named_imports(job.algorithm, job.model)))
            ctx = worker_context(job)
            # θ and the server's tensors on the workers' GPU travel as CUDA IPC handles (torch.multiprocessing)
            theta_handed = {"theta": server.theta, "state": server.state} if place.handed else None
            if window is not None:
                # every worker is on this host, with θ in the window: they pass the server's turn among themselves,
                # as on engine=process (the server thread is participant n, the coordinator n + 1), and the server
                # thread holds it until every worker is ready. `here` stays open in this process alone: a worker
                # waiting in line sees end of file on `alive` once rank 0 is gone
                turn = Turn(ctx, n + 2, place.central)
                turn.state[0] = n
                alive, here = ctx.Pipe(duplex=False)
            for r in range(1, n + servers):  # the workers, then the other shards' servers (shards.py)
                p = ctx.Process(
                    target=local_worker,
                    name=f"gem-worker-{r - 1}" if r <= n else f"gem-shard-{r - n}",
                    daemon=True,
                    args=(
                        r,
                        n + servers,
                        local,
                        port,
                        START_TIMEOUT_S,
                        threads,
                        secret,
                        imports,
                        turn,
                        alive,
                        theta_handed,
                    ),
                )
                with interrupts_held():  # a child started is a child recorded, and stopped below
                    p.start()
                    children.append(p)
            if alive is not None:
                alive.close()
            pg = _connect(lambda: form_group(store, 0, n + servers, local, START_TIMEOUT_S), children)
            refuse_newcomers(before)  # the store's and gloo's listeners: nobody is left to connect (doors.py)
        states = {r: saved.get(r - 1, DONE if resumed else None) for r in range(1, n + 1)}
        if sharded is not None:  # each other shard's rank: its slice of θ₀, or its state from the checkpoint
            sharded.shards = Shards(pg, job, theta.numel())
            states.update(sharded.shards.initial(theta, sharded.saved, coord.evaluate.model.layout, states))
        result = _serve(coord, pg, secret, encoded, states, children, store, window, turn)
        ended = True
        return result
    finally:
        # at the run's end every worker has had its answer and exits by itself; interrupted (Ctrl-C, SIGTERM) or
        # failed, nobody will answer them, and the server would go on applying commits whose rows are no longer
        # recorded: they are stopped at once (a worker elsewhere is told STOP when it next asks)
        ps = coord.ps if coord is not None else None
        if ps is not None and not ended:
            ps.written.set()  # a checkpoint being taken will not be written
            ps.stop("rank 0 is leaving")
        if sharded is not None and sharded.shards is not None and not sharded.shards.ending:
            sharded.shards.end(1.0)  # (a shard of a launcher's exits anyway once rank 0's connection closes)
        _stop(children, grace_s=STOP_GRACE_S if ended else 0.0)
        if here is not None:
            here.close()
        if window is not None:
            window.unlink()
        if listener is not None:
            listener.close()
        if ps is not None:
            # the threads in gloo's waits end as their workers' connections close, before the interpreter goes
            # (Headers.join): at once for a local launch's workers, stopped above; a worker elsewhere still
            # running is not waited on past this
            ps.settle(SETTLE_S)
        if place.central.type == "cuda":  # the GPU memory the workers received by CUDA IPC and have let go of
            torch.cuda.ipc_collect()


def _serve(
    coord: _Coordinator,
    pg,
    secret: str,
    encoded,
    states: dict,
    children: list,
    store=None,
    window: Window | None = None,
    turn: Turn | None = None,
) -> Result:
    """The run, once the group has formed: each worker proves the run's secret (secret.admit); each that did gets
    its job and its saved state (`states`, by rank); one that did not gets nothing and is recorded lost. Then the
    coordinator serves the run to its end."""
    refused, held = admit(pg, sorted(states), secret, START_TIMEOUT_S)
    # the job's store, when this process holds it, keeps only its own and the admitted workers' connections
    cut = cut_strangers(getattr(store, "port", None), held)
    empty_store(store, getattr(store, "port", None))  # and what anyone stored there goes with its keys (doors.py)
    if cut:
        print(
            f"gem: rank 0 closed {len(cut)} connection(s) to the job's store that no admitted worker holds "
            f"(from {', '.join(cut[:5])}{', ...' if len(cut) > 5 else ''})",
            file=sys.stderr,
            flush=True,
        )
    for r, state in states.items():
        if r not in refused:
            send_job(pg, encoded, r, START_TIMEOUT_S)
            send_packed(pg, state, r, TAG_JOB, START_TIMEOUT_S)
    coord.attach(pg, children, store, refused, window, turn, states)
    return coord.serve()


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


def _stop(children: list, grace_s: float = STOP_GRACE_S) -> None:
    """Local launch: every worker has had its answer and exits; any that does not is terminated, then killed."""
    deadline = time.monotonic() + grace_s
    for p in children:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in children:
        if p.is_alive():
            p.terminate()
    for p in children:
        p.join(EXIT_WAIT_S)
        if p.is_alive():
            p.kill()
            p.join(EXIT_WAIT_S)


class _Coordinator(Coordinator):
    """Rank 0's main thread: the shared bookkeeping, fed by the server thread's events."""

    def __init__(self, job, recorder, server, evaluate, resumed):
        super().__init__(job, recorder, server, evaluate, resumed)
        self.events: queue.Queue = queue.Queue()
        self.children: list = []
        self.ps: ParameterServer | None = None
        self.fatal = ""
        self.write_error = ""  # a file of the run directory could not be written: the run ends, failed
        self.server_done = False
        self.last_watch = 0.0
        self.racing = False  # every worker is ready (or given up): the silence timers run
        self.store = None  # the job's store, on which a worker waiting for the server says so
        self.waited: dict[int, int] = {}  # each rank's count on it when the coordinator last looked
        self.closed_at: float | None = None  # when every worker had finished or was lost
        self.turn: Turn | None = None  # the workers of a local launch pass the turn among themselves
        self.to_monotonic = self.t0_wall - time.time() + time.monotonic()  # a row's time_s, on time.monotonic
        self.placement: Placement | None = None  # where θ lives (`run` decides it)
        self.shards: Shards | None = None  # the other shards' servers, where θ is sharded (shards.py)

    def attach(
        self,
        pg,
        children: list,
        store=None,
        refused: dict[int, str] | None = None,
        window: Window | None = None,
        turn: Turn | None = None,
        states: dict | None = None,
    ) -> None:
        """Start the server thread; `refused`: ranks that did not prove the run's secret, lost from the start;
        `states`: each worker's saved state, by rank, where the run resumes (the server keeps what its rule there
        needs of it)."""
        ranks = [w + 1 for w in range(self.job.workers)]
        job, server = self.job, self.server
        layout = self.evaluate.model.layout  # a rule run at the server makes its per-tensor statistics
        if isinstance(server, Sharded):  # rank 0 serves shard 0's slice; a shard lost ends the run
            server, self.shards = server.local, server.shards
            self.shards.watch(lambda why: self.events.put(Fatal(why)))
            layout = pieces(layout, *self.shards.slices[0])  # (of rank 0's slice)
        like = torch.empty_like(server.theta, device="cpu")  # sizes only: nothing of θ's, on the host
        bounds = Bounds.of(server.algo, job.hp, like, len(self.ledger.tensor_names), len(job.data.train_y))
        args = (pg, job, server, ranks, self.events, bounds, window)
        if turn is None:
            self.ps = WireServer(*args, layout=layout, shards=self.shards)
        else:
            self.ps = TurnServer(*args, turn=turn)
        self.ps.restore(states or {})
        self.children, self.store, self.turn = children, store, turn
        for w in set(range(self.job.workers)) - set(self.pending_workers()):  # done before the checkpoint
            self.ps.done_before(w + 1)
        for r, why in (refused or {}).items():
            self.lose_rank(r, why, banned=True)
        self.ps.start()

    def lose_rank(self, rank: int, why: str, banned: bool = False) -> None:
        """Record `rank` lost, and its commits whose rows will not come; `banned`: for what it sent, so that the
        server reads nothing more from it."""
        if not self.lose(rank - 1, why):
            return
        if self.children:
            p = self.children[rank - 1]
            if p.is_alive():
                p.kill()
            if self.turn is not None:  # gone before its commits are read from the log, and its turn handed on
                p.join(self.turn.kill_wait_s)
                self.turn.recover(rank - 1)
        for s in self.ps.lose(rank, banned):
            self.ledger.lost(s)

    def handle(self, ev) -> None:
        """One event of the server thread (server.py)."""
        match ev:
            case RowsCame(rank, data, steps):
                try:
                    rows = self.ps.bounds.rows(data, rank - 1, steps)
                except Malformed as e:  # those commits' rows will never come; nor will any more of its own
                    for step in steps:
                        self.ledger.lost(step)
                    self.lose_rank(rank, f"it sent {e}", banned=True)
                    return
                for row, tensors in rows:
                    self.ledger.add(row, tensors)
                    if self.turn is not None:  # (else the server times each commit it applies)
                        self.silence.progress(rank - 1, row["time_s"] + self.to_monotonic)
            case Finished(rank):
                if rank - 1 not in self.lost_workers:  # lost meanwhile for the rows that came with its last word
                    self.finish(rank - 1)
            case NonFinite(_, reason):
                self.diverge(reason)
            case Raised(rank, text):
                self.lose_rank(rank, f"raised {text.splitlines()[0]}")
            case Lost(rank, why):
                self.lose_rank(rank, why)
            case StatesSaved(folder, t):  # the server waits until the checkpoint is written
                try:
                    # a diverged run's state is not worth resuming; with several servers, every shard's slice is
                    # fetched at the barrier (the same commits applied on each), and a shard lost fails the run
                    if not self.diverged and not self.write_error and self.gather():
                        self.ledger.record()
                        self.ledger.fill_gaps(t)
                        self.write_checkpoint(folder, t)
                except WriteError as e:
                    self.write_error = str(e)
                except RuntimeError as e:  # a shard's server lost while its state was fetched (Shards names it)
                    if self.shards is None:
                        raise
                    self.handle(Fatal(str(e)))
                finally:
                    self.ps.written.set()
            case StepsLost(steps):
                for step in steps:
                    self.ledger.lost(step)
            case Fatal(why):
                self.fatal = self.fatal or why
                if self.shards is not None and self.shards.lost:  # the workers are told STOP as they ask
                    self.ps.stop(why)
            case WriteFailed(reason):
                self.write_error = reason
            case ServerDone():
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
        ps.sync_log()
        with ps.lock:
            commits, ps.commits = ps.commits, []
        if not self.racing:
            self.start_race(now)
        for w, at in commits:
            self.silence.progress(w, at)
        line, frozen = set(), None
        if self.turn is not None:  # (rank 0's threads are participants too, not among these)
            line, frozen = self.turn.peek({r - 1: p.pid for r, p in enumerate(self.children, 1)})
        saving = ps.saving
        if saving is not None and frozen is None:  # asked for its state, in line but not answering (frozen there):
            line -= {r - 1 for r in saving["told"] - saving["saved"]}  # to blame, unless it waits on a frozen one
        arrived = ps.headers.arrived_at if ps.headers is not None else {}
        for r in ps.ranks:
            # a header taken, or one that came and waits for the server thread: the worker waits for the server
            self.silence.seen(r - 1, max(ps.peers[r].heard, arrived.get(r, 0.0)))
            if self.waited_since_last_look(r) or r - 1 in line:
                self.silence.seen(r - 1, now)
        ps.wait_s = patience(self.silence.limit())
        for r in ps.ranks:
            if ps.peers[r].expected and self.children and self.children[r - 1].exitcode is not None:
                self.lose_rank(r, f"process died, exit code {self.children[r - 1].exitcode}")
        for w, silent_for in self.silence.silent(now):
            if not ps.peers[w + 1].expected:  # finished (its event is on the way) or lost
                self.silence.forget(w)
            else:
                self.lose_rank(w + 1, self.silence.why(silent_for))
        if not ps.open() and not self.server_done:
            # every worker finished or lost: the server ends by itself (`lose` wakes it if it waits for a header),
            # unless it is inside an exchange with a worker lost as silent, which lasts until that worker's
            # connection closes or the wait's own timeout. Wait for it: it holds the group and its store, which must
            # not outlive the run (the store's listening socket is closed at the end, and its number may be reused
            # by the next run's)
            ps.join(1.0)
            self.closed_at = self.closed_at or now
            self.server_done = not ps.is_alive() or now - self.closed_at > ps.wait_s + BYE_TIMEOUT_S

    def waited_since_last_look(self, rank: int) -> bool:
        if self.store is None or not self.ps.peers[rank].expected:
            return False
        try:
            count = int(self.store.add(waiting_key(rank), 0))
        except Exception:  # noqa: BLE001 - no store, no excuse: the rule still holds
            return False
        waited, self.waited[rank] = count != self.waited.get(rank, 0), count
        return waited

    def start_race(self, now: float) -> None:
        """The silence timers start once every worker is ready, as the server's turns do: a worker not ready
        START_TIMEOUT_S after the start is lost, and the others start without it."""
        ps = self.ps
        if not all_started(ps.peers):
            if now - ps.started <= START_TIMEOUT_S:
                return
            for r, peer in ps.peers.items():
                if peer.standing is Standing.JOINING:
                    self.lose_rank(r, f"not ready within {START_TIMEOUT_S:.0f} s of its start")
        self.racing = True
        self.silence.start([r - 1 for r in sorted(ps.expected_ranks())], now)

    def sync(self) -> None:
        pass  # the server knows which commits a lost worker made: they are marked when it is lost

    def gather(self) -> bool:
        """θ whole from every shard's server (one server: it is here); False, with the run failed, if one is lost."""
        try:
            self.server.gather()
        except RuntimeError as e:
            self.handle(Fatal(str(e)))  # (Shards names the shard)
            return False
        return True

    def snapshot(self):
        if self.turn is None:
            with self.ps.lock:
                t, theta = self.server.t, self.server.theta.clone()
            if self.shards is not None:  # the other slices as they are now, some commits in flight perhaps
                if not self.gather():
                    return None
                theta[self.shards.slices[0][1] :] = self.server.theta[self.shards.slices[0][1] :]
            return t, theta
        # in line like a worker, looking after the workers meanwhile (a frozen holder is lost, and its turn handed
        # on); given up once the server thread has ended: the run ends, with no evaluation here
        ticket = Ticket(self.turn, self.ps.me + 1)
        if self.wait_on(ticket.step, self.silence.limit() + self.ps.wait_s, lambda: self.server_done) is None:
            ticket.cancel()
            return None
        try:
            return self.server.t, self.server.theta.clone()
        finally:
            self.wait_on(self.turn.try_release)

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
        if self.fatal:  # the server thread has failed: a local turn's workers commit nothing more unrecorded
            self.ps.stop(self.fatal)
        self.ps.join(BYE_TIMEOUT_S)
        self.poll(0)  # what came with the last messages
        self.ps.sync_log()
        with self.ps.lock:
            final = self.server.t
        if self.shards is not None:  # θ whole for the final evaluation, then each shard ends
            if not self.fatal:
                self.gather()
            self.shards.end()
        self.ledger.fill_gaps(final)
        ps, wall = self.ps, time.monotonic() - self.ps.started
        # how loaded the parameter server was: its exchanges take server_commit_s each; busy close to 1 means
        # the server, not the workers, set the pace
        # (none with a local turn: the workers apply their own commits)
        served = ps.served and self.turn is None
        extra = {
            "server_commit_s": round(ps.busy_s / ps.served, 6) if served else None,
            "server_busy": round(ps.busy_s / wall, 4) if served and wall > 0 else None,
            "shared_memory_workers": sorted(r - 1 for r, peer in ps.peers.items() if peer.maps_window),
            "local_turn": self.turn is not None,
            "central_device": str(self.server.theta.device),
            "placement": self.placement.describe() if self.placement is not None else None,
            "servers": self.job.engine.servers,
        }
        if self.shards is not None:  # each other shard's commits and mean τ on its own clock (rank 0's: the rows')
            extra["shards"] = self.shards.ended
        if self.write_error:  # every process has stopped and the rows are recorded: the runner says it, once
            raise WriteError(self.write_error)
        if self.fatal and not self.diverged:
            return Result(
                "failed",
                self.steps,
                reason="; ".join([self.fatal, *self.lost]),
                extra={"lost_workers": sorted(self.lost_workers), **extra},
            )
        return self.conclude(extra)
