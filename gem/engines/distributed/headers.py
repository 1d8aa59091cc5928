"""Rank 0's threads that take the workers' headers (`Headers`): a thread per rank, blocked in a receive from that
rank, hands each header it gets to the server in the order they arrive. Why not gloo's receive from any source:
see `Headers`.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from gem.engines.distributed.messages import HEADER, TAG_ASK, wait

HEADER_WAIT_S = 30 * 24 * 3600.0  # a header thread's receive: a worker may be silent for long (its evaluation, a
# checkpoint's wait), and a receive that times out makes gloo drop the whole group; the server's own wait on the
# queue is what gives up (group.patience), and a dead worker's receive fails at once (its connection closes)


class Headers:
    """(rank 0) Every worker's next header, from a thread per rank blocked in a receive from that rank, in the
    order they arrive (not gloo's receive from any source: once a rank dies with a header sent and not yet received,
    that receive fails at every try, offering the dead rank's notice first, and the whole run would fail for one
    lost worker): `get` returns (rank, header), or (rank, the gloo error) once that rank's connection has failed. A
    thread receives a rank's next header only once the server has acted on its last (`next`), so each worker has
    one header in hand at most; a banned worker's is never received (`drop`)."""

    def __init__(self, pg, ranks: list[int]):
        self.pg, self.arrived = pg, queue.Queue()
        self.arrived_at: dict[int, float] = {}  # when each rank's last header came (time.monotonic)
        self.go_on = {r: threading.Semaphore(0) for r in ranks}
        self.dropped: set[int] = set()
        self.threads = [
            threading.Thread(target=self._receive, args=(r,), name=f"gem-headers-{r}", daemon=True) for r in ranks
        ]
        for t in self.threads:
            t.start()

    def _receive(self, rank: int) -> None:
        while rank not in self.dropped:
            header = torch.zeros(HEADER, dtype=torch.long)
            try:
                wait(self.pg.recv([header], rank, TAG_ASK), HEADER_WAIT_S)
            except RuntimeError as e:
                # its text only: the error's traceback holds the failed receive and, through this frame, the group,
                # in a cycle that the garbage collector frees at some later time; freed that way, in the middle of
                # the next run of the process, they aborted it (SIGABRT, seen in the test suite, 3 times in 3)
                why = str(e)
            else:
                self.arrived_at[rank] = time.monotonic()
                self.arrived.put((rank, header))
                self.go_on[rank].acquire()
                continue
            self.arrived.put((rank, RuntimeError(why)))
            return

    def get(self, timeout_s: float):
        return self.arrived.get(timeout=timeout_s)

    def next(self, rank: int) -> None:
        """The server has acted on `rank`'s header: receive its next one."""
        self.go_on[rank].release()

    def drop(self, rank: int) -> None:
        """Receive nothing more from `rank` (banned, or the run is over)."""
        self.dropped.add(rank)
        self.go_on[rank].release()

    def close(self) -> None:
        """The run is over: a thread whose worker is still to send exits once it has (or its connection closes)."""
        for r in list(self.go_on):
            self.drop(r)

    def join(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) for every thread to end. Why: a thread whose receive ends (its
        worker's connection closes) while the interpreter is being torn down is ended by Python from inside torch's
        wait, where C++ cannot unwind, and the process aborts (`terminate called without an active exception`,
        pytorch/pytorch#38228): rank 0, interrupted, exited with 134 instead of 143 once the workers it had just
        killed closed their connections."""
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
