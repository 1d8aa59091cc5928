"""A run directory's owner and its state, checked before anything in it is written.

One run owns a directory: `claim()` takes an exclusive `flock` on the directory itself, held by this process until
it exits. The kernel drops the lock on any exit, SIGKILL included, so a killed run never leaves a stale lock,
and no lock file is left behind either. Spawned workers do not inherit it (Python opens descriptors
non-inheritable), so a run whose main process died can be resumed at once.

A sweep's command holds its folder the same way (experiments.command), so that two commands never share a sweep.

A directory that already holds a run's results is never written over: `python run.py hydra.run.dir=<it>` is
refused, `resume=true` continues it.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from experiments.config import Spec
from gem import algorithms
from gem.engines.checkpoint import CHECKPOINT, CheckpointError, check_resumable, read_manifest, verify
from gem.files import write_atomic

# what a run writes: a directory holding any of these holds a run
RESULTS = ("summary.json", "metrics.parquet", "metrics.parts", "eval.parquet", "eval.parts", "checkpoint")

_held: dict[str, tuple[int, bool]] = {}  # directory (real path) -> (descriptor holding its flock, made by us)


class Refused(ValueError):
    """One line for the user; raised before anything in the run directory is created or changed."""


IN_USE = (
    "is in use by another run that is still going (it holds the directory's lock); wait for it to end, or pick "
    "another directory"
)


def claim(run_dir: Path, key: str = "hydra.run.dir", in_use: str = IN_USE) -> None:
    """Make `run_dir` (if needed) and hold its lock for the life of this process. Refused (`<key>=<run_dir>
    <in_use>`) if another process holds it, or if it cannot be made or written."""
    run_dir = Path(run_dir)
    if holds(run_dir):
        return
    for _ in range(10):
        try:
            created = _make(run_dir)
            fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise Refused(f"{key}={run_dir} cannot be used as a run directory: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            # held by another process, whose directory it is now (even if this one made it): left as it is
            os.close(fd)
            raise Refused(f"{key}={run_dir} {in_use}") from None
        if _same(fd, run_dir):
            break
        # a command refused after it made the directory removed it between our open and our lock: make it again
        os.close(fd)
    else:
        raise Refused(f"{key}={run_dir} cannot be used as a run directory: it keeps being removed")
    _held[os.path.realpath(run_dir)] = (fd, created)
    if not os.access(run_dir, os.W_OK | os.X_OK):
        unclaim(run_dir)
        raise Refused(f"{key}={run_dir} is not writable by this user")


def _make(d: Path) -> bool:
    """Make `d` (and its parents); True if this call made `d` itself. Two commands racing to make it cannot both
    be told they did (mkdir is atomic), so only the one that made it ever removes it."""
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        d.mkdir()
        return True
    except FileExistsError:
        return False


def _same(fd: int, d: Path) -> bool:
    """The descriptor `fd` is the directory at `d` still (not one removed, or replaced, since it was opened)."""
    try:
        a, b = os.fstat(fd), os.stat(d)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holds(run_dir: Path) -> bool:
    return os.path.realpath(run_dir) in _held


def in_use(run_dir: Path) -> bool:
    """Another process holds `run_dir`'s lock (checked without keeping it)."""
    if holds(run_dir) or not Path(run_dir).is_dir():
        return False
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # and with it the lock, if it was ours


def unclaim(run_dir: Path) -> None:
    """Let go of `run_dir` (a command refused after `claim`), and remove it if this command made it."""
    fd, created = _held.pop(os.path.realpath(run_dir), (None, False))
    if created:
        try:
            Path(run_dir).rmdir()  # only if still empty; while the lock is held, so no one else takes it first
        except OSError:
            pass
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the lock


def status(run_dir: Path) -> str | None:
    """The status in `run_dir`'s summary.json; 'incomplete' for results without a summary (a killed run; the
    word analysis.load uses too); None if it holds no run."""
    run_dir = Path(run_dir)
    if not any((run_dir / name).exists() for name in RESULTS):
        return None
    try:
        return str(json.loads((run_dir / "summary.json").read_text()).get("status", "incomplete"))
    except (OSError, ValueError):
        return "incomplete"


