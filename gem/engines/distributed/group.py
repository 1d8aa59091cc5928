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

import torch.distributed as dist

from gem.engines.distributed.doors import listening, refuse_newcomers

BYE_TIMEOUT_S = 30.0  # a worker waits this long for the server's last answer


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


def launched_group(timeout_s: float):
    """(store, group, rank, world) from the launcher's environment (torchrun's, or submitit's exported). Once
    the group has formed, what this rank listens on (gloo's port, and the store's if it holds it) takes nobody
    new (doors.py)."""
    before = listening()
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta_of(timeout_s)))
    # one node: loopback; several: each rank's own address, so that the others can reach it
    pg = form_group(store, rank, world, "127.0.0.1" if single_node() else None, timeout_s)
    refuse_newcomers(before)
    return store, pg, rank, world
