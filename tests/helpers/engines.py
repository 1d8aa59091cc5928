"""A small job run on an engine, as tests/test_engines.py runs them (its contract, on the three engines), and
the faults a recorder plays: a coordinator killed (`Killed`), a worker stopped or signalled (`StoppingRecorder`)."""

import dataclasses
import multiprocessing
import os
import signal
import time

from gem import algorithms
from gem.engines import Job, get
from gem.metrics import Recorder, read_table


def hp_for(name, n, **kw):
    params = algorithms.get(name).Params
    fields = {f.name for f in dataclasses.fields(params)}
    return params(**{**({"workers": n} if "workers" in fields else {}), **kw})


def job(data, engine, workers, algorithm="gem", hp=None, epochs=1, batch_size=32, options=None, **kw):
    return Job(
        algorithm=algorithm,
        hp=hp or hp_for(algorithm, workers),
        model="mnist_cnn",
        data=data,
        workers=workers,
        batch_size=batch_size,
        epochs=epochs,
        seed=0,
        engine={"name": engine, "timeout_s": 60, **(options or {})},
        eval_every=kw.pop("eval_every", 16),
        eval_train_size=64,
        **kw,
    )


def run(job_, d):
    rec = Recorder(d)
    try:
        result = get(job_.engine.name).run(job_, rec)
    finally:
        rec.close()
    return result, read_table(d)


class Killed(Exception):
    """A run's process killed there: raised from a recorder, or from what the run calls (checkpoint.finish)."""


class StoppingRecorder(Recorder):
    """SIGSTOPs worker `victim`'s process once `after` of its commits are recorded: alive, frozen, silent (or
    sends it another signal: `sig`)."""

    def __init__(self, d, victim, after, sig=signal.SIGSTOP):
        super().__init__(d)
        self.victim, self.after, self.seen, self.stopped_at, self.sig = victim, after, 0, None, sig

    def commit(self, row, tensors=None):
        super().commit(row, tensors)
        if row["worker"] == self.victim and self.stopped_at is None:
            self.seen += 1
            if self.seen >= self.after:
                pid = next(p.pid for p in multiprocessing.active_children() if p.name == f"gem-worker-{self.victim}")
                os.kill(pid, self.sig)
                self.stopped_at = time.monotonic()
