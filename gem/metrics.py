"""The coordinator's recorder: per-commit rows, evaluation rows and per-tensor rows, written cheaply.

Rows are buffered in memory and flushed as numbered parquet parts (`<name>.parts/part-NNNNNN.parquet`) every
`flush_every` rows or `flush_seconds`, so a crash loses at most one flush interval and whatever was flushed
stays readable. `close()` merges the parts into one `<name>.parquet` file. `read_table()` reads either form.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from gem.files import write_atomic

TABLES = ("metrics", "eval", "tensors")
Sink = Callable[[str, dict], None]  # sink(kind, row): kind is "commit" or "eval"


def scalars(kind: str, row: dict) -> dict[str, float]:
    """What a live view of the run plots against the commit clock t (the row's `step`): every numeric column of a
    row, as `train/<column>` for a commit row and `eval/<column>` for an evaluation row. One naming for every view
    (W&B and TensorBoard show the same tags)."""
    prefix = "train" if kind == "commit" else "eval"
    return {f"{prefix}/{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def fan_out(*sinks: Sink | None) -> Sink | None:
    """One sink that hands each row to every sink given (None: not running), in order: the Recorder feeds one sink
    at one cadence (`sink_every`), so W&B and TensorBoard, both on, get the same rows. None if none is given."""
    live = [s for s in sinks if s is not None]
    if len(live) <= 1:
        return live[0] if live else None

    def sink(kind: str, row: dict) -> None:
        for s in live:
            s(kind, row)

    return sink


class PartWriter:
    """Appends row batches to a parquet dataset of numbered part files, then merges them on close."""

    def __init__(self, run_dir: Path, name: str, resume: bool = False, keep_until: int | None = None):
        self.final = run_dir / f"{name}.parquet"
        self.parts = run_dir / f"{name}.parts"
        self.rows: list[dict] = []
        if not resume:  # a fresh run in a reused directory must not inherit an earlier run's rows
            self.final.unlink(missing_ok=True)
            shutil.rmtree(self.parts, ignore_errors=True)
        elif keep_until is not None:
            self.truncate(keep_until)
        existing = sorted(self.parts.glob("part-*.parquet")) if self.parts.exists() else []
        self.next_part = len(existing)

    def truncate(self, step: int) -> None:
        """Keep only rows with `step` <= step, merged into the final file: a resumed run starts from a
        checkpoint at that step, so rows written after it by the killed attempt would be duplicates."""
        files = ([self.final] if self.final.exists() else []) + (
            sorted(self.parts.glob("part-*.parquet")) if self.parts.exists() else []
        )
        if files:
            table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
            frame = table.to_pandas()
            # a crash between this rewrite and the removal of the parts below would merge them twice
            frame = frame[frame["step"] <= step].drop_duplicates()
            write_parquet(pa.Table.from_pandas(frame, preserve_index=False), self.final)
        shutil.rmtree(self.parts, ignore_errors=True)

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def flush(self) -> None:
        if not self.rows:
            return
        self.parts.mkdir(parents=True, exist_ok=True)
        # through pandas so that every key of every row becomes a column, not only the first row's
        table = pa.Table.from_pandas(pd.DataFrame(self.rows), preserve_index=False)
        write_parquet(table, self.parts / f"part-{self.next_part:06d}.parquet")  # atomic: never a torn part
        self.next_part += 1
        self.rows = []

    def close(self) -> None:
        self.flush()
        if not self.parts.exists():
            return
        files = sorted(self.parts.glob("part-*.parquet"))
        if self.final.exists():  # a resumed run: keep what the earlier attempt merged
            files.insert(0, self.final)
        if files:
            table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="permissive")
            write_parquet(table, self.final)
        shutil.rmtree(self.parts)


def write_parquet(table: pa.Table, path: Path) -> None:
    """Serialised in memory, then written whole (gem.files): a full disk leaves no torn or temporary file."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_atomic(path, memoryview(sink.getvalue()))


def read_table(run_dir: str | os.PathLike, name: str = "metrics") -> pd.DataFrame:
    """One table of a run directory, merged file plus any parts left by a run that did not close."""
    run_dir = Path(run_dir)
    frames = []
    if (run_dir / f"{name}.parquet").exists():
        frames.append(pd.read_parquet(run_dir / f"{name}.parquet"))
    parts = run_dir / f"{name}.parts"
    if parts.exists():
        frames += [pd.read_parquet(f) for f in sorted(parts.glob("part-*.parquet"))]
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True)


