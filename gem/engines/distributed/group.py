"""The group every rank of a distributed run joins: whether a launcher (torchrun, or SLURM through submitit)
started this process as one rank, gloo's network devices, the group itself, and how long its waits last.

Every wait has a timeout, and gloo aborts the whole group (closes every connection) when one of its waits times
out: so rank 0's waits on a worker last well beyond the silence limit (`patience`), and one expires only when no
worker can be heard from at all. (A worker's start, START_TIMEOUT_S, is every engine's: gem.engines.worker.)
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys
import time

import torch.distributed as dist

from gem.engines.distributed.doors import listening, refuse_newcomers

BYE_TIMEOUT_S = 30.0  # a worker waits this long for the server's last answer
JOIN_POLL_S = 0.5  # rank 0 looks this often for the ranks that have not said they join (await_ranks)
LEAVE_S = 10.0  # a rank that exits before it joins: its wait for the job's store, and for another to say why (leave)
NO_SECRET = "no-secret"  # the word a rank without a usable run secret leaves (leave); rank 0 says what it means


def timedelta_of(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def patience(limit_s: float) -> float:
    """How long rank 0 waits on one worker's message, given the silence limit: long enough that a silent worker
    is lost (and, launched locally, killed, which ends the wait) before the wait expires, which would make gloo
    abort the whole group; the coordinator may be busy (an evaluation) when the limit passes."""
    return 2.0 * limit_s + 10.0


def waiting_key(rank: int) -> str:
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
        raise ValueError(
            f"this host's name {name!r} resolves to no address other nodes can reach "
            f"({', '.join(sorted(addresses)) or 'none'}); set GLOO_SOCKET_IFNAME to the network "
            "interface the nodes share (e.g. GLOO_SOCKET_IFNAME=eth0) on every node"
        )
    return [dist.ProcessGroupGloo.create_default_device()]


def form_group(store, rank: int, world: int, host: str | None, timeout_s: float):
    """This rank's own gloo group on the job's store (under the prefix gem/), its waits limited to timeout_s, its
    connections on `host` (None: a rank of a launch over several machines, _devices)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta_of(timeout_s)
    opts._devices = _devices(host)
    return dist.ProcessGroupGloo(dist.PrefixStore("gem/", store), rank, world, opts)


def single_node() -> bool:
    """Every rank of the launch runs on this machine (torchrun's LOCAL_WORLD_SIZE is the world's size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world


def launched_group(timeout_s: float, say_after_s: float | None = None):
    """(store, group, rank, world) from the launcher's environment (torchrun's, or submitit's exported). Once
    the group has formed, what this rank listens on (gloo's port, and the store's if it holds it) takes nobody
    new (doors.py). Rank 0 first waits for every rank to say it joins (await_ranks, which names those that have
    not after `say_after_s` and gives up after timeout_s), and the others for rank 0's word that the group forms:
    gloo's own wait for the ranks says nothing, and would last timeout_s even for a rank that has exited."""
    before = listening()
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta_of(timeout_s)))
    store.set(joining_key(rank), "1")
    if rank == 0:
        await_ranks(store, world, timeout_s if say_after_s is None else say_after_s, timeout_s)
        store.set(FORMING_KEY, "1")
    else:
        # in gloo's formation this rank would give up timeout_s after it came, before rank 0 (which comes later:
        # it loads the data first) gives up on a missing rank and says which, and a worker's exit on rank 0's node
        # makes torchrun stop rank 0 before it could say it. Rank 0 decides within timeout_s of coming here
        store.wait([FORMING_KEY], timedelta_of(2 * timeout_s))
    # one node: loopback; several: each rank's own address, so that the others can reach it
    pg = form_group(store, rank, world, "127.0.0.1" if single_node() else None, timeout_s)
    refuse_newcomers(before)
    return store, pg, rank, world


# ------------------------------------------------------------------ ranks that do not join

# A launched rank says on the job's store that it joins before it enters gloo's group, whose formation waits
# for every rank and says nothing while it does (a rank that exited, on a node whose torchrun has stopped, is
# waited for to the end of timeout_s). Rank 0 reads these keys first (await_ranks): it names the ranks that have
# not joined while it waits, and ends the run at once when one has left word that it exits (leave).


def joining_key(rank: int) -> str:
    return f"gem-joining/{rank}"


def leaving_key(rank: int) -> str:
    return f"gem-leaving/{rank}"


FORMING_KEY = "gem-forming"  # rank 0: every rank has said it joins, and the group forms
LEAVING_COUNT = "gem-leaving"  # how many ranks have left word: rank 0 reads each rank's word only once one has


