"""Sharded servers (`engine.servers=S`; docs/design.md, "Sharded servers"): θ's flat vector cut into S contiguous
slices, each served by its own rank with its own clock, so that the servers' links add up.

Rank 0 is the coordinator and serves shard 0 (its WireServer, over a slice of θ); ranks n + 1 .. n + S - 1 serve the
others (`ShardServer`, here), and ranks 1..n are the workers. A worker asks rank 0 for its turn as with one server;
with GO it sends slice 0 of its commit to rank 0 and slice k to shard k's rank (PUSH), all at once, and takes each
shard's θ slice back: full duplex on every link. A shard applies the commits it gets one at a time, in the order
they arrive, on its own clock (τ per shard). Only rules that read neither θ nor the server's tensors and wait at no
barrier are sharded (`refusal`): what they send a shard is its slice of Δ, of a size the shard knows, and nothing
else; and those whose part that reads θ runs at the server (`sliceable`: EASGD, GEM), which send each shard its
slice of what the part takes (EASGD's x, GEM's gradient), and get back their slice of θ (or of the commit: EASGD's E)
and the statistics of their commit made on that slice, which the worker adds up (`combine`). Each shard keeps its
slice of each worker's tensors the part keeps (GEM's m and s).

What rank 0 asks of a shard (`Shards`): its θ slice (an evaluation), its whole state (a checkpoint, taken at the
checkpoint barrier, where every shard has applied the same commits), a worker's kept tensors (the checkpoint's
worker file), and the end. A shard that is lost ends the run: rank 0 keeps a receive posted from each
(`Shards.watch`), which a shard answers only at its end.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from gem import algorithms
from gem.algorithms import Commit
from gem.engines import Job
from gem.engines.distributed.bounds import sent_buffers, sent_spec
from gem.engines.distributed.headers import Headers
from gem.engines.distributed.job import full_duplex
from gem.engines.distributed.messages import (
    END,
    FETCH_KEPT,
    FETCH_STATE,
    FETCH_THETA,
    PUSH,
    TAG_ALIVE,
    TAG_ASK,
    TAG_SHARD,
    TAG_X,
    pack,
    recv_tensors,
    wait,
)
from gem.engines.distributed.server_wire import Outbox, post_back, returned, statistics
from gem.engines.server import Server

END_WAIT_S = 30.0  # a shard's wait at its end for the workers' connections to close
ALIVE_WAIT_S = 30 * 24 * 3600.0  # rank 0's receive from a shard that answers only at its end (as a header's)


def slices(numel: int, servers: int) -> list[tuple[int, int]]:
    """θ's flat vector in `servers` contiguous ranges of ⌈numel / servers⌉ elements (the last one shorter)."""
    size = -(-numel // servers)
    return [(min(k * size, numel), min((k + 1) * size, numel)) for k in range(servers)]


def shard_ranks(workers: int, servers: int) -> list[int]:
    """The rank serving each shard: rank 0 for shard 0, then the ranks after the n workers."""
    return [0] + [workers + k for k in range(1, servers)]


def refusal(algorithm: str, hp, engine) -> str | None:
    """Why a job of `algorithm` with `hp` cannot run on `engine`'s servers, in one line naming the key; None if it
    can (or there is one server). Checked with the config, before anything starts (experiments.config)."""
    servers = engine.servers
    if servers == 1:
        return None
    algo = algorithms.get(algorithm)
    if algo.barriers:
        return (
            f"engine.servers={servers} is not allowed with algorithm={algorithm}, whose workers wait at a barrier "
            "of the server's clock (several servers have several clocks); use engine.servers=1"
        )
    if algo.reads_central(hp) and not sliceable(algo, hp):
        return (
            f"engine.servers={servers} is not allowed with algorithm={algorithm}, whose worker rule reads the live θ "
            "or the server's tensors, of which each server would hold its own (docs/design.md, 'Sharded servers'); "
            "use engine.servers=1"
        )
    if not engine.full_duplex:
        return f"engine.servers={servers} needs engine.full_duplex=true (several servers serve in full duplex only)"
    return None


def sliceable(algo, hp) -> bool:
    """Whether the part of `algo`'s worker rule that reads θ runs at each shard on its slice (`Algorithm.at_server`):
    one that takes θ-shaped tensors, which a worker slices as θ is, keeps θ-shaped tensors of the worker's, of which
    each shard keeps its slice, and whose statistics say how they add up over slices (`Algorithm.over_slices`):
    EASGD's elastic term, on x; GEM's whole rule, on the gradient, with m and s kept."""
    part = algo.at_server
    if part is None or (algo.diagnostics is not None and algo.over_slices is None):
        return False
    theta = torch.zeros(3)
    state = algo.init_state(theta, hp)
    if any(state[k].shape != theta.shape for k in part.keeps):
        return False
    return all(shape == [3] for _, shape in sent_spec(algo, theta, hp).values())


def pieces(layout, lo: int, hi: int) -> list[tuple[str, slice]]:
    """The model's tensors (`layout`: name and slice of θ's flat vector, in order) as they fall in θ[lo:hi]: each
    piece's name and its slice within θ[lo:hi]. A tensor cut by a shard's boundary has a piece on each side."""
    out = []
    for name, sl in layout:
        a, b = max(sl.start, lo), min(sl.stop, hi)
        if a < b:
            out.append((name, slice(a - lo, b - lo)))
    return out


def combine(over: dict[str, str] | None, parts: list, layout, cuts: list[tuple[int, int]]):
    """A commit's row statistics from those each shard made on its slice (`parts`, in shard order: [metrics,
    per-piece lists or None]), added up as the algorithm says (`Algorithm.over_slices`): (metrics, per-tensor lists
    in layout order, or None)."""
    sizes = [hi - lo for lo, hi in cuts]
    metrics = {key: _add(over, key, [p[0][key] for p in parts], sizes) for key in parts[0][0]}
    if parts[0][1] is None:
        return metrics, None
    where: list[list[tuple[int, int, int]]] = [[] for _ in layout]  # each tensor's pieces: (shard, index, size)
    for k, (lo, hi) in enumerate(cuts):
        j = 0
        for i, (_, sl) in enumerate(layout):
            a, b = max(sl.start, lo), min(sl.stop, hi)
            if a < b:
                where[i].append((k, j, b - a))
                j += 1
    tensors = {
        key: [_add(over, key, [parts[k][1][key][j] for k, j, _ in w], [size for *_, size in w]) for w in where]
        for key in parts[0][1]
    }
    return metrics, tensors


def _add(over: dict[str, str] | None, key: str, values: list[float], sizes: list[int]) -> float:
    how = (over or {}).get(key)
    if how == "sum":
        return math.fsum(values)
    if how == "mean":
        return math.fsum(v * n for v, n in zip(values, sizes, strict=True)) / sum(sizes)
    if how == "median":  # exact where one slice holds every element; two slices' medians do not make one
        return float(values[0]) if len(values) == 1 else math.nan
    raise ValueError(f"the statistic {key!r} does not say how it adds up over θ's slices (Algorithm.over_slices)")


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else repr(e)


# --------------------------------------------------------------------------------------------- a shard's rank


class ShardServer:
    """Ranks n + 1 .. n + S - 1: one slice of θ, served to every worker, one commit at a time in the order their
    PUSHes arrive; rank 0's requests (FETCH_THETA, FETCH_STATE, END) on the same line. A worker that sends anything
    but a PUSH, or whose connection closes, is dropped: the shard serves the others."""

    def __init__(self, pg, rank: int, job: Job, saved: dict):
        self.pg, self.rank, self.job = pg, rank, job
        n, servers = job.workers, job.engine.servers
        self.shard = shard_ranks(n, servers).index(rank)
        algo = algorithms.get(job.algorithm)
        theta = saved["theta"].contiguous().clone()
        lo, hi = slices(int(saved["numel"]), servers)[self.shard]
        if theta.numel() != hi - lo:
            raise ValueError(f"shard {self.shard}: rank 0 sent {theta.numel()} elements of θ, not {hi - lo}")
        # the algorithm's server tensors made for this slice, and a clock of its own
        self.server = Server.create(algo, job.hp, theta, n)
        if "clock" in saved:  # a resumed run: the shard's state as the checkpoint holds it
            self.server.load_state_dict(saved)
        self.delta = torch.empty_like(theta)
        # a part of the worker rule that reads θ, run here on this slice (EASGD's E = α(x − θ)): what a worker sends
        # for it, sliced; what goes back is its commit's delta where the commit does not pull, else θ
        duplex = full_duplex(job)
        self.at_server = duplex.at_server if duplex is not None else None
        self.sent = sent_buffers(algo, theta, job.hp)  # ({} for a rule that runs whole at the worker)
        self.outbox = Outbox(theta)  # θ slices on their way back to workers
        self.workers = list(range(1, n + 1))
        # this slice of each worker's tensors the part keeps here (GEM's m and s), made as the worker would make them
        # from θ₀, or as the checkpoint's worker files hold them (rank 0 sends them sliced); the model's tensors as
        # they fall in this slice, for the part's statistics
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        if self.at_server is not None and self.at_server.keeps:
            made, kept = algo.init_state(theta, job.hp), saved.get("kept") or {}
            for r in self.workers:
                self.kept[r] = {k: made[k].clone() for k in self.at_server.keeps}
                for k, v in (kept.get(str(r)) or {}).items():
                    self.kept[r][k].copy_(v)
        self.layout = [(str(i), slice(a, b)) for i, (a, b) in enumerate(saved["pieces"].tolist())]
        self.commits = self.staleness = 0  # commits applied here, and their τ summed (rank 0 hears at the end)
        self.busy_s = 0.0  # seconds from a PUSH header to its θ slice on its way back (the shard's server_busy)
        self.started = time.monotonic()

    def serve(self) -> None:
        headers = Headers(self.pg, [0, *self.workers])
        try:
            while True:
                src, header = headers.get(None)
                if isinstance(header, Exception):
                    if src == 0:  # rank 0 is gone: so is the run
                        return
                    continue  # a worker gone: the others go on
                kind = int(header[0])
                if src == 0:
                    if kind == END:  # its last word: its commits, their τ summed, its busy and whole µs
                        self.outbox.flush(self.wait_s)
                        spans = [round(1e6 * self.busy_s), round(1e6 * (time.monotonic() - self.started))]
                        word = torch.tensor([END, self.commits, self.staleness, *spans], dtype=torch.long)
                        wait(self.pg.send([word], 0, TAG_ALIVE), 60)
                        return
                    self.answer(kind, int(header[1]))
                    headers.next(0)
                elif kind == PUSH:
                    if self.apply(src):
                        headers.next(src)
                    else:
                        headers.drop(src)
                else:  # nothing else is a worker's to send here: read nothing more from it
                    headers.drop(src)
        finally:
            # each header thread ends once its worker's connection closes (the workers exit after their BYE); a
            # process that ends with one still in gloo's receive aborts (headers.Headers.join says why)
            headers.close()
            headers.join(time.monotonic() + END_WAIT_S)

    def apply(self, src: int) -> bool:
        """`src`'s slice of its commit, applied on this shard's clock; its θ slice back from a copy, not waited for."""
        began = time.monotonic()
        part = self.at_server
        try:
            for t in self.sent.values() if part is not None else [self.delta]:
                wait(self.pg.recv([t], src, TAG_X), self.wait_s)
        except RuntimeError:
            return False
        server = self.server
        view = server.view(src - 1)
        if part is not None:
            commit = part.rule(self.kept.get(src, {}), self.sent, view, self.job.hp)
        else:
            commit = Commit(delta=self.delta)
        server.apply(view, commit)
        self.commits, self.staleness = self.commits + 1, self.staleness + view.staleness
        # a send back that failed is that worker's loss alone: rank 0 records it; after θ's slice, the statistics of
        # the commit made here, on this slice
        text = (lambda: statistics(server.algo, commit, self.layout, self.job.hp)) if part is not None else None
        try:
            post_back(
                self.pg, self.outbox, src, returned(part, commit, server.theta), text, self.wait_s, lambda rank, e: None
            )
        except RuntimeError:
            return False
        self.busy_s += time.monotonic() - began
        return True

    @property
    def wait_s(self) -> float:
        return 2 * self.job.engine.timeout_s + 10

    def answer(self, kind: int, arg: int) -> None:
        if kind == FETCH_KEPT:  # worker rank `arg`'s tensors kept here, for its checkpoint's file
            works = [self.pg.send([t], 0, TAG_SHARD) for t in self.kept.get(arg, {}).values()]
            for w in works:
                wait(w, self.wait_s)
        elif kind == FETCH_THETA:
            wait(self.pg.send([self.server.theta], 0, TAG_SHARD), self.wait_s)
        elif kind == FETCH_STATE:
            _, tensors = pack(self.server.state_dict())
            works = [self.pg.send([t], 0, TAG_SHARD) for t in tensors]
            for w in works:
                wait(w, self.wait_s)


# ------------------------------------------------------------------------------------------- rank 0's side


class Sharded(Server):
    """Rank 0's central record with several servers: θ whole, whose slice 0 is shard 0's θ itself (`local`, served
    by rank 0's WireServer), the others' slices as last fetched (`gather`); shard 0's clock and pull times, the
    run's clock t; no server tensors of its own: each shard keeps those of its slice. A checkpoint holds θ whole
    and each shard's state under `shards`."""

    def __init__(self, algo, hp, theta: torch.Tensor, workers: int, servers: int):
        if any(lo == hi for lo, hi in slices(theta.numel(), servers)):  # (a toy model: a slice for every server)
            fits = [s for s in range(1, servers) if all(lo < hi for lo, hi in slices(theta.numel(), s))]
            raise ValueError(
                f"engine.servers={servers} is not allowed for a model of {theta.numel()} parameters, which leaves a "
                f"server without a slice of θ; engine.servers={fits[-1]} gives each one"
            )
        lo, hi = slices(theta.numel(), servers)[0]
        self.local = Server.create(algo, hp, theta[lo:hi], workers)  # a view: rank 0's commits land in θ
        super().__init__(algo, hp, theta, {}, self.local.clock, self.local.pulled_at)
        self.servers = servers
        self.shards: Shards | None = None  # rank 0's hand on the other shards, once the group has formed
        self.saved: list[dict] | None = None  # a resumed run: each shard's state, from the checkpoint

    def gather(self) -> None:
        if self.shards is not None:
            self.shards.fetch_theta(self.theta)

    def view(self, worker: int):
        return self.local.view(worker)

    def apply(self, view, commit: Commit) -> int:
        return self.local.apply(view, commit)

    def pull(self, worker: int):
        return self.local.pull(worker)

    def state_dict(self) -> dict:
        """Taken at the checkpoint barrier, where every shard has applied the same commits: one consistent cut."""
        others = self.shards.fetch_states() if self.shards is not None else []
        self.gather()
        local = {**self.local.state_dict(), "theta": self.local.theta.clone()}  # (not a view of θ whole)
        return {**super().state_dict(), "shards": [local, *others]}

    def load_state_dict(self, saved: dict) -> None:
        shards = saved.get("shards") or []
        if len(shards) != self.servers:
            raise ValueError(f"checkpoint: {len(shards)} shards there, engine.servers={self.servers} here")
        self.theta.copy_(saved["theta"])
        self.local.load_state_dict(shards[0])
        self.saved = shards


class Shards:
    """Rank 0's hand on shards 1..S - 1: their θ slices, their states, their end, and a watch on each."""

    def __init__(self, pg, job: Job, numel: int):
        n, servers = job.workers, job.engine.servers
        self.pg, self.job = pg, job
        self.slices = slices(numel, servers)
        self.ranks = shard_ranks(n, servers)[1:]
        self.lock = threading.Lock()  # one request at a time per shard: the coordinator's, or wrap-up's
        self.ending = False
        self.lost = ""
        self.ended: list[dict] = []  # each shard's last word: its commits, mean τ and how busy it was
        algo = algorithms.get(job.algorithm)
        # what each shard's state is made of, from rank 0's own arithmetic: nothing a shard announces is trusted
        self.specs = []
        for lo, hi in self.slices[1:]:
            spec, _ = pack(Server.create(algo, job.hp, torch.zeros(hi - lo), n).state_dict())
            self.specs.append(spec)

    def initial(self, theta: torch.Tensor, saved: list[dict] | None, layout, workers: dict) -> dict[int, dict]:
        """What each shard's rank gets after its job: its slice of θ₀, or its state from the checkpoint; the model's
        tensors as they fall in its slice; and where the part of the rule run there keeps tensors of each worker's,
        their slices from the workers' saved states (`workers`, by rank: a resumed run's)."""
        keeps = self.keeps
        out = {}
        for k, r in enumerate(self.ranks, 1):
            lo, hi = self.slices[k]
            state = dict(saved[k]) if saved else {"theta": theta[lo:hi].clone()}
            cut = [[sl.start, sl.stop] for _, sl in pieces(layout, lo, hi)]
            state = {**state, "numel": theta.numel(), "pieces": torch.tensor(cut, dtype=torch.long)}
            kept = {
                str(w): {name: s["state"][name][lo:hi].clone() for name in keeps}
                for w, s in workers.items()
                if keeps and isinstance(s, dict) and isinstance(s.get("state"), dict)
            }
            out[r] = {**state, "kept": kept} if kept else state
        return out

    @property
    def keeps(self) -> tuple[str, ...]:
        """The names of the worker's tensors each shard keeps its slice of (the part of the rule run there)."""
        duplex = full_duplex(self.job)
        part = duplex.at_server if duplex is not None else None
        return part.keeps if part is not None else ()

    def _ask(self, kind: int, arg: int = 0) -> None:
        for k, r in enumerate(self.ranks, 1):
            self._from(
                k,
                lambda r=r: wait(
                    self.pg.send([torch.tensor([kind, arg, 0, 0], dtype=torch.long)], r, TAG_ASK), self.wait_s
                ),
            )

    @property
    def wait_s(self) -> float:
        return 2 * self.job.engine.timeout_s + 10

    def fetch_theta(self, theta: torch.Tensor) -> None:
        """Each shard's slice of θ as it is now, into `theta` (slice 0 is rank 0's own)."""
        with self.lock:
            self._ask(FETCH_THETA)
            for k, (r, (lo, hi)) in enumerate(zip(self.ranks, self.slices[1:], strict=True), 1):
                self._from(k, lambda r=r, lo=lo, hi=hi: wait(self.pg.recv([theta[lo:hi]], r, TAG_SHARD), self.wait_s))

    def fetch_kept(self, rank: int, like: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each shard's slice of worker `rank`'s tensors kept there, named and ordered as `like` (rank 0's own)."""
        with self.lock:
            self._ask(FETCH_KEPT, rank)
            out = []
            for k, (r, (lo, hi)) in enumerate(zip(self.ranks, self.slices[1:], strict=True), 1):
                got = {name: torch.empty(hi - lo, dtype=t.dtype) for name, t in like.items()}
                for t in got.values():
                    self._from(k, lambda r=r, t=t: wait(self.pg.recv([t], r, TAG_SHARD), self.wait_s))
                out.append(got)
            return out

    def fetch_states(self) -> list[dict]:
        """Each shard's whole state (θ slice, server tensors, clock, pull times), of the shapes rank 0 expects."""
        with self.lock:
            self._ask(FETCH_STATE)
            pairs = enumerate(zip(self.ranks, self.specs, strict=True), 1)
            return [
                self._from(k, lambda r=r, s=s: recv_tensors(self.pg, s, r, TAG_SHARD, self.wait_s))
                for k, (r, s) in pairs
            ]

    def _from(self, k: int, receive):
        """`receive()` from shard k; failing, the shard is lost (RuntimeError naming it, as `lost`)."""
        try:
            return receive()
        except RuntimeError as e:
            raise RuntimeError(self.losing(k, e)) from e

    def losing(self, k: int, e: Exception) -> str:
        self.lost = self.lost or f"server of shard {k} (rank {self.ranks[k - 1]}) lost: {_first_line(e)}"
        return self.lost

    def watch(self, on_lost) -> None:
        """A receive posted from each shard, which it answers only at its end: failing first, the shard is lost."""

        def one(r: int, k: int) -> None:
            word = torch.zeros(5, dtype=torch.long)
            try:
                wait(self.pg.recv([word], r, TAG_ALIVE), ALIVE_WAIT_S)
            except RuntimeError as e:
                if not self.ending:
                    on_lost(self.losing(k, e))
                return
            commits, staleness, busy, whole = (int(v) for v in word[1:])
            self.ended.append(
                {
                    "shard": k,
                    "rank": r,
                    "commits": commits,
                    "mean_staleness": staleness / commits if commits else None,
                    # as rank 0's server_commit_s and server_busy: whether this shard's server set the pace
                    "server_commit_s": round(busy / 1e6 / commits, 6) if commits else None,
                    "server_busy": round(busy / whole, 4) if whole else None,
                }
            )

        self.watchers = [
            threading.Thread(target=one, args=(r, k), name=f"gem-shard-{k}", daemon=True)
            for k, r in enumerate(self.ranks, 1)
        ]
        for t in self.watchers:
            t.start()

    def end(self, deadline_s: float = 10.0) -> None:
        """The run is over: each shard is told END, answers on its watch and exits."""
        self.ending = True
        with self.lock:
            for r in self.ranks:
                try:
                    wait(self.pg.send([torch.tensor([END, 0, 0, 0], dtype=torch.long)], r, TAG_ASK), deadline_s)
                except RuntimeError:
                    pass
        until = time.monotonic() + deadline_s
        for t in getattr(self, "watchers", []):
            t.join(max(0.0, until - time.monotonic()))
