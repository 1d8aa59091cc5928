"""The job on the wire: rank 0 sends each worker the Job it runs, as JSON (its fields, the algorithm's
hyperparameters) and raw tensors (the training set), never a pickle; the worker rebuilds the same Job. The same
JSON carries the run's `Start`: what rank 0 knows once the run has begun (its clock's origin, its training set's
size, its shared memory), which is not an option of the job. Then, on the same tag, the worker's saved state when
the run resumes from a checkpoint. Rank 0 sends it only to a worker
that proved the run's secret (secret.admit, on the same tag, first).

A job names code: an algorithm and a model factory by import path (a Hydra config's `_target_`s, when Hydra
instantiates the model). A worker imports only what its own side allows (`allowed_imports`): gem's own algorithms
and models; the import paths of its own command line and model configs (under torchrun every rank has the same
command line: experiments.instantiate.worker_imports); those its parent, rank 0, gave it (a local launch);
and those listed in its environment's GEM_ALLOWED_IMPORTS. A job that names anything else is refused in one line
(ValueError) before anything is imported, so whoever speaks for rank 0 on the wire cannot make a worker run code
of its choosing. The dataset a worker loads itself (Job.data_source) is one of gem's loaders, by name.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from gem import algorithms
from gem.data import Dataset
from gem.engines import Job
from gem.engines.distributed.messages import HEADER, TAG_JOB, recv_bytes, recv_packed, send_bytes, send_packed, wait
from gem.models import MODELS, ModelSpec

IMPORTS_ENV = "GEM_ALLOWED_IMPORTS"  # comma-separated import paths a worker may import besides gem's own
INSTANTIATE = "hydra.utils.instantiate"  # a ModelSpec's factory for a Hydra config: it imports the config's _target_s
GEM_MODELS = frozenset(f"{f.__module__}.{f.__qualname__}" for f in MODELS.values())  # gem.models.MnistCNN, ...

DATASET_TENSORS = ("train_x", "train_y", "val_x", "val_y")  # raw on the wire; gem.data.Dataset's other fields: JSON
TEST_TENSORS = ("test_x", "test_y")  # raw too where a job holds them (a worker's does not: job_for_workers)
DONE = {"done": True}  # instead of a worker's state: the run resumes from a checkpoint in which it had no work left


@dataclasses.dataclass(frozen=True)
class Start:
    """What a worker learns from rank 0 about the run besides its job."""

    t0_wall: float  # the run's origin on the wall clock: a commit row's time_s is time.time() - t0_wall
    train_examples: int  # rank 0's training examples: a worker that loads its own data must find as many
    window: dict | None = None  # rank 0's shared memory (window.Window.described()), for the workers on its host


@dataclasses.dataclass(frozen=True)
class FullDuplex:
    """How commits over the wire run in full duplex: θ (or what the commit sends back) on its way to one worker
    while the next worker's commit arrives."""

    # the worker rule reads the live θ: the part of it that does runs at rank 0 (GEM: all of it, on m and s kept
    # there), the worker sends what it declares; None: the rule reads no θ and runs whole at the worker
    at_server: algorithms.AtServer | None = None
    # the server's tensors the worker rule reads (no θ: Ringmaster's counters, DyLU's paces), sent with GO
    go_sends: tuple[str, ...] = ()


def full_duplex(job: Job) -> FullDuplex | None:
    """How commits over the wire run in full duplex (docs/design.md, "Full duplex over the wire"), or None where
    each exchange is served whole (θ out with GO, the commit back): full duplex where `engine.full_duplex` leaves
    it on and the worker rule reads no θ, or declares the part that does to run at the server
    (`Algorithm.at_server`), or reads only some of the server's tensors, which GO then carries
    (`Algorithm.reads_server`). Rank 0 and each worker decide it from the job alone."""
    if not job.engine.full_duplex:
        return None
    algo = algorithms.get(job.algorithm)
    if not algo.reads_central(job.hp):
        return FullDuplex()
    if algo.at_server is not None:
        return FullDuplex(algo.at_server)
    return FullDuplex(go_sends=algo.reads_server) if algo.reads_server is not None else None


def job_for_workers(job: Job) -> Job:
    """What travels to the workers: the job without the validation and test splits, and without the training set
    when the workers can load it themselves (job.data_source)."""
    data = None
    if job.data_source is None:
        data = job.data.for_workers()
    return dataclasses.replace(job, data=data, resume=None)


def encode_job(job: Job, start: Start | None = None) -> tuple[bytes, dict[str, torch.Tensor] | None]:
    """The job as JSON, and its dataset's tensors (None without a dataset), to be sent raw: every field of Job,
    the algorithm's hyperparameters and the engine's options as dicts, the dataset's name and options; and the
    run's `start`. decode_job and decode_start rebuild them."""
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    fields["hp"] = _hp_fields(job)
    fields["engine"] = dataclasses.asdict(job.engine)
    if isinstance(job.model, ModelSpec):  # its name, factory and keyword arguments: JSON, rebuilt by decode_job
        fields["model"] = {"spec": dataclasses.asdict(job.model)}
    tensors = None
    if job.data is not None:
        if type(job.data) is not Dataset:  # a subclass's own behaviour would not travel with its fields
            raise TypeError(f"engine=distributed sends a gem.data.Dataset, not a {type(job.data).__name__}")
        fields["data"] = {
            f.name: getattr(job.data, f.name)
            for f in dataclasses.fields(Dataset)
            if f.name not in DATASET_TENSORS + TEST_TENSORS
        }
        tensors = {k: getattr(job.data, k) for k in DATASET_TENSORS + TEST_TENSORS if getattr(job.data, k) is not None}
    for name, value in fields.items():  # name the field that cannot travel, rather than fail somewhere in json
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"engine=distributed sends the job as JSON, and Job.{name} is not JSON ({e})") from None
    message = {"job": fields, "start": dataclasses.asdict(start) if start is not None else None}
    return json.dumps(message).encode(), tensors