def _reason(run_dir: Path) -> str:
    """The reason in `run_dir`'s summary.json, in a few words for a refusal."""
    try:
        reason = str(json.loads((Path(run_dir) / "summary.json").read_text()).get("reason") or "")
    except (OSError, ValueError, AttributeError):
        reason = ""
    return reason or "no reason recorded"


def check_fresh(run_dir: Path, key: str = "hydra.run.dir") -> None:
    """A new run (resume=false) must not write over another run's results."""
    st = status(run_dir)
    if st is None:
        return
    if st == "completed":
        raise Refused(
            f"{key}={run_dir} already holds a completed run; pick a new directory (results are never overwritten)"
        )
    if st == "diverged":  # a result too: resume=true is refused for it (check_run_dir)
        raise Refused(
            f"{key}={run_dir} already holds a run that diverged ({_reason(run_dir)}), a result as a completed "
            "run is; pick a new directory for a new run (results are never overwritten)"
        )
    from gem.engines import checkpoint as ckpt

    if not (run_dir / ckpt.CHECKPOINT / "manifest.json").exists():  # resume=true would be refused too
        raise Refused(
            f"{key}={run_dir} already holds a run (status {st}) that stopped before its first checkpoint, so "
            "resume=true cannot continue it; pick a new directory for a new run (results are never overwritten)"
        )
    raise Refused(
        f"{key}={run_dir} already holds a run (status {st}); resume=true continues it from its last "
        "checkpoint, or pick a new directory (results are never overwritten)"
    )


def check_run_dir(spec: Spec, run_dir: Path, key: str = "hydra.run.dir") -> dict | None:
    """Take `run_dir` for this command (its lock, held until this process exits) and check that the command
    can run there: a new run only where no results are, a resume only from a whole checkpoint of the same
    configuration, every file of it read. Returns the checkpoint's manifest (resume) or None. Refused, with the
    directory as it was, otherwise."""
    run_dir = Path(run_dir)
    _check_exists(spec, run_dir, key)  # before claim(), which would create it
    claim(run_dir, key)
    try:
        return _check_contents(spec, run_dir, key)
    except (CheckpointError, Refused) as e:
        unclaim(run_dir)
        raise Refused(str(e)) from None


def check_planned(spec: Spec, run_dir: Path, key: str = "hydra.run.dir") -> None:
    """plan=true: what `check_run_dir` would refuse in `run_dir`, checked without taking it or making it (a plan
    makes no directory), so that a plan does not list a run its command would refuse."""
    run_dir = Path(run_dir)
    _check_exists(spec, run_dir, key)
    if not run_dir.is_dir():
        return
    if in_use(run_dir):
        raise Refused(
            f"{key}={run_dir} is in use by another run that is still going (it holds the directory's lock); wait "
            "for it to end, or pick another directory"
        )
    try:
        _check_contents(spec, run_dir, key)
    except CheckpointError as e:
        raise Refused(str(e)) from None


def _check_exists(spec: Spec, run_dir: Path, key: str) -> None:
    if spec.cfg.resume and not run_dir.is_dir():
        raise Refused(
            f"resume=true: {key}={run_dir} does not exist; resume needs {key}=<the directory of the run to continue>"
        )


