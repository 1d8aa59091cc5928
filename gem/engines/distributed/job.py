"""The job on the wire: rank 0 sends each worker the Job it runs, as JSON (its fields, the algorithm's
hyperparameters) and raw tensors (the training set), never a pickle; the worker rebuilds the same Job. Then, on
the same tag, the worker's saved state when the run resumes from a checkpoint."""

from __future__ import annotations

import dataclasses
import json

import torch

from gem import algorithms
from gem.data import Dataset
from gem.engines import Job
from gem.engines.distributed.wire import HEADER, TAG_JOB, _recv_bytes, _recv_packed, _send_bytes, _send_packed, _wait
from gem.models import ModelSpec

DATASET_TENSORS = ("train_x", "train_y", "val_x", "val_y")  # raw on the wire; gem.data.Dataset's other fields: JSON
DONE = {"done": True}  # instead of a worker's state: the run resumes from a checkpoint in which it had no work left


def _for_workers(job: Job) -> Job:
    """What travels to the workers: the job without the validation split, and without the training set when
    the workers can load it themselves (job.data_source)."""
    data = None
    if job.data_source is None:
        data = dataclasses.replace(job.data, val_x=job.data.val_x[:0].clone(), val_y=job.data.val_y[:0].clone())
    return dataclasses.replace(job, data=data, resume=None)


def encode_job(job: Job) -> tuple[bytes, dict[str, torch.Tensor] | None]:
    """The job as JSON, and its dataset's tensors (None without a dataset), to be sent raw: every field of Job,
    the algorithm's hyperparameters as a dict, the dataset's name and options. decode_job rebuilds it."""
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    fields["hp"] = _hp_fields(job)
    if isinstance(job.model, ModelSpec):  # its name, factory and keyword arguments: JSON, rebuilt by decode_job
        fields["model"] = {"spec": dataclasses.asdict(job.model)}
    tensors = None
    if job.data is not None:
        if type(job.data) is not Dataset:  # a subclass's own behaviour would not travel with its fields
            raise TypeError(f"engine=distributed sends a gem.data.Dataset, not a {type(job.data).__name__}")
        fields["data"] = {f.name: getattr(job.data, f.name) for f in dataclasses.fields(Dataset)
                          if f.name not in DATASET_TENSORS}
        tensors = {k: getattr(job.data, k) for k in DATASET_TENSORS}
    for name, value in fields.items():  # name the field that cannot travel, rather than fail somewhere in json
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"engine=distributed sends the job as JSON, and Job.{name} is not JSON ({e})") from None
    return json.dumps(fields).encode(), tensors


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
        raise TypeError(f"engine=distributed sends algorithm={job.algorithm}'s Params as JSON, and {d} does not "
                        "come back the same")
    return d


def decode_job(text: bytes, tensors: dict[str, torch.Tensor] | None) -> Job:
    """The Job that encode_job encoded: the same value in every field."""
    fields = json.loads(text)
    fields["hp"] = algorithms.get(fields["algorithm"]).Params(**fields["hp"])
    if isinstance(fields["model"], dict):
        fields["model"] = ModelSpec(**fields["model"]["spec"])
    if fields["data"] is not None:
        fields["data"] = Dataset(**fields["data"], **tensors)
    source = fields["data_source"]
    if source is not None and source.get("shape") is not None:
        source["shape"] = tuple(source["shape"])  # the model's input shape: a tuple, which JSON makes a list
    return Job(**fields)


def _send_job(pg, encoded: tuple[bytes, dict | None], dst: int, timeout_s: float) -> None:
    text, tensors = encoded
    _wait(pg.send([torch.tensor([len(text), 0, 0, 0], dtype=torch.long)], dst, TAG_JOB), timeout_s)
    _send_bytes(pg, text, dst, TAG_JOB, timeout_s)
    _send_packed(pg, tensors, dst, TAG_JOB, timeout_s)


def _recv_job(pg, timeout_s: float) -> Job:
    header = torch.zeros(HEADER, dtype=torch.long)
    _wait(pg.recv([header], 0, TAG_JOB), timeout_s)
    text = _recv_bytes(pg, int(header[0]), 0, TAG_JOB, timeout_s)
    return decode_job(text, _recv_packed(pg, 0, TAG_JOB, timeout_s))