def _hp_fields(job: Job) -> dict:
    """The algorithm's Params as a dict that rebuilds them exactly (Params(**d)); checked here, on rank 0, so that
    a Params that JSON would change (a tuple, a nested dataclass) fails the run in one line before it starts."""
    params = algorithms.get(job.algorithm).Params
    d = dataclasses.asdict(job.hp)
    try:
        same = params(**json.loads(json.dumps(d))) == job.hp
    except (TypeError, ValueError):
        same = False
    if not same:
        raise TypeError(
            f"engine=distributed sends algorithm={job.algorithm}'s Params as JSON, and {d} does not come back the same"
        )
    return d


def decode_job(text: bytes, tensors: dict[str, torch.Tensor] | None, allowed: frozenset[str] = frozenset()) -> Job:
    """The Job that encode_job encoded: the same value in every field. ValueError, before anything is imported,
    if it names an algorithm or a model outside gem's own and `allowed` (allowed_imports)."""
    fields = _message(text)["job"]
    model = fields["model"]
    spec = ModelSpec(**model["spec"]) if isinstance(model, dict) else model
    check_imports(named_imports(fields["algorithm"], spec), allowed)
    fields["model"] = spec
    fields["hp"] = algorithms.get(fields["algorithm"]).Params(**fields["hp"])
    if fields["data"] is not None:
        fields["data"] = Dataset(**fields["data"], **tensors)
    source = fields["data_source"]
    if source is not None and source.get("shape") is not None:
        source["shape"] = tuple(source["shape"])  # the model's input shape: a tuple, which JSON makes a list
    return Job(**fields)


def decode_start(text: bytes) -> Start | None:
    """The run's Start that encode_job sent with the job (None where it sent none)."""
    start = _message(text)["start"]
    return None if start is None else Start(**start)


def _message(text: bytes) -> dict:
    message = json.loads(text)
    if not isinstance(message, dict) or set(message) != {"job", "start"}:
        raise ValueError(
            "rank 0's job message is not in this gem's format: rank 0 and this worker run different "
            "versions of gem (every node needs the same checkout)"
        )
    return message


def named_imports(algorithm, model) -> set[str]:
    """The import paths a job makes a worker import: an algorithm by import path; a ModelSpec's factory, or,
    for one that Hydra instantiates, every `_target_` of its config (Hydra imports each)."""
    out = set()
    if algorithm not in algorithms.ALGORITHMS:  # algorithms.get imports a dotted name as a module
        out.add(str(algorithm))
    if isinstance(model, ModelSpec):
        out |= import_targets(model.kwargs) if model.factory == INSTANTIATE else {str(model.factory)}
    return out


def import_targets(node) -> set[str]:
    """Every `_target_` in a nest of dicts and lists (a model config's, say), nested ones included."""
    if isinstance(node, dict):
        here = {str(node["_target_"])} if "_target_" in node else set()
        return here.union(*(import_targets(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(import_targets(v) for v in node))
    return set()


def allowed_imports(given=()) -> frozenset[str]:
    """What a worker may import for its job besides gem's own: `given` (its own command line's, or its parent's)
    and the paths in GEM_ALLOWED_IMPORTS. A path allows itself and what lies under it ("my_models" allows
    "my_models.Net")."""
    listed = (p.strip() for p in os.environ.get(IMPORTS_ENV, "").split(","))
    return frozenset(_normal(p) for p in (*given, *listed) if p)


def check_imports(named: set[str], allowed: frozenset[str]) -> None:
    """ValueError, in one line, naming each import path of `named` that neither gem's models nor `allowed` allow."""
    own = GEM_MODELS | allowed
    refused = sorted(p for p in named if not any(_normal(p) == a or _normal(p).startswith(a + ".") for a in own))
    if refused:
        raise ValueError(
            f"the job names {', '.join(refused)}, which this worker does not import: a worker imports "
            f"gem's own algorithms and models, the import paths of its own command line and model "
            f"configs, and those listed in {IMPORTS_ENV} (comma-separated) on its host"
        )


def _normal(path: str) -> str:
    return str(path).replace(":", ".")  # Hydra's "package.module:attr" is gem's "package.module.attr"


def send_job(pg, encoded: tuple[bytes, dict | None], dst: int, timeout_s: float) -> None:
    text, tensors = encoded
    wait(pg.send([torch.tensor([len(text), 0, 0, 0], dtype=torch.long)], dst, TAG_JOB), timeout_s)
    send_bytes(pg, text, dst, TAG_JOB, timeout_s)
    send_packed(pg, tensors, dst, TAG_JOB, timeout_s)


def recv_job(pg, timeout_s: float) -> tuple[bytes, dict | None]:
    """The job as it came (decode_job rebuilds it): every message rank 0 sends is received before the worker
    judges it, so that rank 0 waits on none."""
    header = torch.zeros(HEADER, dtype=torch.long)
    wait(pg.recv([header], 0, TAG_JOB), timeout_s)
    text = recv_bytes(pg, int(header[0]), 0, TAG_JOB, timeout_s)
    return text, recv_packed(pg, 0, TAG_JOB, timeout_s)
