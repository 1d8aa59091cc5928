"""Weights & Biases, from the coordinating process only. Offline by default; it never hangs or fails a run.

- `offline`: the run is written under `<run_dir>/wandb/`; `wandb sync <run_dir>/wandb/offline-run-*` uploads it.
- `online`: only when an API key is configured (WANDB_API_KEY or ~/.netrc); otherwise it logs offline and
  says so. An online `wandb.init` that fails (no network: it gives up after 20 s) falls back to offline too,
  and later runs of the same sweep go offline at once. If even offline fails, the run goes on without W&B.
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
        self.last_step = -1
        # W&B drops a row whose step is below one already logged. On the process engine an evaluation is stamped
        # with the live clock, which can run ahead of the commit rows still on their way; such an evaluation waits
        # here until the commits before it are logged.
        self.waiting: list[dict] = []

    @property
    def where(self) -> str:
        url = getattr(self.run, "url", None)
        return url or str(Path(self.run.dir).parent)

    def __call__(self, kind: str, row: dict) -> None:
        step = int(row["step"])
        if kind != "commit" and step > self.last_step:
            self.waiting.append(row)
            return
        while self.waiting and int(self.waiting[0]["step"]) <= step:
            self._log("eval", self.waiting.pop(0))
        self._log(kind, row)

    def _log(self, kind: str, row: dict) -> None:
        prefix = "train" if kind == "commit" else "eval"
        data = {f"{prefix}/{k}": v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        step = max(int(row["step"]), self.last_step)
        try:
            self.run.log(data, step=step)
            self.last_step = step
        except Exception:  # logging must never take a run down
            pass

    def finish(self, summary: dict | None = None, exit_code: int = 0) -> None:
        """Record the summary and close the run; a W&B failure here is reported, never raised."""
        for row in self.waiting:  # evaluations ahead of the last commit row logged (the final one, say)
            self._log("eval", row)
        self.waiting = []
        try:
            if summary:
                self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        except Exception as e:
            print(f"gem: W&B summary not recorded ({type(e).__name__}: {e})", file=sys.stderr)
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:
            print(f"gem: W&B finish failed ({type(e).__name__}: {e})", file=sys.stderr)


# Why W&B cannot be used as asked in this process, once that is known: later runs of a sweep then fall back at
# once instead of each paying the init timeout again.
_online_failed: str | None = None  # online init failed (no network, say): log offline from now on
_unavailable: str | None = None  # even offline init failed: no W&B in this process


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def start(mode: str, run_dir: Path, config: dict, project: str = "gem", entity=None, group=None,
          name: str | None = None) -> WandbLogger | None:
    global _online_failed, _unavailable
    if mode == "disabled":
        return None
    if _unavailable is not None:
        print(f"gem: W&B is unavailable in this process ({_unavailable}); continuing without it", file=sys.stderr)
        return None
    if mode == "online" and not _has_api_key():
        print("gem: logger.wandb.mode=online but no W&B API key is set (WANDB_API_KEY or ~/.netrc); "
              "logging offline instead", file=sys.stderr)
        mode = "offline"
    if mode == "online" and _online_failed is not None:
        print(f"gem: W&B online failed earlier in this process ({_online_failed}); logging offline instead",
              file=sys.stderr)
        mode = "offline"
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        run = wandb.init(project=project, entity=entity, group=group, name=name, dir=str(run_dir), mode=mode,
                         config=config, reinit="create_new",
                         settings=wandb.Settings(init_timeout=20, console="off", x_disable_stats=True))
    except Exception as e:  # no network, bad key, W&B service failure: the run goes on regardless
        if mode == "online":
            _online_failed = _short(e)
            print(f"gem: W&B online could not start ({_online_failed}); logging offline instead", file=sys.stderr)
            return start("offline", run_dir, config, project, entity, group, name)
        _unavailable = _short(e)
        print(f"gem: W&B could not start ({_unavailable}); continuing without it", file=sys.stderr)
        return None
    return WandbLogger(run)
