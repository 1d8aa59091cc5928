"""Weights & Biases, from the coordinating process only. Offline by default; it never hangs or fails a run.

- `offline`: the run is written under `<run_dir>/wandb/`; `wandb sync <run_dir>/wandb/offline-run-*` uploads it.
- `online`: only when an API key is configured (WANDB_API_KEY or ~/.netrc); otherwise it falls back to
  offline and says so. A failed `wandb.init` (no network, say) is reported and the run goes on without W&B.
- `disabled`: nothing is imported or written.
"""

from __future__ import annotations

import netrc
import os
import sys
from pathlib import Path


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger:
    def __init__(self, run):
        self.run = run

    @property
    def where(self) -> str:
        url = getattr(self.run, "url", None)
        return url or str(Path(self.run.dir).parent)

    def __call__(self, kind: str, row: dict) -> None:
        prefix = "train" if kind == "commit" else "eval"
        data = {f"{prefix}/{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        try:
            self.run.log(data, step=int(row["step"]))
        except Exception:  # logging must never take a run down
            pass

    def finish(self, summary: dict | None = None, exit_code: int = 0) -> None:
        try:
            if summary:
                self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        finally:
            self.run.finish(exit_code=exit_code)


def start(mode: str, run_dir: Path, config: dict, project: str = "gem", entity=None, group=None,
          name: str | None = None) -> WandbLogger | None:
    if mode == "disabled":
        return None
    if mode == "online" and not _has_api_key():
        print("gem: logger.wandb.mode=online but no W&B API key is set (WANDB_API_KEY or ~/.netrc); "
              "logging offline instead", file=sys.stderr)
        mode = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        run = wandb.init(project=project, entity=entity, group=group, name=name, dir=str(run_dir), mode=mode,
                         config=config, reinit="create_new",
                         settings=wandb.Settings(init_timeout=90, console="off", x_disable_stats=True))
    except Exception as e:  # no network, bad key, W&B service failure: the run goes on without W&B
        print(f"gem: W&B could not start ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
              "continuing without it", file=sys.stderr)
        return None
    return WandbLogger(run)
