"""Each engine's options: a typed record, every default written here once.

The config's validation merges the engine group into its engine's record (experiments.config.engine_options: the
keys, types and ranges are these); `conf/engine/<name>.yaml` shows the same values, which a test keeps equal to
these defaults. A `Job` made in Python gets them too (`Job(engine={"name": "sim"})` is `SimOptions()`), and an
engine reads `job.engine.<option>`: no engine looks an option up by string with a default of its own.
`__post_init__` refuses a value out of range in one line naming the key, as `Params` does. Keys of another engine
(an experiment's sim settings run with engine=process) are ignored, in a dict given to `Job` and in the config.

`engine.checkpoint_every` is a key of the engine's config group but not an option of the engine: it is the run's
schedule, `Job.checkpoint_every` (0 for a Job made in Python: no checkpoints unless asked).

Runtime facts (when the run started, how many training examples rank 0 has, where its shared memory is) are not
options: the distributed engine hands them to its workers in their own record (gem.engines.distributed.job.Start).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# how the sim engine orders the workers' commits (gem.engines.sim.Schedule, docs/design.md "Staleness")
STALENESS_MODELS = ("round_robin", "exponential", "stragglers", "gamma", "trace")


def require(ok: bool, key: str, value, allowed: str) -> None:
    """One line naming the key and what is allowed."""
    if not ok:
        raise ValueError(f"engine.{key}={value} is not allowed; it must be {allowed}")


@dataclass(frozen=True)
class SimOptions:
    """engine=sim: virtual workers in one process, in the order a deterministic schedule of cycle times gives."""

    name: str = "sim"
    staleness: str = "gamma"  # gamma | round_robin | exponential | stragglers | trace (STALENESS_MODELS)
    straggler_fraction: float = 0.25  # stragglers: the share of workers that are slow
    straggler_slowdown: float = 4.0  # stragglers: how many times slower they are
    cycle_cv: float = 0.25  # gamma: coefficient of variation of a worker's cycle time (0: round robin, 1: exponential)
    trace: str = ""  # trace: a process or distributed run directory whose commit times are replayed

    def __post_init__(self):
        if self.staleness not in STALENESS_MODELS:
            raise ValueError(
                f"engine.staleness={self.staleness} is not allowed; choose one of: {', '.join(STALENESS_MODELS)}"
            )
        require(0 < self.straggler_fraction <= 1, "straggler_fraction", self.straggler_fraction, "a number in (0, 1]")
        require(self.straggler_slowdown >= 1, "straggler_slowdown", self.straggler_slowdown, "a number >= 1")
        require(0 <= self.cycle_cv <= 10, "cycle_cv", self.cycle_cv, "a number in [0, 10] (0: round robin)")
        if self.staleness == "trace" and not self.trace:
            raise ValueError(
                "engine.staleness=trace needs engine.trace=<the run directory of a process or distributed run>"
            )
        if self.staleness != "trace" and self.trace:
            raise ValueError(
                f"engine.trace is set but engine.staleness={self.staleness}; add engine.staleness=trace to replay it"
            )


@dataclass(frozen=True)
class ProcessOptions:
    """engine=process: one operating-system process per worker on this machine, θ in shared memory."""

    name: str = "process"
    # θ and the server's tensors on the workers' GPU when they all compute on one (CUDA IPC); else in host memory
    theta_on_gpu: bool = True
    # a worker that has not committed for silent_cycles x the median time between commits of a worker, and for at
    # least timeout_s, is lost (killed, recorded; the run goes on with the others): gem.engines.coordinator.Silence
    timeout_s: float = 60.0
    silent_cycles: float = 10.0

    def __post_init__(self):
        require(self.timeout_s > 0, "timeout_s", self.timeout_s, "a number of seconds > 0")
        require(self.silent_cycles > 0, "silent_cycles", self.silent_cycles, "a number > 0")


@dataclass(frozen=True)
class DistributedOptions(ProcessOptions):
    """engine=distributed: rank 0 of a torch.distributed group serves θ, the other ranks are the workers."""

    name: str = "distributed"
    host: str = "127.0.0.1"  # local launch: the address rank 0 listens on (loopback: nothing outside can join)
    allow_remote: bool = False  # local launch: an address other than loopback needs this opt-in
    port: int = 0  # local launch: its port; 0 picks a free one, so that the runs of a sweep never collide
    # the workers on rank 0's host read θ from shared memory (and, launched locally, pass the server's turn among
    # themselves there, as on engine=process)
    shared_memory: bool = True
    # over the wire, where the algorithm's worker rule reads no θ: θ goes back to one worker while the next worker's
    # commit arrives (docs/design.md, "Full duplex over the wire"); false: each commit's exchange is served whole, as
    # for the rules that read θ (the same commits: to compare the two, benchmarks/multihost.py)
    full_duplex: bool = True
    # θ cut into this many shards, each served by its own rank with its own clock (docs/design.md, "Sharded
    # servers"): rank 0 serves shard 0, ranks n + 1 .. n + S - 1 the others
    servers: int = 1

    def __post_init__(self):
        super().__post_init__()
        require(1 <= self.servers <= 64, "servers", self.servers, "an integer from 1 to 64")
        require(0 <= self.port <= 65535, "port", self.port, "an integer in [0, 65535] (0: a free port)")


OPTIONS = {"sim": SimOptions, "process": ProcessOptions, "distributed": DistributedOptions}
EngineOptions = SimOptions | ProcessOptions | DistributedOptions
OPTION_KEYS = frozenset(f.name for c in OPTIONS.values() for f in dataclasses.fields(c))  # every engine's


def options_class(name: str) -> type:
    if name not in OPTIONS:
        raise ValueError(f"engine={name} is not an engine; choose one of: {', '.join(OPTIONS)}")
    return OPTIONS[name]


def without_others(cls: type, given: dict) -> dict:
    """`given` less the keys that are another engine's options and not `cls`'s (fig1's engine.staleness with
    engine=process): they do not apply here. A key no engine has is kept, for the caller to refuse."""
    own = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in given.items() if k in own or k not in OPTION_KEYS}


def of(engine) -> EngineOptions:
    """An engine's options from its record or from a dict of some of them (`{"name": "process", "timeout_s": 5}`;
    without a name: sim). The dict may hold another engine's options too, which this one ignores: one dict serves a
    caller that runs the same job on every engine. ValueError in one line for a key no engine has, or a value out
    of range."""
    if isinstance(engine, tuple(OPTIONS.values())):
        return engine
    given = dict(engine or {})
    cls = options_class(str(given.get("name", "sim")))
    given = without_others(cls, given)
    unknown = sorted(set(given) - OPTION_KEYS)
    if unknown:
        keys = sorted(f.name for f in dataclasses.fields(cls) if f.name != "name")
        raise ValueError(
            f"engine.{unknown[0]} is not an option of any engine; engine={cls().name}'s are: {', '.join(keys)}"
        )
    return cls(**given)