def _check_contents(spec: Spec, run_dir: Path, key: str) -> dict | None:
    """What `run_dir` holds, against the command: a new run only where no results are, a resume only from a whole
    checkpoint of the same configuration, every file of it read. Returns the checkpoint's manifest (resume)."""
    if not spec.cfg.resume:
        check_fresh(run_dir, key)
        return None
    st = status(run_dir)
    if st == "completed":
        raise Refused(f"resume=true: the run in {run_dir} has already completed; nothing to resume")
    if st == "diverged":  # resuming would take the same commits toward the same non-finite θ
        raise Refused(
            f"resume=true: the run in {run_dir} diverged ({_reason(run_dir)}), a result as a completed run "
            f"is; nothing to resume: start a new run (a smaller lr, say) in a new {key}"
        )
    if st is None:
        raise Refused(
            f"resume=true: {key}={run_dir} holds no run to continue (no summary.json, rows or checkpoint); "
            f"resume needs {key}=<the directory of the run to continue>"
        )
    if not (run_dir / CHECKPOINT / "manifest.json").exists():  # a whole checkpoint is named there
        raise Refused(
            f"resume=true: the run in {run_dir} (status {st}) stopped before its first checkpoint "
            f"(engine.checkpoint_every), so it cannot be continued; run the command without resume=true in a "
            f"new {key}"
        )
    manifest = read_manifest(run_dir)
    identity = _identity(spec)
    check_resumable(manifest, identity)
    verify(manifest, identity.workers, algorithms.get(spec.algorithm), spec.hp)
    return manifest


def _identity(spec: Spec):
    """What a checkpoint's fingerprint is compared with, from the spec alone (no data loaded)."""
    from types import SimpleNamespace

    from experiments.instantiate import display_name

    cfg = spec.cfg
    return SimpleNamespace(
        algorithm=spec.algorithm,
        model=display_name("model", cfg.model),
        loss=spec.loss,
        precision=cfg.precision,
        workers=spec.workers,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        seed=cfg.seed,
        device=cfg.device,
        data=SimpleNamespace(name=spec.data.name),
        hp=spec.hp,
        engine=spec.engine,
    )


def write_hydra(run_dir: Path, cfg, hydra=None) -> None:
    """Hydra's `.hydra/` (config.yaml, hydra.yaml, overrides.yaml), written by the runner once every check has
    passed: conf/config.yaml sets `hydra.output_subdir: null`, so that a refused command never replaces the
    `.hydra/` of the run it was refused for. `hydra`: Hydra's own config of this job (`{"hydra": ...}`); without
    it (a run started from Python, not by Hydra) nothing is written."""
    from omegaconf import OmegaConf, open_dict

    if hydra is None:
        return
    hydra = OmegaConf.create(OmegaConf.to_container(hydra, resolve=False))
    with open_dict(hydra):
        hydra.hydra.output_subdir = ".hydra"  # where it is, as Hydra itself would have recorded it
    folder = Path(run_dir) / ".hydra"
    folder.mkdir(exist_ok=True)
    write_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    write_atomic(folder / "hydra.yaml", OmegaConf.to_yaml(hydra))
    write_atomic(folder / "overrides.yaml", OmegaConf.to_yaml(hydra.hydra.overrides.task))


def remove_temporary(run_dir: Path) -> None:
    """After a failed write: no `*.tmp` file and no half-written checkpoint is left behind."""
    import shutil

    run_dir = Path(run_dir)
    for tmp in run_dir.rglob("*.tmp"):
        try:
            tmp.unlink()
        except OSError:
            pass
    shutil.rmtree(run_dir / "checkpoint" / "pending", ignore_errors=True)


# ------------------------------------------------------------------------------------ a sweep's resume

# A run whose summary says one of these is a result: `resume=true` on its sweep leaves it as it is. A diverged
# run is a result too (rerunning it would diverge again: the sim engine is deterministic for a seed).
FINAL = ("completed", "diverged")
# keys a resumed sweep may change: what it is asked to do, and how it logs (W&B, parquet batching, progress bars,
# evaluation cadence do not change a run's commits; analysis.load leaves `logger.*` out of a run's settings too)
NOT_IDENTITY = ("resume", "plan", "logger")


