"""What is particular to the `distributed` engine, on loopback: rank 0 the parameter server, worker ranks, gloo
over TCP; first come, first served at the server, payloads on the wire, torchrun. The contract every engine keeps
(every commit once, staleness, windows, resume, lost workers, signals, ...) is in tests/test_engines.py."""

import contextlib
import dataclasses
import datetime
import math
import os
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from helpers import warm_run
from helpers.engines import Killed
from helpers.paths import ROOT
from helpers.procs import frozen_inside_meta, is_cut, stranger
from helpers.rundir import check_run_dir

from gem import algorithms
from gem.algorithms import async_localsgd, downpour, gem, ssgd
from gem.data import make_synthetic
from gem.engines import Job, checkpoint, distributed
from gem.engines.coordinator import start_server
from gem.engines.core import Evaluator, build_flat_model
from gem.engines.distributed import address, launch, placement, window
from gem.engines.distributed import job as wire_job
from gem.engines.distributed.address import open_listener
from gem.engines.distributed.group import patience, waiting_key
from gem.engines.distributed.job import Start, decode_start, job_for_workers
from gem.engines.distributed.launch import _Coordinator
from gem.engines.distributed.link import _Waiting
from gem.engines.distributed.server import Peer, Standing
from gem.engines.distributed.server_wire import WireServer
from gem.engines.server import Server
from gem.metrics import Recorder, read_table


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


def job(data, workers, algorithm="gem", hp=None, epochs=1, batch_size=32, **kw):
    return Job(
        algorithm=algorithm,
        hp=hp or gem.Params(workers=workers),
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=batch_size,
        epochs=epochs,
        seed=0,
        engine={"name": "distributed", "timeout_s": 60},
        eval_every=kw.pop("eval_every", 16),
        eval_train_size=64,
        **kw,
    )