class Recorder:
    """Receives rows from an engine (in the coordinating process only) and writes the run directory tables.

    `sink(kind, row)` is an optional extra consumer of rows (the live views, W&B and TensorBoard, through
    `fan_out`): every `sink_every`-th commit row and every evaluation row; `progress` an optional tqdm bar advanced
    once per commit.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        flush_every: int = 1000,
        flush_seconds: float = 30.0,
        sink: Sink | None = None,
        progress=None,
        sink_every: int = 1,
        resume: bool = False,
        resume_step: int | None = None,
    ):
        """`resume_step`: continue a run from its checkpoint at that commit: rows after it are dropped and
        the running totals are rebuilt from the rows kept."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resume = resume or resume_step is not None
        self.writers = {name: PartWriter(self.run_dir, name, resume=resume, keep_until=resume_step) for name in TABLES}
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self.sink, self.sink_every, self.progress = sink, max(1, sink_every), progress
        self.losses: list[float] = []
        self.staleness_sum = 0
        self.commits = 0
        self.last_eval: dict | None = None
        self._pending = 0
        self._last_flush = time.monotonic()
        self._loss_ema: float | None = None
        self.pi_medians: list[float] = []  # GEM's per-commit median π, for the summary
        # commits the server dropped (Ringmaster, Rennala: a `dropped` column); None for an algorithm that drops none
        self.dropped: int | None = None
        self.worker_commits: dict[int, int] = {}  # commits per worker, for the summary's shares
        self.rows_on_disk: int | None = None  # metrics.parquet's rows, once closed
        if resume_step is not None:
            self._restore()

    def commit(self, row: dict, tensors: list[dict] | None = None) -> None:
        self.writers["metrics"].add(row)
        for t in tensors or ():
            self.writers["tensors"].add(t)
        self.commits += 1
        if row.get("lost_row"):  # a commit whose worker died before reporting it: no loss to average
            if self.progress is not None:
                self.progress.update(1)
            return
        loss = float(row["loss"])
        self.losses.append(loss)
        w = int(row["worker"])
        self.worker_commits[w] = self.worker_commits.get(w, 0) + 1
        self.staleness_sum += int(row["staleness"])
        if math.isfinite(loss):
            self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss
        if "pi_median" in row:
            self.pi_medians.append(float(row["pi_median"]))
        if "dropped" in row:
            self.dropped = (self.dropped or 0) + int(row["dropped"])
        if self.sink is not None and self.commits % self.sink_every == 0:
            self.sink("commit", row)
        if self.progress is not None:
            self.progress.update(1)
            if self.commits % 20 == 0 and self._loss_ema is not None:
                post = {"loss": f"{self._loss_ema:.4f}"}
                if self.pi_medians:
                    post["pi"] = f"{self.pi_medians[-1]:.3f}"
                self.progress.set_postfix(post, refresh=False)
        self._pending += 1
        if self._pending >= self.flush_every or time.monotonic() - self._last_flush > self.flush_seconds:
            self.flush()

    def _restore(self) -> None:
        m = read_table(self.run_dir, "metrics")
        if len(m):
            self.commits = len(m)
            if "lost_row" in m:
                m = m[m["lost_row"] != True]  # noqa: E712 - NaN where the column is missing
            self.losses = m["loss"].astype(float).tolist()
            self.staleness_sum = int(m["staleness"].sum())
            self.worker_commits = {int(w): int(c) for w, c in m["worker"].value_counts().items()}
            if "pi_median" in m:
                self.pi_medians = m["pi_median"].dropna().astype(float).tolist()
            if "dropped" in m:
                self.dropped = int(m["dropped"].fillna(0).astype(int).sum())
        ev = read_table(self.run_dir, "eval")
        if len(ev):
            self.last_eval = {k: (v.item() if hasattr(v, "item") else v) for k, v in ev.iloc[-1].items()}
        if self.progress is not None:
            self.progress.update(self.commits)

    def eval(self, row: dict) -> None:
        self.writers["eval"].add(row)
        self.last_eval = row
        if self.sink is not None:
            self.sink("eval", row)
        # evaluation rows are few and precious: write them at once
        self.writers["eval"].flush()

    def flush(self) -> None:
        for w in self.writers.values():
            w.flush()
        self._pending = 0
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        errors = []
        for w in self.writers.values():
            try:
                w.close()
            except Exception as e:  # keep closing the others; the parts stay readable with read_table
                errors.append(f"{w.final.name}: {type(e).__name__}: {e}")
        if errors:
            raise OSError("could not merge " + "; ".join(errors))
        # every recorded commit has its row on disk, or the run must say so (part files removed mid-run)
        final = self.writers["metrics"].final
        self.rows_on_disk = pq.ParquetFile(final).metadata.num_rows if final.exists() else 0

    @property
    def final_train_loss(self) -> float:
        """Mean loss over the last 10% of commits (at least one)."""
        if not self.losses:
            return float("nan")
        k = max(1, len(self.losses) // 10)
        tail = self.losses[-k:]
        return sum(tail) / len(tail)

    @property
    def pi_median(self) -> float | None:
        """GEM: each commit's median π, averaged over commits (the level of a median-π curve, paper Fig. 3).

        Not the median over commits: about half of π is clamped to 0 at a typical commit, so per-commit
        medians jump between 0 and a few tenths, and their median says little. None for other algorithms.
        """
        values = [v for v in self.pi_medians if math.isfinite(v)]
        return sum(values) / len(values) if values else None

    @property
    def commit_shares(self) -> dict[str, float]:
        """Each worker's share of the commits it reported, by worker index (fairness: 1/n each)."""
        total = sum(self.worker_commits.values())
        return {str(w): round(c / total, 4) for w, c in sorted(self.worker_commits.items())} if total else {}

    @property
    def mean_staleness(self) -> float:
        return self.staleness_sum / len(self.losses) if self.losses else float("nan")
