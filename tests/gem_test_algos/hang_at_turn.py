"""DOWNPOUR, except that worker 1 hangs at its 5th commit inside its worker rule, that is while it holds the
server's turn: a hung worker that every other worker waits behind (tests/test_process.py)."""

import time
from dataclasses import replace

from gem.algorithms import downpour

HUNG_WORKER, HUNG_AT = 1, 5
_commits = 0  # this process's commits: each worker of engine=process is a process of its own


def worker_rule(state, x, grad, view, hp):
    global _commits
    _commits += 1
    if view.worker == HUNG_WORKER and _commits == HUNG_AT:
        while True:  # hung for good, holding the turn: only a kill ends it
            time.sleep(1.0)
    return downpour.worker_rule(state, x, grad, view, hp)


ALGORITHM = replace(downpour.ALGORITHM, name="hang_at_turn", worker_rule=worker_rule)