def run(job_, d):
    rec = Recorder(d)
    try:
        result = distributed.run(job_, rec)
    finally:
        rec.close()
    return result, read_table(d), rec


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_run_closes_each_of_its_descriptors_once(data, tmp_path, monkeypatch):
    """The job store owns rank 0's listening socket: TCPStore closes the descriptor it is given when it goes. The
    engine closed it as well, so its number went back to the system while the store still held it: a file opened
    next got that number, and the store closed that file under its reader when it was collected (`Bad file
    descriptor` while a test merged parquet parts, 2 suites in 3)."""
    import gc

    stores = []  # the run's store, kept past the run's end as a reference cycle may keep it

    def kept(*args, **kw):
        stores.append(real(*args, **kw))
        return stores[-1]

    def sockets() -> set[str]:
        fds = Path("/proc/self/fd")
        return {link for fd in fds.iterdir() if (link := _readlink(fd)).startswith("socket:")}

    numbers = []  # the listening socket's descriptor

    def listener(*args):
        numbers.append((s := real_listener(*args)).fileno())
        return s

    real, real_listener = dist.TCPStore, launch.open_listener
    monkeypatch.setattr(dist, "TCPStore", kept)
    monkeypatch.setattr(launch, "open_listener", listener)
    before = sockets()
    result, _, _ = run(job(data, 1, epochs=1), tmp_path / "run")
    assert result.status == "completed" and len(stores) == 1
    (number,) = numbers
    assert _readlink(Path(f"/proc/self/fd/{number}")).startswith("socket:")  # still the store's, as long as it is
    with open(tmp_path / "next-file", "w") as f:  # the lowest free number: the socket's, if the engine closed it
        stores.clear()
        gc.collect()  # the store goes, and closes its socket
        os.fstat(f.fileno())  # EBADF where that was this file
    assert sockets() <= before  # and the store closed it


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (/proc: its sockets' inodes in the LISTEN rows of its namespace)."""
    inodes = {link[8:-1] for fd in Path(f"/proc/{pid}/fd").iterdir() if (link := _readlink(fd)).startswith("socket:")}
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _completed_connections(ports: set[int], tries: int = 50) -> int:
    """Of `tries` connections opened at once to each port, how many the far side completes within half a second."""
    done = 0
    for port in ports:
        with selectors.DefaultSelector() as sel:
            socks = [socket.socket() for _ in range(tries)]
            for s in socks:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                sel.register(s, selectors.EVENT_WRITE)
            deadline, connected = time.monotonic() + 0.5, set()
            while time.monotonic() < deadline:
                for key, _ in sel.select(deadline - time.monotonic()):
                    sel.unregister(key.fileobj)
                    if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        connected.add(key.fileobj)
            done += len(connected)
            for s in socks:
                s.close()
    return done


def _sockets() -> int:
    """How many sockets this process holds."""
    return sum(_readlink(fd).startswith("socket:") for fd in Path("/proc/self/fd").iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="doors.py works on Linux only (/proc, socket filters)")
@pytest.mark.slow  # 2-3.5 s a case in the fast tier (2026-11-29)
def test_once_the_group_has_formed_nobody_new_reaches_a_rank(data, tmp_path, monkeypatch):
    """torch's two holes (doors.py): a connection to a gloo listener that closes before gloo's handshake costs the
    rank a descriptor for good, and the job's store keeps what anyone connected stores. Once every worker has
    proved the secret: no listener of rank 0 (the store's, gloo's) or of a worker completes a new connection, and
    none costs a descriptor; a store connection made before the group formed, by no worker, has been cut."""
    before, seen, strangers = _listening_ports(os.getpid()), {}, []

    def listener(*args):  # a stranger (another process) connects to the store as it listens, before any worker
        s = real_listener(*args)
        p, seen["stranger"] = stranger(s.getsockname()[1])
        strangers.append(p)
        return s

    def admit(pg, ranks, *args):
        out = real_admit(pg, ranks, *args)  # every worker has refused newcomers before it sent its proof
        ports = {0: _listening_ports(os.getpid()) - before}
        ports.update({r: _listening_ports(p.pid) for r, p in enumerate(seen["children"], 1)})
        sockets = _sockets()
        seen["completed"] = _completed_connections(set().union(*ports.values()))
        time.sleep(0.2)  # a connection that got through would be taken by gloo or the store by now
        seen["ports"], seen["sockets"] = ports, (sockets, _sockets())
        return out

    def cut(port, keep):
        seen["cut"] = real_cut(port, keep)
        seen["stranger cut"] = is_cut(strangers[0])  # it read end of file: the store closed its side
        return seen["cut"]

    def serve(coord, pg, secret, encoded, states, children, *args):
        seen["children"] = children
        return real_serve(coord, pg, secret, encoded, states, children, *args)

    real_listener, real_admit, real_serve = launch.open_listener, launch.admit, launch._serve
    real_cut = launch.cut_strangers
    monkeypatch.setattr(launch, "open_listener", listener)
    monkeypatch.setattr(launch, "admit", admit)
    monkeypatch.setattr(launch, "cut_strangers", cut)
    monkeypatch.setattr(launch, "_serve", serve)
    try:
        result, m, _ = run(job(data, 2), tmp_path / "run")
    finally:
        strangers[0].kill()
        strangers[0].wait()
    assert result.status == "completed" and len(m) == 16, result
    assert [len(seen["ports"][r]) for r in (0, 1, 2)] == [2, 1, 1], seen["ports"]  # store, gloo; gloo; gloo
    assert seen["completed"] == 0
    assert seen["sockets"][1] == seen["sockets"][0]
    assert seen["cut"] == [seen["stranger"]]
    assert seen["stranger cut"]


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile (the listing's own descriptor)
        return ""


@pytest.mark.slow  # a run of 4 distributed workers: 6 s
def test_commits_are_served_first_come_first_served(data, tmp_path):
    """Every worker has the same budget, so the final shares are 1/n whatever the order: fairness shows while
    they all run. At b = 4 a worker's step is shorter than the server's exchange, so the workers queue at the
    server and are of equal speed as far as it can tell, where an unfair order would show most. Served in rank
    order (the original code's polling), low ranks would take most of the commits and τ would split into 0 for
    them and large for the others; first come, first served gives each of the 4 workers 1/n ± 20% of each half of
    the run, and τ = n - 1 for most commits (round robin). The bound, measured: a fair server on a loaded machine
    (this suite on 2 cores; a 16-core machine running GPU jobs beside it) gave shares from 0.22 to 0.29 (±16%);
    the unfair server below starves its last rank to 0.14 (-44%). Rank 0 serves every commit here (θ over the
    wire): with θ in shared memory a local launch's workers pass the turn among themselves, and its own bound is
    checked below (test_several_workers_share_the_window_...)."""
    n = 4
    j = dataclasses.replace(
        job(data, n, algorithm="downpour", hp=downpour.Params(), batch_size=4),
        engine={"name": "distributed", "timeout_s": 60, "shared_memory": False},
    )
    result, m, _ = run(j, tmp_path)
    assert result.status == "completed" and len(m) == n * 256 // 4
    assert not result.extra["local_turn"]
    for half in (m[m["step"] <= len(m) // 2], m[m["step"] > len(m) // 2]):
        shares = half["worker"].value_counts(normalize=True)
        assert sorted(shares.index) == list(range(n))
        assert ((shares - 1 / n).abs() <= 0.2 / n).all(), shares.to_dict()
    assert m.loc[m["worker_step"] > 1, "staleness"].median() == n - 1


@pytest.mark.parametrize("algorithm", ["downpour", "dcasgd", "ssgd", "gem"])
@pytest.mark.slow  # 2-3.5 s a case in the fast tier (2026-11-29)
def test_three_workers_in_full_duplex_commit_once_each_with_staleness_on_the_servers_clock(data, tmp_path, algorithm):
    """Over the wire, rules that read no θ run in full duplex, and so does GEM's, at rank 0: θ goes back to one
    worker while the next one's commit arrives. The commits are still applied one at a time: each step once, every
    worker step once, τ the commits by others since the worker's pull (its previous commit; ssgd: its barrier,
    served once its round has ended, perhaps after others' next commits), and the final evaluation at the last
    step."""
    n = 3
    fields = {f.name for f in dataclasses.fields(algorithms.get(algorithm).Params)}
    hp = algorithms.get(algorithm).Params(**({"workers": n} if "workers" in fields else {}))
    j = dataclasses.replace(
        job(data, n, algorithm, hp, epochs=2),
        engine={"name": "distributed", "timeout_s": 60, "shared_memory": False},
    )
    result, m, _ = run(j, tmp_path)
    steps = 2 * 256 // 32
    assert result.status == "completed" and not result.extra["local_turn"], result
    assert "over the wire, in full duplex" in result.extra["placement"], result.extra["placement"]
    assert m["step"].tolist() == list(range(1, n * steps + 1))
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(1, steps + 1))] * n
    for _, g in m.groupby("worker"):
        t, staleness = g["step"].tolist(), g["staleness"].tolist()
        if algorithm == "ssgd":  # it pulls at its barrier once the round has ended: τ counts from that pull's clock
            ends = [0] + [(a - 1) // n * n + n for a in t[:-1]]
            assert all(0 <= s <= b - 1 - e for s, e, b in zip(staleness, ends, t, strict=True)), (staleness, t)
        else:  # it pulls θ just after its own commit
            assert staleness == [b - 1 - a for a, b in zip([0, *t[:-1]], t, strict=True)]
    assert read_table(tmp_path, "eval")["step"].iloc[-1] == n * steps


@pytest.mark.parametrize("algorithm", ["ringmaster", "rennala", "dylu"])
@pytest.mark.slow  # 2-3.5 s a case in the fast tier (2026-11-29)
def test_a_rule_that_reads_the_servers_counters_gets_them_with_go_in_full_duplex(data, tmp_path, algorithm):
    """Ringmaster's and Rennala's worker rules read no θ, only the server's counters (their delay, in each row), and
    DyLU's the workers' paces (its next window): over the wire GO carries those, as they are when the commit is
    applied, and θ comes back after it (full duplex). Replaying the server's tensors over the rows in the order of the
    clock gives every row's delay, and every window."""
    n = 3
    name, hp = (
        ("async_localsgd", async_localsgd.Params(dynamic_window=True, window=4))
        if algorithm == "dylu"
        else (algorithm, algorithms.get(algorithm).Params(workers=n))
    )
    j = dataclasses.replace(
        job(data, n, name, hp, epochs=2), engine={"name": "distributed", "timeout_s": 60, "shared_memory": False}
    )
    result, m, _ = run(j, tmp_path)
    assert result.status == "completed", result
    assert "over the wire, in full duplex" in result.extra["placement"], result.extra["placement"]
    assert m["step"].tolist() == list(range(1, len(m) + 1))
    if algorithm == "dylu":  # the server's paces as each commit's GO carried them: the window each commit set
        paces, windows = [0.0] * n, dict.fromkeys(range(n), 4)
        for w, window, pace in m[["worker", "window", "pace"]].itertuples(index=False):
            assert window == windows[w], (w, window, windows, paces)
            now = [pace if v == w and pace > 0 else p for v, p in enumerate(paces)]
            windows[w] = 4 if now[w] <= 0 else max(1, math.floor(4 * now[w] / max(now)))
            paces[w] = pace if pace > 0 else paces[w]
        assert m["window"].nunique() > 1 or m["pace"].nunique() > n  # (paces were measured and compared)
        return
    assert len(m) == n * 2 * 256 // 32
    pulled, k, count = dict.fromkeys(range(n), 0), 0, 0  # the server's counters, replayed: its k, each pull's k
    for w, delay, dropped in m[["worker", "delay", "dropped"]].itertuples(index=False):
        assert delay == k - pulled[w], (w, delay, k, pulled)
        if algorithm == "ringmaster":  # applied unless its delay reaches R = n
            assert dropped == int(delay >= n)
            k += delay < n
        else:  # a gradient of the current point joins the batch; S = n of them make a step
            assert dropped == int(delay > 0)
            count += delay == 0
            k, count = (k + 1, 0) if count == n else (k, count)
        pulled[w] = k
    assert m["delay"].max() > 0  # (the counters moved between a worker's commits: the replay checked something)


def test_full_duplex_turned_off_serves_each_exchange_whole_with_the_same_rows(data, tmp_path):
    """engine.full_duplex=false serves DOWNPOUR's commits as GEM's are, θ out with GO and the commit back (the
    benchmark's half-duplex row): the placement says so, and at n = 1 every row and evaluation is that of full
    duplex, bit for bit."""
    frames = {}
    for duplex in (True, False):
        j = dataclasses.replace(
            job(data, 1, "downpour", downpour.Params(), epochs=2),
            engine={"name": "distributed", "timeout_s": 60, "shared_memory": False, "full_duplex": duplex},
        )
        result, m, _ = run(j, tmp_path / str(duplex))
        assert result.status == "completed"
        assert ("in full duplex" in result.extra["placement"]) == duplex, result.extra["placement"]
        assert ("one exchange at a time" in result.extra["placement"]) != duplex, result.extra["placement"]
        evals = read_table(tmp_path / str(duplex), "eval").drop(columns="time_s")
        frames[duplex] = (m.drop(columns=["time_s", "wait_s", "apply_s", "wait_commits"], errors="ignore"), evals)
    for a, b in zip(frames[True], frames[False], strict=True):
        pd.testing.assert_frame_equal(a, b, check_exact=True)


@pytest.mark.parametrize(
    "algorithm, extra", [("gem", {"proxy": "local"}), ("gem", {"proxy": "global"}), ("easgd", {"window": 2})]
)
def test_a_rule_run_at_rank_0_gives_the_half_duplex_exchanges_rows(data, tmp_path, algorithm, extra):
    """Over the wire, a rule that reads the live θ runs its part that does at rank 0, in full duplex: GEM's worker
    sends its gradient, rank 0 runs the whole worker rule on the worker's m and s kept there and the live θ, applies
    the commit and sends θ back, with the row's π statistics and energies, computed there; EASGD's sends x, and
    rank 0 sends back E = α(x − θ), which it has applied. At n = 1 every row, every per-tensor statistic and every
    evaluation is that of the half-duplex exchange (engine.full_duplex=false), where the worker runs its rule on θ
    sent with GO, bit for bit."""
    hp = algorithms.get(algorithm).Params(workers=1, **extra)
    frames = {}
    for duplex in (True, False):
        j = dataclasses.replace(
            job(data, 1, algorithm, hp, epochs=2),
            engine={"name": "distributed", "timeout_s": 60, "shared_memory": False, "full_duplex": duplex},
        )
        d = tmp_path / str(duplex)
        result, m, _ = run(j, d)
        assert result.status == "completed", result
        placement = result.extra["placement"]
        assert ("in full duplex" in placement and "reads θ runs at rank 0" in placement) == duplex, placement
        assert ("one exchange at a time" in placement) != duplex, placement
        frames[duplex] = (
            m.drop(columns=["time_s", "wait_s", "apply_s"]),
            read_table(d, "tensors"),
            read_table(d, "eval").drop(columns="time_s"),
        )
    rows, tensors, _ = frames[True]
    assert len(rows) == 16 // algorithms.get(algorithm).commit_every(hp)
    if algorithm == "gem":  # its statistics, computed at rank 0, are in every row
        assert rows["pi_median"].notna().all() and rows["central_energy"].notna().all()
        assert len(tensors) == len(rows) * len(build_flat_model(j, device="cpu").tensor_names)
    for a, b in zip(frames[True], frames[False], strict=True):
        pd.testing.assert_frame_equal(a, b, check_exact=True)


@pytest.mark.parametrize("proxy", ["local", "global"])
@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_resumed_run_of_gems_rule_at_rank_0_is_the_uninterrupted_run(data, tmp_path, monkeypatch, proxy):
    """GEM's m and s live at rank 0 over the wire: a checkpoint takes them from there into the worker's file, and
    a resumed run puts them back there. Killed the moment its first checkpoint is on disk and resumed, a run at n = 1
    gives every row, per-tensor statistic and evaluation of the run never killed, bit for bit (with m and s made
    afresh at the resume, π and every commit after it would differ)."""
    steps = 8 * 256 // 32

    def make(d, resume=None):
        # an early checkpoint, and no evaluation but the first and the last (when one is taken follows the clock)
        return dataclasses.replace(
            job(data, 1, hp=gem.Params(workers=1, proxy=proxy), epochs=8, eval_every=steps),
            engine={"name": "distributed", "timeout_s": 60, "shared_memory": False},
            run_dir=str(d),
            checkpoint_every=4,
            resume=resume,
        )

    whole = tmp_path / "whole"
    result, _, _ = run(make(whole), whole)
    assert result.status == "completed", result
    real_finish = checkpoint.finish

    def finish_then_die(*args, **kw):
        real_finish(*args, **kw)
        raise Killed()

    killed = tmp_path / "killed"
    monkeypatch.setattr(checkpoint, "finish", finish_then_die)
    with pytest.raises(Killed):
        distributed.run(make(killed), Recorder(killed, flush_every=5))
    monkeypatch.setattr(checkpoint, "finish", real_finish)
    manifest = checkpoint.read_manifest(killed)
    saved = checkpoint.load_worker(manifest, 0)["state"]
    assert sorted(saved) == ["m", "stale"] and saved["m"].abs().sum() > 0, saved  # rank 0's, after some commits
    rec = Recorder(killed, resume_step=manifest["step"])
    try:
        result = distributed.run(make(killed, manifest), rec)
    finally:
        rec.close()
    assert result.status == "completed" and result.steps == steps, result
    for table, timing in (("metrics", ["time_s", "wait_s", "apply_s"]), ("tensors", []), ("eval", ["time_s"])):
        a, b = (read_table(d, table).drop(columns=timing) for d in (killed, whole))
        pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_the_global_proxy_travels_with_the_commit(data, tmp_path):
    """algorithm.proxy=global sends the worker's momentum as a payload; the server keeps their mean."""
    hp = gem.Params(workers=3, proxy="global")
    result, m, _ = run(job(data, 3, hp=hp, epochs=1), tmp_path)
    assert result.status == "completed" and m["pi_median"].notna().all()


@pytest.mark.parametrize("algorithm, extra", [("gem", {"proxy": "global"}), ("easgd", {"window": 2})])
def test_three_workers_whose_rules_run_at_rank_0_commit_once_each(data, tmp_path, algorithm, extra):
    """Three workers over the wire, their rules' parts that read θ run at rank 0 (GEM's global proxy: each worker's m
    and the mean of their commits kept there): every commit once, every worker's windows in order, and GEM's π
    statistics in every row."""
    n, hp = 3, algorithms.get(algorithm).Params(workers=3, **extra)
    j = dataclasses.replace(
        job(data, n, algorithm, hp, epochs=1), engine={"name": "distributed", "timeout_s": 60, "shared_memory": False}
    )
    result, m, _ = run(j, tmp_path)
    assert result.status == "completed" and "reads θ runs at rank 0" in result.extra["placement"], result
    window = algorithms.get(algorithm).commit_every(hp)
    commits = 256 // 32 // window
    assert m["step"].tolist() == list(range(1, n * commits + 1))
    expected = [window * (k + 1) for k in range(commits)]
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [expected] * n
    if algorithm == "gem":
        assert m["pi_median"].notna().all() and m["proxy_energy"].notna().all()


# full duplex over the wire: DOWNPOUR and the others' worker rules read no θ; GEM's runs at rank 0
@pytest.mark.parametrize("algorithm", ["downpour", "dcasgd", "async_localsgd", "delay_adaptive", "gem"])
def test_workers_on_rank_0s_host_read_theta_from_shared_memory_with_the_same_rows(data, tmp_path, algorithm):
    """engine.shared_memory (on by default): the workers of a local launch take the server's turn among themselves
    and commit to θ in rank 0's window, as on engine=process; only their rows travel. The server step, τ and the
    rows are the wire's: at n = 1 every row and evaluation is the same, bit for bit, as with shared_memory=false,
    where θ comes back after each commit (full duplex; GEM's rule, which reads the live θ, then runs at rank 0).
    The window's file is gone once the run ends."""
    fields = {f.name for f in dataclasses.fields(algorithms.get(algorithm).Params)}
    hp = algorithms.get(algorithm).Params(**{k: v for k, v in {"workers": 1, "window": 2}.items() if k in fields})
    frames = {}
    for shared in (True, False):
        j = dataclasses.replace(
            job(data, 1, algorithm, hp, epochs=2),
            engine={"name": "distributed", "timeout_s": 60, "shared_memory": shared},
        )
        result, m, _ = run(j, tmp_path / str(shared))
        assert result.status == "completed"
        assert result.extra["shared_memory_workers"] == ([0] if shared else [])
        assert result.extra["local_turn"] == shared
        if not shared:
            placement = result.extra["placement"]
            assert "in full duplex" in placement, placement
            assert ("reads θ runs at rank 0" in placement) == (algorithm == "gem"), placement
        frames[shared] = (
            m.drop(columns=["time_s", "wait_s", "apply_s", "wait_commits"], errors="ignore"),
            read_table(tmp_path / str(shared), "eval").drop(columns="time_s"),
        )
    for a, b in zip(frames[True], frames[False], strict=True):
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert not list(window.SHM.glob(f"{window.PREFIX}{os.getpid()}-*"))


def test_several_workers_share_the_window_and_every_commit_is_applied_once(data, tmp_path):
    """A local launch's workers pass the server's turn among themselves in the window, first in, first out, as on
    engine=process: while a worker waits, each other worker commits at most once (`wait_commits`)."""
    result, m, _ = run(job(data, 3, epochs=2), tmp_path)
    assert result.status == "completed" and result.extra["shared_memory_workers"] == [0, 1, 2]
    assert result.extra["local_turn"] and m["wait_commits"].max() <= 3 - 1, m["wait_commits"].value_counts()
    assert m["step"].tolist() == list(range(1, 3 * 2 * 256 // 32 + 1))
    assert m.groupby("worker")["worker_step"].apply(list).tolist() == [list(range(1, 17))] * 3


@pytest.mark.parametrize("algorithm", ["downpour", "ssgd"])
def test_a_local_launch_that_hands_theta_to_its_workers_gives_the_window_s_rows(data, tmp_path, monkeypatch, algorithm):
    """Where a local launch's workers all compute on one GPU, rank 0 moves θ and the server's tensors there, hands
    them to its workers (CUDA IPC) and keeps only the clock, the pull times and the log in the window. Run here
    with CPU tensors handed instead (shared memory: the same path, without a GPU), the move made a copy as a move
    to a GPU is, so that rank 0 must hand over and keep the moved tensors: DOWNPOUR at n = 1 gives every row and
    evaluation of θ in the window, bit for bit, and with 3 workers applies every commit once; SSGD with 3 workers,
    whose barriers pull θ over the wire, copied from where it lives, gives the window's evaluations (the order of
    a round's commits may differ: equal to float rounding)."""
    made = []  # whether each window rank 0 made holds θ
    real_create, real_to = window.Window.create, Server.to

    def create(cls, *args, **kw):
        made.append(kw.get("theta", True))
        return real_create(*args, **kw)

    def moved(self, device):
        s = real_to(self, device)
        return Server(
            s.algo,
            s.hp,
            s.theta.clone().share_memory_(),
            {k: v.clone().share_memory_() for k, v in s.state.items()},
            s.clock,
            s.pulled_at,
        )

    monkeypatch.setattr(window.Window, "create", classmethod(create))
    monkeypatch.setattr(Server, "to", moved)
    n = 1 if algorithm == "downpour" else 3
    hp = downpour.Params() if algorithm == "downpour" else ssgd.Params(workers=n)
    frames = {}
    for handed in (False, True):
        made.clear()
        monkeypatch.setattr(placement, "_hands_theta", lambda central, handed=handed: handed)
        result, m, _ = run(job(data, n, algorithm, hp, epochs=2), tmp_path / str(handed))
        assert result.status == "completed" and result.extra["local_turn"], result.reason
        assert made == [not handed]
        frames[handed] = (
            m.drop(columns=["time_s", "wait_s", "apply_s", "wait_commits"], errors="ignore"),
            read_table(tmp_path / str(handed), "eval").drop(columns="time_s"),
        )
    if algorithm == "ssgd":
        assert frames[True][0]["step"].tolist() == list(range(1, 3 * 2 * 256 // 32 + 1))
        # θ moves at the end of each round of 3 commits: evaluations after the same round see the same θ
        evals = {
            h: e.assign(round=e["step"] // 3)
            .drop(columns=["step", "worker_step"], errors="ignore")
            .drop_duplicates("round")
            .set_index("round")
            for h, (_, e) in frames.items()
        }
        common = evals[False].index.intersection(evals[True].index)
        assert len(common) >= 2 and common.max() == 3 * 2 * 256 // 32 // 3, (evals[False], evals[True])
        pd.testing.assert_frame_equal(evals[False].loc[common], evals[True].loc[common], rtol=1e-4)
        return
    for a, b in zip(frames[False], frames[True], strict=True):
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    result, m, _ = run(job(data, 3, algorithm, hp, epochs=2), tmp_path / "3")
    assert result.status == "completed" and made == [False, False], result.reason
    assert m["step"].tolist() == list(range(1, 3 * 2 * 256 // 32 + 1))
    assert not list(window.SHM.glob(f"{window.PREFIX}{os.getpid()}-*"))


def test_a_window_without_theta_is_opened_only_by_a_local_launch_s_worker(data):
    """θ handed to the workers (on their GPU): the window holds the clock, the pull times and the log, no θ; a
    worker of a local launch maps it and keeps the θ it was handed; a worker that would read θ from it cannot."""
    j = job(data, 2)
    srv, _ = start_server(j, algorithms.get("gem"), build_flat_model(j, device="cpu").param.clone())
    with_theta, without = window.Window.create(srv, 2, turn=True), window.Window.create(srv, 2, turn=True, theta=False)
    if with_theta is None or without is None:
        pytest.skip(f"no shared memory in {window.SHM} here")
    try:
        assert without.theta is None and without.described()["theta"] is False
        assert Path(without.path).stat().st_size < Path(with_theta.path).stat().st_size - srv.theta.nbytes
        mine = window.Window.open(without.described(), 1, srv, writable=True)
        assert mine is not None and mine.theta is None
        adopted = mine.adopt(srv)
        assert adopted.theta is srv.theta and adopted.clock.data_ptr() == mine.clock.data_ptr()
        without.clock.fill_(7)
        assert adopted.t == 7  # the window's clock, which rank 0 moves
        assert window.Window.open(without.described(), 1, srv) is None  # only a local launch's worker maps it
        for theta in (True, "no", None):  # what the window holds must be said plainly
            assert window.Window.open({**without.described(), "theta": theta}, 1, srv, writable=True) is None
    finally:
        with_theta.unlink()
        without.unlink()


def test_a_worker_opens_only_a_window_of_rank_0s_making(data, tmp_path):
    """The job names the window; a worker opens it only in /dev/shm, by this module's name pattern, owned by its
    user, of the size its own replica needs, holding the nonce the job names. Anything else: None (the wire)."""
    j = job(data, 2)
    srv, _ = start_server(j, algorithms.get("gem"), build_flat_model(j, device="cpu").param.clone())
    win = window.Window.create(srv, 2)
    if win is None:
        pytest.skip(f"no shared memory in {window.SHM} here")
    try:
        said = win.described()
        assert window.Window.open(said, 1, srv) is not None
        other = tmp_path / Path(said["path"]).name
        other.write_bytes(Path(said["path"]).read_bytes())
        replica = Server.create(algorithms.get("gem"), j.hp, torch.zeros(10), 2)  # another model's
        for changed, w, rep in [
            ({}, 2, srv),  # no slot for worker 2
            ({"path": str(other)}, 0, srv),  # not in /dev/shm
            ({"path": str(window.SHM / "gem-theta-1-x")}, 0, srv),  # not the name pattern
            ({"path": str(window.SHM / "passwd")}, 0, srv),
            ({"nonce": "00" * 32}, 0, srv),  # another window
            ({"nonce": "not hex"}, 0, srv),
            ({}, 0, replica),  # of another size
            ({"slots": "2"}, 0, srv),
            ({"slots": 3}, 0, srv),
        ]:  # more slots than the job has workers
            assert window.Window.open({**said, **changed}, w, rep) is None, changed
        win.unlink()
        assert window.Window.open(said, 0, srv) is None  # removed: no process can open it any more
    finally:
        win.unlink()


def test_a_window_left_by_a_dead_rank_0_is_removed_and_nothing_else():
    """A rank 0 killed before it removed its window leaves the file: the next run removes it (its pid is dead).
    Another user's window, a directory of the same name, and a live rank 0's window are left as they are."""
    if not window.SHM.is_dir():
        pytest.skip(f"no {window.SHM} here")
    dead = window.SHM / f"{window.PREFIX}4194304-{'a' * 16}"  # above Linux's largest pid: no such process
    alive = window.SHM / f"{window.PREFIX}{os.getpid()}-{'b' * 16}"
    folder = window.SHM / f"{window.PREFIX}4194304-{'c' * 16}"
    foreign = window.SHM / f"{window.PREFIX}4194304-{'d' * 16}"
    try:
        dead.write_bytes(b"x")
        alive.write_bytes(b"x")
        folder.mkdir()
        foreign.write_bytes(b"x")
        if os.getuid() == 0:
            os.chown(foreign, 12345, 12345)
        window._remove_stale()
        assert not dead.exists() and alive.exists() and folder.is_dir()
        assert foreign.exists() == (os.getuid() == 0)  # (not root: it is this user's, and removed)
    finally:
        for p in (dead, alive, foreign):
            p.unlink(missing_ok=True)
        if folder.is_dir():
            folder.rmdir()


def test_no_room_in_dev_shm_is_one_line_and_the_wire(data, tmp_path, monkeypatch, capsys):
    """A write past a full /dev/shm would kill the writer (SIGBUS): the window reserves its space when it is made,
    and where it cannot, says so in one line and leaves no file; the run's workers then use the wire."""
    import errno

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(window.os, "posix_fallocate", full)
    result, m, _ = run(job(data, 2), tmp_path)
    assert result.status == "completed" and result.extra["shared_memory_workers"] == []
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "/dev/shm" in line] == [
        "gem: no room for θ in /dev/shm (2 MiB: No space left on device); the workers on this host use the wire"
    ]
    assert not list(window.SHM.glob(f"{window.PREFIX}{os.getpid()}-*"))


def _torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not on PATH")
    return exe


@pytest.mark.slow
def test_torchrun_launches_the_server_and_workers(tmp_path):
    # docs/distributed.md's one-machine torchrun command. --standalone: a free rendezvous port (torchrun's default
    # 29500 was taken by the other torchrun test, run at the same time, on the GPU machine)
    d = tmp_path / "run"
    p = subprocess.run(
        [
            _torchrun(),
            "--standalone",
            "--nproc_per_node=4",
            "run.py",
            "engine=distributed",
            "workers=3",
            "epochs=2",
            "logger.wandb.mode=disabled",
            f"hydra.run.dir={d}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    summary, m, _ = check_run_dir(d, steps=3 * 2 * (1500 // 64))
    assert summary["status"] == "completed" and summary["engine"] == "distributed"
    assert summary["commit_shares"] == {"0": 0.3333, "1": 0.3333, "2": 0.3333}
    assert sorted(m["worker"].unique()) == [0, 1, 2]
    assert not list(ROOT.glob("outputs/*/*/rank*"))  # worker ranks write no run directory of their own


@pytest.mark.slow
def test_torchrun_with_the_wrong_number_of_processes_says_so_in_one_line(tmp_path):
    # two processes, the fewest that make a torchrun job of a server and a worker: each imports torch
    p = subprocess.run(
        [
            _torchrun(),
            "--standalone",
            "--nproc_per_node=2",
            "run.py",
            "engine=distributed",
            "workers=2",
            "logger.wandb.mode=disabled",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: workers=2 does not match the 2 processes the launcher started: engine=distributed "
        "needs workers + 1 (rank 0 is the parameter server); pass workers=1 or start 3 processes "
        "(--nproc_per_node)"
    ], p.stderr[-2000:]


class _HighRankWaits(WireServer):
    """An unfair server, like the original code's polling in rank order: the highest rank is served only once
    3 commits of lower ranks have gone before it."""

    held = None

    def next_header(self):
        others_running = len(self.expected_ranks()) > 1
        if self.held is not None and (self.skipped >= 3 or not others_running):
            src, header, self.held = self.held, self.held_header, None
            return src, header
        src, header = super().next_header()
        if header is not None and src == max(self.ranks) and int(header[0]) == distributed.ASK and others_running:
            self.held, self.held_header, self.skipped = src, header, 0
            return src, None  # nothing to act on now (and its thread receives nothing more from it meanwhile)
        if header is not None and self.held is not None and int(header[0]) == distributed.ASK:
            self.skipped += 1
        return src, header


@pytest.mark.slow  # a run of 4 distributed workers: 6 s
def test_the_fairness_test_catches_an_unfair_server(data, tmp_path, monkeypatch):
    """The test above is not vacuous: a server that lets the highest rank wait fails it."""
    monkeypatch.setattr(launch, "WireServer", _HighRankWaits)
    with pytest.raises(AssertionError, match=r"0\.2 / 4"):
        test_commits_are_served_first_come_first_served(data, tmp_path)


# ------------------------------------------------------------------------------------------ the wire is safe

# what would unpickle a peer's bytes: these modules, and torch.distributed's object collectives (pickles inside)
UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
OBJECT_CALLS = {
    "send_object_list",
    "recv_object_list",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
}


@pytest.mark.parametrize("module", ["distributed", "worker", "server", "coordinator", "core"])
def test_nothing_on_the_distributed_wire_is_unpickled(module):
    """engine=distributed's modules import no pickler and call no object collective: every message is int64
    headers, JSON or raw tensors (a static check: the workers are spawned processes, out of a patch's reach)."""
    import ast

    path = ROOT / "gem" / "engines" / module
    files = sorted(path.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]  # a package: every module
    assert files
    for node in (n for f in files for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & UNPICKLERS, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in UNPICKLERS, ast.unparse(node)
            assert not {a.name for a in node.names} & OBJECT_CALLS, ast.unparse(node)
        elif isinstance(node, ast.Attribute):
            assert node.attr not in OBJECT_CALLS and ast.unparse(node) != "torch.load", ast.unparse(node)


def _every_field_equal(a: Job, b: Job) -> None:
    import dataclasses

    import torch

    for f in dataclasses.fields(Job):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "data" and x is not None:
            assert type(y) is type(x)
            for g in dataclasses.fields(x):
                u, v = getattr(x, g.name), getattr(y, g.name)
                if isinstance(u, torch.Tensor):
                    assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v), g.name
                else:
                    assert type(u) is type(v) and u == v, g.name
        else:
            assert type(y) is type(x) and y == x, (f.name, x, y)


def test_the_job_travels_as_json_and_raw_tensors(data, tmp_path):
    """What rank 0 sends a worker rebuilds the same Job, field by field, from JSON and raw tensors."""
    import json

    source = {
        "name": "synthetic",
        "root": "/data",
        "download": False,
        "shape": (1, 28, 28),
        "augment": True,
        "synthetic": {"num_classes": 10, "train_size": 256, "val_size": 64, "seed": 1},
    }
    full = job(
        data,
        3,
        hp=gem.Params(workers=3, kappa=2.5, proxy="global"),
        device="cpu",
        run_dir=str(tmp_path),
        checkpoint_every=7,
        resume={"step": 12, "dir": "step-12", "path": str(tmp_path)},
        data_source=source,
    )
    full = dataclasses.replace(
        full,
        engine={
            "name": "distributed",
            "host": "127.0.0.1",
            "port": 0,
            "allow_remote": False,
            "timeout_s": 7.5,
            "shared_memory": False,
        },
    )
    start = Start(t0_wall=1.5e9, train_examples=256, window={"path": "/dev/shm/x", "slots": 2})
    for original in (full, job_for_workers(full), job_for_workers(job(data, 2))):
        text, tensors = distributed.encode_job(original, start)
        assert isinstance(json.loads(text), dict)
        assert tensors is None or set(tensors) - {"test_x", "test_y"} == {"train_x", "train_y", "val_x", "val_y"}
        assert original is full or tensors is None or "test_x" not in tensors  # a worker's job has no test split
        _every_field_equal(distributed.decode_job(text, tensors), original)
        assert decode_start(text) == start  # the run's facts travel beside the job, not in its options
    assert decode_start(distributed.encode_job(full)[0]) is None


@pytest.mark.parametrize("algorithm", ["sgd", "downpour", "adaptive", "agn", "easgd", "eamsgd", "gem"])
def test_every_algorithms_hyperparameters_come_back_the_same(data, algorithm):
    from gem import algorithms

    hp = algorithms.get(algorithm).Params()
    original = job(data, 2, algorithm=algorithm, hp=hp)
    back = distributed.decode_job(*distributed.encode_job(original))
    assert type(back.hp) is type(hp) and back.hp == hp


def test_hyperparameters_that_json_would_change_are_refused(data, monkeypatch):
    import dataclasses

    from gem import algorithms

    @dataclasses.dataclass
    class Params:
        lr: float = 0.1
        sizes: tuple = (1, 2)  # JSON has no tuples: it would come back a list

    record = dataclasses.replace(algorithms.get("sgd"), Params=Params)
    monkeypatch.setattr(wire_job.algorithms, "get", lambda name: record)
    with pytest.raises(TypeError, match=r"sends algorithm=sgd's Params as JSON"):
        distributed.encode_job(job(data, 2, algorithm="sgd", hp=Params()))


# ------------------------------------------------------------------------------------- a local launch's address

LOOPBACK = ["127.0.0.1", "127.4.5.6", "::1", "localhost", "LocalHost", "::ffff:127.0.0.1"]
REMOTE = ["0.0.0.0", "::", "", "192.168.1.20", "10.0.0.1", "node17.cluster"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_needs_no_opt_in(host):
    assert distributed.check_host(host, allow_remote=False) is None


@pytest.mark.parametrize("host", REMOTE)
def test_any_other_host_needs_allow_remote(host):
    with pytest.raises(ValueError, match=r"engine\.host=.* is not a loopback address.*engine\.allow_remote=true"):
        distributed.check_host(host, allow_remote=False)
    warning = distributed.check_host(host, allow_remote=True)
    assert warning.startswith("gem: warning: ") and "only workers that prove the run's secret can join" in warning


def test_a_remote_host_is_refused_in_one_line_before_anything_starts():
    from experiments.config import ConfigError, check_job

    with pytest.raises(ConfigError) as e:
        check_job(["engine=distributed", "engine.host=0.0.0.0"])
    assert str(e.value) == (
        "engine.host=0.0.0.0 is not a loopback address, and anyone who can reach it could "
        "connect to the run and read its traffic; use engine.host=127.0.0.1 (or localhost, ::1), "
        "or set engine.allow_remote=true to expose the run on it"
    )


ALLOW_REMOTE_WARNING = (
    "gem: warning: engine.allow_remote=true: the run listens on every address of this machine "
    "(0.0.0.0); anyone who can reach it can connect, and read or disturb its traffic (gloo's is "
    "neither authenticated nor encrypted), though only workers that prove the run's secret can "
    "join"
)


def test_allow_remote_prints_one_warning(monkeypatch, capsys):
    """The config is validated by the preflight and again by the run: the warning is printed once."""
    from experiments.config import check_job

    monkeypatch.setattr(address, "_warned", set())
    for _ in range(2):
        check_job(["engine=distributed", "engine.host=0.0.0.0", "engine.allow_remote=true"])
    err = capsys.readouterr().err.splitlines()
    assert err == [ALLOW_REMOTE_WARNING]


def test_a_host_that_is_not_this_machines_is_refused():
    with pytest.raises(ValueError, match=r"^engine\.host=192\.0\.2\.1 cannot be listened on \(.*\); give an address"):
        distributed.check_port("192.0.2.1", 0)  # TEST-NET-1: documentation only, never a local address


def test_gloo_listens_on_the_interfaces_gloo_socket_ifname_names(monkeypatch):
    """Across nodes each rank's gloo device is the interface GLOO_SOCKET_IFNAME names (torch's own default device
    ignores the variable: in tests/test_multihost.py's namespaces, whose host name resolves to 127.0.0.1, every
    rank then offered the others its loopback address, and the group timed out)."""
    from gem.engines.distributed import group

    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device", lambda **kw: kw)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1,ib0")
    assert group._devices(None) == [{"interface": "eth1"}, {"interface": "ib0"}]
    assert group._devices("127.0.0.1") == [{"hostname": "127.0.0.1"}]  # one node, or a local launch: loopback


def test_a_host_name_that_resolves_to_loopback_is_refused_across_nodes(monkeypatch):
    """Without GLOO_SOCKET_IFNAME a rank offers the address its host name resolves to; loopback (127.0.1.1 in
    many /etc/hosts) would reach no other node: one line that names the variable, instead of a timeout."""
    import socket

    from gem.engines.distributed import group

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: [(2, 1, 6, "", ("127.0.1.1", 0))])
    with pytest.raises(
        ValueError, match="resolves to no address other nodes can reach .127.0.1.1.; set GLOO_SOCKET_IFNAME"
    ):
        group._devices(None)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: [(2, 1, 6, "", ("10.1.2.3", 0))])
    monkeypatch.setattr(dist.ProcessGroupGloo, "create_default_device", lambda: "default")
    assert group._devices(None) == ["default"]


@pytest.fixture
def held_port():
    """A port another program holds (bound, as a run's rank 0 or any server would)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def _in_use(port):
    return (
        f"engine.port={port} is in use on 127.0.0.1 (another run or program holds it); pick another port, or "
        "engine.port=0 for a free one"
    )


def test_a_port_in_use_is_refused_in_one_line(held_port):
    from experiments.config import ConfigError, check_job

    with pytest.raises(ConfigError) as e:
        check_job(["engine=distributed", f"engine.port={held_port}"])
    assert str(e.value) == _in_use(held_port)


def test_a_port_taken_after_the_check_fails_the_run_in_that_line(data, held_port, tmp_path):
    """The port was free at the preflight and is taken when rank 0 listens: the same line, not an OSError."""
    j = job(data, 2)
    j = dataclasses.replace(j, engine=dataclasses.replace(j.engine, port=held_port))
    with pytest.raises(ValueError) as e:
        run(j, tmp_path)
    assert str(e.value) == _in_use(held_port)


def test_the_port_of_a_run_just_ended_is_not_refused(data, tmp_path):
    """Connections that rank 0 closed wait out TIME_WAIT on its port; rank 0 listens with SO_REUSEADDR and can
    bind it again at once (the next run of a sweep with an explicit engine.port), so the check must not refuse."""
    import socket

    listener = open_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # rank 0 closes first: its side of the connection goes to TIME_WAIT
    listener.close()
    client.close()
    distributed.check_port("127.0.0.1", port)


@pytest.mark.slow
def test_run_py_refuses_a_port_in_use_before_a_run_directory_exists(held_port, tmp_path):
    d = tmp_path / "x"
    p = warm_run.run_py(
        "engine=distributed",
        f"engine.port={held_port}",
        "logger.wandb.mode=disabled",
        f"hydra.run.dir={d}",
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.splitlines() == [f"error: {_in_use(held_port)}"]
    assert not d.exists()


@pytest.mark.slow
def test_run_py_with_allow_remote_warns_once_and_runs(tmp_path):
    d = tmp_path / "x"
    p = warm_run.run_py(
        "engine=distributed",
        "engine.host=0.0.0.0",
        "engine.allow_remote=true",
        "workers=1",
        "data=synthetic",
        "data.synthetic.train_size=64",
        "data.synthetic.val_size=32",
        "batch_size=32",
        "logger.wandb.mode=disabled",
        f"hydra.run.dir={d}",
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    warnings = [line for line in p.stderr.splitlines() if line.startswith("gem: warning:")]
    assert warnings == [ALLOW_REMOTE_WARNING], p.stderr
    assert (d / "summary.json").exists()


# ------------------------------------------------------------------------ a silent worker is a lost worker


class _ServerThreadSeen:
    """What the coordinator's watch reads of the parameter server thread: the commits it applied, the headers it
    took; and what it does to it: lose a rank."""

    def __init__(self, ranks, now):
        self.lock = threading.Lock()
        self.ranks, self.lost = ranks, []
        self.peers = {r: Peer(heard=now - 10.0, standing=Standing.WORKING, ready=True) for r in ranks}
        self.commits, self.started, self.wait_s = [], now - 10.0, None
        self.saving = None  # a checkpoint being taken: {"told": ranks asked for their state, "saved": ...}
        self.headers = None  # not started: no header has come

    def open(self):
        return bool(self.expected_ranks())

    def expected_ranks(self):
        return {r for r, p in self.peers.items() if p.expected}

    def sync_log(self):
        pass  # rank 0's server applies every commit: none to read from a log

    def lose(self, rank, banned=False):
        self.lost.append(rank)
        self.peers[rank].standing = Standing.BANNED if banned else Standing.LOST
        return []


def test_the_coordinator_loses_a_silent_worker_by_the_shared_rule(data, tmp_path):
    """Rank 0 applies the `process` engine's rule (gem.engines.coordinator.Silence, engine.timeout_s and
    engine.silent_cycles), timing the commits its server applies; a worker that says on the store that it waits
    for the server (held up by another worker, say) is not to blame."""
    j = dataclasses.replace(job(data, 3), engine={"name": "distributed", "timeout_s": 2, "silent_cycles": 4})
    algo = algorithms.get(j.algorithm)
    server, _ = start_server(j, algo, build_flat_model(j).param.clone())
    rec = Recorder(tmp_path)
    coord = _Coordinator(j, rec, server, Evaluator(j, data), None)
    now = time.monotonic()
    coord.ps, coord.store = _ServerThreadSeen([1, 2, 3], now), dist.HashStore()
    coord.watch()  # every worker is ready: the race, and the timers, start
    assert coord.racing and coord.silence.watched() == [0, 1, 2] and coord.lost_workers == []
    # ten seconds on: worker 0 committed every 0.1 s until now; worker 1 waited for the server; worker 2, nothing
    coord.silence.since = dict.fromkeys([0, 1, 2], now - 10.0)
    coord.ps.commits = [(0, now - 1.0 + 0.1 * k) for k in range(11)]
    coord.store.add(waiting_key(2), 3)
    coord.last_watch = 0.0
    coord.watch()
    rec.close()
    assert coord.ps.lost == [3] and coord.lost_workers == [2]
    assert coord.lost[0].startswith("worker 2 lost at commit 0 (silent for 10."), coord.lost
    assert coord.lost[0].endswith("limit 2.0 s = max(engine.timeout_s, 4 x median cycle 0.1 s))"), coord.lost
    assert coord.ps.wait_s == patience(2.0)  # gloo's waits on a worker outlast the limit


def _checkpoint_with_a_line(data, tmp_path, ctx):
    """Rank 0's coordinator of a local launch of 3 workers, ready to watch: its server thread holds the turn (a
    checkpoint) and workers 0 and 1 wait in line. (coordinator, recorder, the time its watch began)."""
    from gem.engines.turn import Turn

    j = dataclasses.replace(job(data, 3), engine={"name": "distributed", "timeout_s": 2, "silent_cycles": 4})
    server, _ = start_server(j, algorithms.get(j.algorithm), build_flat_model(j).param.clone())
    rec = Recorder(tmp_path)
    coord = _Coordinator(j, rec, server, Evaluator(j, data), None)
    now = time.monotonic()
    coord.ps, coord.store = _ServerThreadSeen([1, 2, 3], now), dist.HashStore()
    coord.turn = Turn(ctx, 5, torch.device("cpu"))
    coord.turn.state[0] = 3  # rank 0's server thread
    assert coord.turn._take(5)
    coord.turn._enqueue(0)
    coord.turn._enqueue(1)
    coord.turn._give()
    return coord, rec, now


def _ten_seconds_on_asked_to_save(coord, now):
    coord.watch()  # every worker is ready: the race, and the timers, start
    coord.silence.since = dict.fromkeys([0, 1, 2], now - 10.0)  # ten seconds on, and nobody has committed
    coord.ps.saving = {"told": {1, 2, 3}, "saved": {1}}  # worker 0 has sent its state; 1 (in line) and 2 have not
    coord.last_watch = 0.0
    coord.watch()


def test_with_a_local_turn_a_worker_in_line_is_to_blame_only_for_ignoring_a_checkpoint(data, tmp_path):
    """A local launch's workers wait for the server's turn in line, which rank 0 sees (Turn.peek): they are not
    silent through their own fault. One asked for its state for a checkpoint that does not answer (frozen in line)
    is: otherwise the checkpoint would wait for it until the whole run failed."""
    import multiprocessing

    coord, rec, now = _checkpoint_with_a_line(data, tmp_path, multiprocessing.get_context("spawn"))
    _ten_seconds_on_asked_to_save(coord, now)
    rec.close()
    assert coord.ps.lost == [2, 3] and coord.lost_workers == [1, 2]


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_checkpoint_blames_only_the_worker_frozen_inside_the_turn_s_lock(data, tmp_path):
    """As above, but worker 2 froze inside the turn's `meta` while asked for its state: worker 1, in line and asked
    too, cannot answer before `meta` is let go of. Only worker 2 is to blame."""
    import multiprocessing
    import types

    ctx = multiprocessing.get_context("spawn")
    coord, rec, now = _checkpoint_with_a_line(data, tmp_path, ctx)
    frozen = frozen_inside_meta(ctx, coord.turn)
    try:
        other = {"exitcode": None, "is_alive": lambda: False, "kill": lambda: None, "join": lambda timeout: None}
        coord.children = [types.SimpleNamespace(pid=11, **other), types.SimpleNamespace(pid=12, **other), frozen]
        _ten_seconds_on_asked_to_save(coord, now)
        rec.close()
        assert coord.ps.lost == [3] and coord.lost_workers == [2]
        assert coord.turn.meta_pid.value == 0  # taken back from the killed worker
    finally:
        frozen.kill()
        frozen.join(10)


class _Interrupted(Recorder):
    """Ctrl-C in rank 0's coordinator once `after` commits are recorded."""

    def __init__(self, d, after):
        super().__init__(d)
        self.after = after

    def commit(self, row, tensors=None):
        super().commit(row, tensors)
        self.after -= 1
        if self.after == 0:
            raise KeyboardInterrupt


@pytest.mark.slow  # a run of 2 distributed workers: 3 s
def test_rank_0_s_threads_in_gloo_s_waits_end_before_it_does(data, tmp_path, monkeypatch):
    """Interrupted, rank 0 exited with 134 and `terminate called without an active exception` (once in the suite,
    loaded) instead of 143: a header thread whose receive ended as the workers were killed had not taken the GIL
    back before the interpreter began its teardown, and Python ends such a thread from inside torch's wait, where
    C++ cannot unwind (pytorch/pytorch#38228). Here each header thread is slow to take it back, as on a loaded
    machine (a C++ wait that releases the GIL, as gloo's does): run.py SIGTERMed so exited with 134 in 3 tries of
    3, and with 143 once rank 0 waits for these threads before it returns. They have all ended when it does."""
    from gem.engines.distributed import headers

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    real = headers.Headers._receive

    def slow(self, rank):
        real(self, rank)
        with contextlib.suppress(RuntimeError):  # (DistStoreError: the wait timed out, as intended)
            store.wait(["never"], datetime.timedelta(seconds=0.2))  # the store serves one wait at a time

    monkeypatch.setattr(headers.Headers, "_receive", slow)
    rec = _Interrupted(tmp_path / "run", after=10)
    with pytest.raises(KeyboardInterrupt):
        try:
            distributed.run(job(data, 2, epochs=50), rec)
        finally:
            rec.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith(("gem-headers", "gem-parameter-server"))]
    assert left == [], left


def test_a_local_worker_waiting_in_line_exits_once_rank_0_is_gone():
    """Rank 0 holds the turn (its server thread: a checkpoint, a barrier's pull) and dies: a worker in line behind
    it never gets the turn, and no wire wait wakes it. It polls the pipe only rank 0 writes to, and exits on its
    end of file (its parent, the forkserver, outlives rank 0 while any worker lives: no use watching that)."""
    import multiprocessing
    import types

    from gem.engines.distributed import link, link_turn
    from gem.engines.turn import Turn

    ctx = multiprocessing.get_context("spawn")
    turn = Turn(ctx, 4, torch.device("cpu"))
    turn.state[0] = 2  # held by rank 0's server thread
    alive, here = ctx.Pipe(duplex=False)
    worker = link_turn.TurnLink.__new__(link_turn.TurnLink)
    worker.turn, worker.alive, worker.waiting = turn, alive, None
    worker.server = types.SimpleNamespace(clock=torch.zeros((), dtype=torch.long))
    out = []

    def wait_in_line():
        try:
            worker.acquire(0)
            out.append("turn")
        except link.ServerGone:
            out.append("gone")

    th = threading.Thread(target=wait_in_line, daemon=True)
    th.start()
    time.sleep(0.6)
    assert out == [] and turn.peek() == ({0}, None)
    here.close()  # rank 0 is gone
    th.join(10)
    assert out == ["gone"]


@pytest.mark.slow  # 2-3.5 s a case in the fast tier (2026-11-29)
def test_a_worker_waiting_for_the_server_says_so_on_the_store():
    store = dist.HashStore()
    key = waiting_key(2)
    waiting = _Waiting(store, 2)
    waiting.start()
    time.sleep(3 * distributed.WAITING_S)
    assert int(store.add(key, 0)) == 0  # computing (or hung in its rule): it says nothing
    waiting.waiting = True
    deadline = time.monotonic() + 30
    while int(store.add(key, 0)) < 2:
        assert time.monotonic() < deadline, "a waiting worker said nothing"
        time.sleep(0.1)