def ranges(nums) -> str:
    """[0, 1, 2, 3, 7, 9, 10] -> '0-3, 7, 9-10' (also a sweep's job numbers, experiments.command)."""
    nums, out, start = sorted(nums), [], None
    for i, n in enumerate(nums):
        start = n if start is None else start
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def ranks_text(ranks) -> str:
    """[2, 3, 5] -> 'ranks 2-3, 5'; [4] -> 'rank 4'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ranges(ranks)


def _why_left(word: bytes) -> str:
    # rank 0 prints its own words for what a rank left on the store, never the store's bytes: anyone who reaches
    # the store can write there
    if word == NO_SECRET.encode():
        return (
            "without the run's secret (on that node GEM_RUN_SECRET is not set, GEM_RUN_SECRET_FILE cannot be read, "
            "or the secret is shorter than 16 characters: its output says which; export the same GEM_RUN_SECRET "
            "on every node)"
        )
    return "with an error (that node's output says which)"


def await_ranks(store, world: int, say_after_s: float, timeout_s: float, poll_s: float = JOIN_POLL_S) -> None:
    """Rank 0 of a launch, before its group forms: wait until every rank has said on the job's store that it joins
    (launched_group). One that has left word that it exits (leave) never will, and gloo's group needs every rank:
    RuntimeError at once, naming it and why. While some have not joined, say which after say_after_s
    (engine.timeout_s), then after twice as long each time; RuntimeError after timeout_s."""
    missing = set(range(1, world))
    start = time.monotonic()
    say_at = say_after_s
    while True:
        missing = {r for r in missing if not store.check([joining_key(r)])}
        if not missing:
            return
        if int(store.add(LEAVING_COUNT, 0)) > 0:
            left = {r: store.get(leaving_key(r)) for r in sorted(missing) if store.check([leaving_key(r)])}
            if left:
                whys = {}
                for r, word in left.items():
                    whys.setdefault(_why_left(word), []).append(r)
                said = "; ".join(f"{ranks_text(rs)} exited before joining {why}" for why, rs in whys.items())
                others = missing - set(left)
                if others:  # killed by their node's torchrun, say, once the first had exited
                    said += f"; {ranks_text(others)} {'has' if len(others) == 1 else 'have'} not joined either"
                raise RuntimeError(f"{said}; the group needs every rank")
        waited = time.monotonic() - start
        hint = "a rank that fails before it joins never will: its node's output says why"
        if waited >= timeout_s:
            raise RuntimeError(f"{ranks_text(missing)} did not join within {timeout_s:.0f} s; {hint}")
        if waited >= say_at:
            print(
                f"gem: rank 0: {ranks_text(missing)} {'has' if len(missing) == 1 else 'have'} not joined after "
                f"{waited:.0f} s (the run fails at {timeout_s:.0f} s without them); {hint}",
                file=sys.stderr,
                flush=True,
            )
            say_at = 2 * max(say_at, poll_s)  # less often the longer it lasts: a few lines in all
        time.sleep(poll_s)


def leave(word: str, say, timeout_s: float = LEAVE_S) -> None:
    """A launched rank that exits before it joins (`word`: why, e.g. NO_SECRET): leave word on the job's store for
    rank 0, which then ends the run at once (await_ranks) instead of waiting for it, and say why on stderr (`say`)
    once per node: a node's ranks share one environment and fail alike, and the first of them to reach the store
    says it. The others wait until it has (up to twice timeout_s), since torchrun stops a node's other ranks as
    soon as one of them exits. On rank 0's node, rank 0 itself refuses the run with the same line (its config's
    check, in the same environment), after which torchrun stops this rank: the first waits timeout_s for that
    before it says it. Without the store (unreachable within timeout_s), every rank says it."""
    try:
        store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta_of(timeout_s)))
        store.set(leaving_key(rank), word)
        store.add(LEAVING_COUNT, 1)
        node = os.environ.get("GROUP_RANK") or str(rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        said = f"gem-said/{node}/{word}"
        first = int(store.add(said, 1)) == 1
    except Exception:  # noqa: BLE001 - no store to leave word on (no launcher's, or out of reach): say it here
        say()
        return
    if not first:
        try:
            store.wait([f"{said}/done"], timedelta_of(2 * timeout_s))
        except Exception:  # noqa: BLE001 - the first has not said it after all: say it here as well
            say()
        return
    if node == "0":
        time.sleep(timeout_s)  # rank 0 says it, and this rank is stopped, unless rank 0 has not come so far
    say()
    try:
        store.set(f"{said}/done", "")
    except Exception:  # noqa: BLE001 - the others then say it as well, once their wait is over
        pass
