"""TensorBoard event files, from the coordinating process only (`logger.tensorboard=true`): a live view of a run that
needs no account and no upload, beside W&B or instead of it.

Written to `<run_dir>/tensorboard/` as rows arrive: the rows the Recorder hands its sink (every
`logger.wandb.log_every`-th commit row and every evaluation row, the same rows W&B gets, through
gem.metrics.fan_out), every numeric column as `train/<column>` or `eval/<column>` (gem.metrics.scalars: the tags
W&B shows) at the commit clock t; at the end the summary's numbers as `summary/<key>` at the last t.
`tensorboard --logdir <run_dir>` shows a run; `--logdir <sweep dir>` every job of a sweep side by side, each under
its job number. Events are flushed every `logger.flush_seconds` (a killed run loses at most that, like its parquet
rows) and on close, which the runner does in a `finally`. Like W&B, it never fails a run: a writer that fails says
so once and stops. A resumed run adds an event file to the same folder, opened by a restart mark at the commit
after its checkpoint: TensorBoard then drops the first attempt's points from there on, as the run directory drops
its rows, so no commit shows twice.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gem.metrics import scalars

FOLDER = "tensorboard"  # in the run directory


class TensorBoardLogger:
    def __init__(self, writer, log_dir: Path):
        self.writer, self.log_dir = writer, log_dir

    def __call__(self, kind: str, row: dict) -> None:
        if self.writer is None:
            return
        try:
            for tag, value in scalars(kind, row).items():
                self.writer.add_scalar(tag, value, global_step=int(row["step"]))
        except Exception as e:  # a full disk, say: logging must never take a run down
            self._fail(e)

    def finish(self, summary: dict | None = None) -> None:
        """The summary's numbers at the last commit, then everything flushed and the files closed; a failure here is
        reported, never raised."""
        if self.writer is None:
            return
        try:
            step = int((summary or {}).get("steps") or 0)
            for key, value in (summary or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"summary/{key}", value, global_step=step)
            self.writer.flush()
        except Exception as e:
            self._fail(e)
        finally:
            self._close()

    def _fail(self, e: Exception) -> None:
        print(f"gem: TensorBoard stopped logging ({type(e).__name__}: {e}); the run goes on", file=sys.stderr)
        self._close()

    def _close(self) -> None:
        writer, self.writer = self.writer, None
        try:
            if writer is not None:
                writer.close()
        except Exception:  # already reported, or nothing more can be written
            pass


def start(run_dir: Path, flush_seconds: float, resume_step: int | None = None) -> TensorBoardLogger | None:
    """The writer of `<run_dir>/tensorboard/`, or None (said in one line) when it cannot start. That the package
    is installed was checked with the config (experiments.config). `resume_step`: the checkpoint's commit a resumed
    run continues from."""
    log_dir = Path(run_dir) / FOLDER
    try:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step, for a resumed run: TensorBoard drops the points the killed run logged at this t and after
        # (rows after the checkpoint, which the resumed run logs again)
        writer = SummaryWriter(
            log_dir=str(log_dir), flush_secs=flush_seconds, purge_step=None if resume_step is None else resume_step + 1
        )
    except Exception as e:
        print(f"gem: TensorBoard could not start ({type(e).__name__}: {e}); continuing without it", file=sys.stderr)
        return None
    print(f"gem: TensorBoard: tensorboard --logdir {log_dir}")
    return TensorBoardLogger(writer, log_dir)