def config_difference(cfg, run_dir: Path) -> str | None:
    """None when the run in `run_dir` was launched with the same config as `cfg` (both unresolved, as Hydra
    composes and the runner saves them; NOT_IDENTITY aside); else what differs, as `key: <theirs> there, <ours>
    in this command` (a group chosen differently once, top-level keys first, at most three). A run without its
    `.hydra/config.yaml` cannot be compared."""
    from omegaconf import OmegaConf

    saved = Path(run_dir) / ".hydra" / "config.yaml"
    if not saved.exists():
        return f"{saved} is missing"
    try:
        theirs = _flat(OmegaConf.to_container(OmegaConf.load(saved), resolve=False))
    except Exception as e:  # a damaged file: not this command's run
        return f"{saved} is unreadable ({type(e).__name__})"
    ours = _flat(OmegaConf.to_container(cfg, resolve=False))
    differ = [
        k
        for k in sorted(set(theirs) | set(ours))
        if k.split(".")[0] not in NOT_IDENTITY and theirs.get(k, "<absent>") != ours.get(k, "<absent>")
    ]
    if not differ:
        return None
    # a group chosen differently (algorithm=gem there, downpour here) is one difference, not each of its keys
    # (which used to name algorithm.eps first, alphabetically); the top-level keys come first
    renamed = {k.rsplit(".", 1)[0] for k in differ if k.endswith((".name", "._target_")) and k.count(".") == 1}
    shown = [k for k in differ if k.split(".")[0] not in renamed or k.endswith((".name", "._target_"))]
    shown.sort(key=lambda k: (k.count(".") > 0 and not k.endswith(".name"), k))
    parts = [
        f"{k.removesuffix('.name')}: {_shown(theirs.get(k, '<absent>'))} there, "
        f"{_shown(ours.get(k, '<absent>'))} in this command"
        for k in shown[:3]
    ]
    more = f"; and {len(shown) - 3} more" if len(shown) > 3 else ""
    return "; ".join(parts) + more


def _shown(v):
    """A value as the command line writes it: epochs=1, not 1.0."""
    return f"{v:g}" if isinstance(v, float) else v


def sweep_action(spec: Spec, job_dir: Path, num: int) -> tuple[str, str]:
    """What `resume=true` does with one job of a sweep, checked without taking the directory:

    - `new`: nothing there yet; the job starts;
    - `skip`: its summary says completed (or diverged); nothing of it is touched;
    - `resume`: it holds a whole checkpoint of this very config; it continues from there;
    - `rerun`: it holds a run that stopped before its first checkpoint (or whose checkpoint cannot be read);
      its files move to `<sweep>/.superseded/` (kept, and out of every analysis) and the job starts afresh.

    Returns (action, a few words on why). Refused when the directory is in use, or holds a run of another
    config (not the identical command)."""
    job_dir = Path(job_dir)
    where = f"job {num} ({job_dir})"
    if in_use(job_dir):
        raise Refused(f"resume=true: {where} is in use by a run that is still going; wait for it to end")
    st = status(job_dir)
    if st is None:
        return "new", "not started"
    diff = config_difference(spec.cfg, job_dir)
    if diff is not None:
        raise Refused(
            f"resume=true: {where} holds a run of another configuration ({diff}); resume a sweep with "
            "the identical -m command, or pick a new hydra.sweep.dir"
        )
    if st in FINAL:
        return "skip", st
    try:
        manifest = read_manifest(job_dir)
        identity = _identity(spec)
        check_resumable(manifest, identity)
        verify(manifest, identity.workers, algorithms.get(spec.algorithm), spec.hp)
    except CheckpointError as e:
        why = "no checkpoint" if "no checkpoint" in str(e) else str(e).removeprefix("resume=true: ")
        return "rerun", f"{st}, {why}"
    return "resume", f"{st}, checkpoint at commit {manifest['step']}"


def supersede(job_dir: Path) -> Path:
    """Move a job's files out of the way of its rerun, into `<sweep>/.superseded/<job>-<UTC time>/` (the job's
    directory itself stays, empty, for the rerun). Returns where they went."""
    import shutil
    from datetime import datetime, timezone

    job_dir = Path(job_dir)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest = job_dir.parent / ".superseded" / f"{job_dir.name}-{stamp}"
    dest.mkdir(parents=True)
    for item in list(job_dir.iterdir()):
        shutil.move(str(item), dest / item.name)
    return dest


def _flat(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out or {prefix.rstrip("."): {}}
