"""What rank 0 accepts from a worker. Rank 0 holds a worker to what it expects (`Bounds`, built from the job): every
size a worker announces is checked before a byte is allocated or received, every message's kind against what the
worker may send now, every row and tensor spec against the schema. A worker that sends anything else is lost, with
a reason that says what it sent (messages.Malformed), and the run goes on with the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import torch

from gem.engines.distributed.messages import (
    ASK,
    DIVERGED,
    DTYPES,
    ERROR,
    FINISHED,
    KINDS,
    PULL,
    READY,
    ROWS,
    SAVED,
    Malformed,
)
from gem.engines.worker import ROWS_PER_MESSAGE

# Every limit on what a worker sends, each with the reason for its value. Sizes that depend on the run (the model,
# the algorithm, the data) are worked out from the job in Bounds.of.
ROWS_PENDING = 4 * ROWS_PER_MESSAGE  # a worker's commits whose rows have not come: ROWS_PER_MESSAGE, and one in
# flight, for a worker that keeps the protocol; it is lost for holding back more
ROW_BYTES = 4096  # one row's dict: some twenty keys (step, worker, times, loss, the algorithm's metrics), each a
# name and a number, under 100 bytes of JSON apiece (its per-tensor lists are counted apart)
ROW_KEYS = 64  # keys of one row, a column each in metrics.parquet
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # a row's key or a per-tensor statistic's: a column's name
NAME_BYTES = 72  # such a name in JSON, with its quotes and separators
NUMBER_BYTES = 32  # a number in JSON with its separator: a float64 takes at most 24 characters
TENSOR_SERIES = 16  # per-tensor statistics one row may carry (GEM's: 3), a list of one number per tensor each
TEXT_BYTES = 1 << 16  # a DIVERGED's reason or an ERROR's traceback (a worker cuts it there): the reason of the
# lost worker keeps its first line
CLOCK_DIGITS = 19  # a PULL's barrier, a clock value in decimal: an int64
SPEC_BYTES = 1 << 16  # a tensor spec: a name, a dtype and a shape per tensor, and a saved state's counters
SPEC_TENSORS = 256  # tensors in one spec: a worker state has its algorithm's few, x and its random streams'
STATE_SLACK = 1 << 20  # a saved worker state beside x, its algorithm state and its data order: its random states
INT64 = 1 << 63  # an integer in a row or a spec must fit an int64 column or shape
# how many bytes may follow a header of each kind (its `extra`): (at least, at most); READY's is b"1" from a worker
# that maps θ from shared memory (window.py)
EXTRA = {
    ASK: (0, 0),
    READY: (0, 1),
    FINISHED: (0, 0),
    DIVERGED: (1, TEXT_BYTES),
    ERROR: (1, TEXT_BYTES),
    SAVED: (1, SPEC_BYTES),
    PULL: (1, CLOCK_DIGITS),
    ROWS: (0, 0),
}
# the keys a commit row must have, for the ledger and the recorder, and their types
ROW_SCHEMA = {"step": int, "worker": int, "worker_step": int, "staleness": int, "loss": float, "time_s": float}


def _number(v) -> bool:
    """A JSON number that a parquet column holds: a float (NaN and infinities included), or an int64."""
    return type(v) is float or (type(v) is int and -INT64 <= v < INT64)


def _parse_spec(data: bytes, max_bytes: int) -> dict:
    """A tensor spec (messages.pack's) that a worker sent, checked before any buffer is made: JSON of the right
    form, each tensor named, of a dtype in DTYPES and of a valid shape, max_bytes in all at most, numbers plain.
    Malformed otherwise."""
    try:
        spec = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Malformed(f"a tensor spec that is not JSON ({e})") from None
    if not (
        isinstance(spec, dict)
        and set(spec) == {"numbers", "tensors"}
        and isinstance(spec["numbers"], dict)
        and isinstance(spec["tensors"], list)
    ):
        raise Malformed("a tensor spec that is not {numbers, tensors}")
    if len(spec["tensors"]) > SPEC_TENSORS:
        raise Malformed(f"a tensor spec of {len(spec['tensors'])} tensors (at most {SPEC_TENSORS} allowed)")
    total = 0
    for entry in spec["tensors"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[1] in DTYPES
            and isinstance(entry[2], list)
            and len(entry[2]) <= 8
            and all(type(d) is int and 0 <= d < INT64 for d in entry[2])
        ):
            raise Malformed(f"a tensor spec entry that is not [name, dtype, shape] of the wire's ({str(entry)[:80]})")
        total += math.prod(entry[2]) * DTYPES[entry[1]].itemsize
    if total > max_bytes:
        raise Malformed(f"a tensor spec announcing {total} bytes of tensors (at most {max_bytes} allowed)")
    for path, value in spec["numbers"].items():
        if not (_number(value) or value is None or value == {}):
            raise Malformed(f"a tensor spec whose number {path!r} is {str(value)[:40]}")
    return spec


def payload_spec(algo, theta: torch.Tensor, hp) -> dict[str, list]:
    """The payload every commit of the algorithm carries, as name → [dtype, shape], from its record's `payload`
    (gem.algorithms.Algorithm); {} when it declares none."""
    declared = algo.payload(theta, hp) if algo.payload is not None else {}
    return {name: [str(t.dtype), list(t.shape)] for name, t in declared.items()}


def sent_spec(algo, theta: torch.Tensor, hp) -> dict[str, list]:
    """What a worker sends for the part of its rule that runs at the server (`Algorithm.at_server`), as name →
    [dtype, shape], from the part's `sends` on a worker's state made from θ; {} where the rule declares none."""
    part = algo.at_server
    if part is None:
        return {}
    sent = part.sends(algo.init_state(theta, hp), theta, theta, hp)
    return {name: [str(t.dtype), list(t.shape)] for name, t in sent.items()}


def sent_buffers(algo, theta: torch.Tensor, hp) -> dict[str, torch.Tensor]:
    """Buffers for what a worker sends for the part of its rule run at a server (`sent_spec`), made by the server
    for its θ (or its slice of θ: shards.sliceable): nothing a worker announces is allocated."""
    return {
        name: torch.empty(shape, dtype=DTYPES[dtype]) for name, (dtype, shape) in sent_spec(algo, theta, hp).items()
    }


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What rank 0 accepts from a worker, worked out from the job: each message is checked against it before
    anything it announces is allocated, received or applied (Malformed otherwise)."""

    algorithm: str
    tensors: int  # the model's parameter tensors: a per-tensor statistic has one number for each
    row_bytes: int  # one row in JSON, its per-tensor statistics included
    state_bytes: int  # a saved worker state's tensors, in all
    payload: dict  # a commit's payload, exactly: payload_spec
    # what a worker sends, exactly, where the part of its rule that reads θ runs at the server: sent_spec. Rank 0
    # receives these into buffers of its own making, so no size a worker announces is allocated
    sent: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, algo, hp, theta: torch.Tensor, tensors: int, train_examples: int) -> Bounds:
        # a worker's state is x (θ's size), its algorithm state (measured: init_state on θ), the order of its
        # examples (one int64 each) and its counters and random states (STATE_SLACK)
        state = algo.init_state(theta, hp)
        nbytes = theta.nbytes + sum(v.nbytes for v in state.values()) + 8 * train_examples + STATE_SLACK
        row = ROW_BYTES + TENSOR_SERIES * (NAME_BYTES + tensors * NUMBER_BYTES)
        return cls(algo.name, tensors, row, nbytes, payload_spec(algo, theta, hp), sent_spec(algo, theta, hp))

    def header(self, kind: int, rows_nbytes: int, rows_count: int, extra_nbytes: int, pending: int) -> None:
        """A header's sizes, before anything that follows it is received; `pending`: the worker's commits whose
        rows have not come."""
        name = KINDS.get(kind)
        if name is None:
            raise Malformed(f"a header of unknown kind {kind}")
        header = f"{'an' if name[0] in 'AEIOU' else 'a'} {name} header"
        if min(rows_nbytes, rows_count, extra_nbytes) < 0:
            raise Malformed(
                f"{header} with a negative size ({rows_nbytes} bytes of rows, {rows_count} rows, "
                f"{extra_nbytes} extra bytes)"
            )
        if rows_count > pending:
            raise Malformed(
                f"{header} announcing the rows of {rows_count} commits, where {pending} of its commits await rows"
            )
        if kind == ROWS and not rows_count:
            raise Malformed(f"{header} with no rows")
        limit = rows_count * self.row_bytes
        if rows_nbytes > limit or (rows_nbytes == 0) != (rows_count == 0):
            raise Malformed(
                f"{header} announcing {rows_nbytes} bytes of rows for {rows_count} commits (at most {limit} allowed)"
            )
        low, high = EXTRA[kind]
        if not low <= extra_nbytes <= high:
            raise Malformed(f"{header} announcing {extra_nbytes} bytes after its rows ({low} to {high} allowed)")

    def clock(self, extra: bytes) -> int:
        """A PULL's barrier: a clock value, a non-negative int64 in decimal."""
        if not re.fullmatch(rb"[0-9]{1,%d}" % CLOCK_DIGITS, extra) or int(extra) >= INT64:
            raise Malformed(f"a PULL whose clock is not a non-negative int64 ({extra[:CLOCK_DIGITS]!r})")
        return int(extra)

    def state(self, data: bytes) -> dict:
        """A SAVED's spec: no more tensors than a worker state has."""
        return _parse_spec(data, self.state_bytes)

    def commit(self, spec_nbytes: int, at_server: bool = False) -> None:
        """A commit's first word: the length of its payload's spec, none where its commits carry no payload, nor
        where the rule runs at the server (`at_server`: the worker sends exactly `sent`, and the payload is made
        there)."""
        if at_server and spec_nbytes:
            raise Malformed(
                f"a commit announcing a payload spec of {spec_nbytes} bytes (none allowed: algorithm "
                f"{self.algorithm}'s rule runs at the server, which takes {self.sent} from a worker)"
            )
        if not 0 <= spec_nbytes <= (SPEC_BYTES if self.payload else 0):
            raise Malformed(
                f"a commit announcing a payload spec of {spec_nbytes} bytes "
                f"({f'at most {SPEC_BYTES}' if self.payload else 'none'} allowed: algorithm "
                f"{self.algorithm}'s commits carry {self.payload or 'no payload'})"
            )

    def payload_of(self, data: bytes) -> dict:
        """A commit's payload spec: exactly the tensors the algorithm's commits carry."""
        spec = _parse_spec(data, INT64)  # nothing is allocated unless it is exactly the payload declared
        got = {path: [dtype, shape] for path, dtype, shape in spec["tensors"]}
        if got != self.payload or spec["numbers"]:
            raise Malformed(
                f"a commit whose payload is {str(got or spec['numbers'])[:200]}, where algorithm "
                f"{self.algorithm}'s commits carry {self.payload}"
            )
        return spec

    def rows(self, text: bytes, worker: int, steps: list[int]) -> list[tuple[dict, dict | None]]:
        """A message's rows, [[row, per-tensor statistics or null], ...]: one for each commit in `steps`, which
        the header announced, in order, each of the schema the ledger and the recorder read."""
        try:
            rows = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise Malformed(f"rows that are not JSON ({str(e)[:100]})") from None
        if not isinstance(rows, list) or len(rows) != len(steps):
            raise Malformed(f"rows that are not a list of the {len(steps)} its header announced")
        out = []
        for entry, step in zip(rows, steps, strict=True):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], dict)):
                raise Malformed(f"a row that is not [row, tensors] ({str(entry)[:80]})")
            row, tensors = entry
            for key, kind in ROW_SCHEMA.items():
                if key not in row:
                    raise Malformed(f"a row without {key!r}")
                if not (_number(row[key]) and (kind is float or type(row[key]) is int)):
                    raise Malformed(f"a row whose {key!r} is {str(row[key])[:40]} (a {kind.__name__} is expected)")
            if (row["step"], row["worker"]) != (step, worker):
                raise Malformed(
                    f"a row of worker {row['worker']} for commit {row['step']}, where its next row is "
                    f"worker {worker}'s for commit {step}"
                )
            if len(row) > ROW_KEYS:
                raise Malformed(f"a row of {len(row)} keys (at most {ROW_KEYS} allowed)")
            for key, value in row.items():
                if not NAME.fullmatch(key) or key == "lost_row" or not (_number(value) or value is None):
                    raise Malformed(
                        f"a row whose {key[:70]!r} is {str(value)[:40]} (a column name and a number are expected)"
                    )
            if tensors is not None:
                self.tensor_statistics(tensors)
            out.append((row, tensors))
        return out

    def tensor_statistics(self, tensors) -> None:
        """A row's per-tensor statistics: {name: [one number per parameter tensor]}."""
        if not (isinstance(tensors, dict) and 0 < len(tensors) <= TENSOR_SERIES):
            raise Malformed(f"per-tensor statistics that are not a dict of 1 to {TENSOR_SERIES} lists")
        for key, values in tensors.items():
            if not (
                NAME.fullmatch(key)
                and isinstance(values, list)
                and len(values) == self.tensors
                and all(_number(v) for v in values)
            ):
                raise Malformed(f"a per-tensor statistic {key[:70]!r} that is not {self.tensors} numbers")
