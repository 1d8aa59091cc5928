"""Where θ and the server's tensors live in an engine=distributed run, and how the workers reach them (`Placement`):
decided once by rank 0 from the job and the launch, and said in the run's summary (`placement`)."""

from __future__ import annotations

import dataclasses
import os

import torch

from gem.engines import Job
from gem.engines.core import central_device
from gem.engines.distributed.group import launched
from gem.engines.distributed.job import full_duplex


def _hands_theta(central: torch.device) -> bool:
    """Whether a local launch hands θ and the server's tensors to its workers (on their GPU, by CUDA IPC) rather
    than keep them in the window. (The tests hand CPU tensors, shared memory, to run this path without a GPU.)"""
    return central.type == "cuda"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where θ and the server's tensors live in this run, and how the workers reach them: decided once, by `plan`
    (and `without_window` where the window cannot be made), and recorded in the summary (`placement`,
    `central_device`, `local_turn`; `shared_memory_workers` says which workers did map the window).

    A local launch (`python run.py engine=distributed`) has every worker on rank 0's host: with
    `engine.shared_memory` they pass the server's turn among themselves in rank 0's window, as on engine=process,
    and θ lives in the window, or on their GPU where they all compute on one (`central_device`,
    `engine.theta_on_gpu`: handed to them by CUDA IPC). Under a launcher (torchrun, SLURM) rank 0 serves every
    commit; the ranks after 0 on its node (static rendezvous puts ranks 0 .. LOCAL_WORLD_SIZE - 1 there) read θ from
    the window instead of the wire, and every other worker exchanges it over the wire. θ is then in rank 0's host
    memory: gloo moves CPU tensors."""

    central: torch.device  # θ and the server's tensors
    slots: int  # workers 0 .. slots - 1 may map rank 0's window; 0: no window, every worker uses the wire
    local_turn: bool  # the workers pass the server's turn among themselves in the window (a local launch)
    handed: bool  # θ is on the workers' GPU, handed to them by CUDA IPC (the window holds the clock and the log)
    # over the wire, θ goes back after each commit while the next one arrives: the worker rule reads no θ (or only
    # the few server tensors GO carries), or runs the part that does at rank 0, and engine.full_duplex is on
    # (job.full_duplex, from which WireServer and the workers' WireLink decide the same)
    duplex: bool = False
    servers: int = 1  # θ in this many shards, each served by its own rank (shards.py)
    rule_at_server: bool = False  # in full duplex, the part of the worker rule that reads θ runs at rank 0 (GEM)

    @classmethod
    def plan(cls, job: Job) -> Placement:
        cpu = torch.device("cpu")
        if launched():
            slots = min(job.workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1)
            local, central = False, cpu
        else:
            slots, local, central = job.workers, True, central_device(job)
        # several servers: every worker over the wire, with each shard (no window, which holds θ whole)
        slots = slots if job.engine.shared_memory and job.engine.servers == 1 else 0
        handed = local and slots > 0 and _hands_theta(central)
        duplex = full_duplex(job)
        at_server = duplex is not None and duplex.at_server is not None
        place = cls(central if handed else cpu, max(0, slots), local and slots > 0, handed, duplex is not None)
        return dataclasses.replace(place, servers=job.engine.servers, rule_at_server=at_server)

    def without_window(self) -> Placement:
        """No window after all: every worker exchanges θ with rank 0 over the wire, θ in rank 0's memory."""
        return dataclasses.replace(self, central=torch.device("cpu"), slots=0, local_turn=False, handed=False)

    def describe(self) -> str:
        if self.handed:
            return (
                f"θ on {self.central}, handed to the workers by CUDA IPC; they pass the server's turn among "
                "themselves in shared memory"
            )
        if self.local_turn:
            return "θ in shared memory on rank 0's host; the workers pass the server's turn among themselves there"
        where = "each server, on its slice" if self.servers > 1 else "rank 0"
        at_server = f"; the part of the worker rule that reads θ runs at {where}" if self.rule_at_server else ""
        wire = (
            f"in full duplex (θ back to one worker while the next worker's commit arrives{at_server})"
            if self.duplex
            else "one exchange at a time (θ out with the turn, the commit back: the worker rule reads the live θ, or "
            "engine.full_duplex=false)"
        )
        if self.slots:
            return (
                f"θ in rank 0's memory, served by rank 0; workers 0-{self.slots - 1} (on its host) read it from "
                f"shared memory, the others over the wire, {wire}"
            )
        if self.servers > 1:
            return (
                f"θ in {self.servers} shards, each served by its own rank (rank 0 serves the first); every worker "
                f"exchanges its slices with each over the wire, {wire}"
            )
        return f"θ in rank 0's memory, served by rank 0; every worker exchanges it over the wire, {wire}"
