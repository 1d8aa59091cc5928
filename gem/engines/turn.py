"""The `process` engine's parameter server lock: a turn the workers pass among themselves, first in, first out
(gem.engines.process says how the engine uses it)."""

from __future__ import annotations

import os
import time

import torch

from gem.engines.coordinator import POLL_S

GO, SAVE, STOP, FLUSH = 0, 1, 2, 3  # what a worker woken on its semaphore is asked to do


class Gone(Exception):
    """The coordinator has died, or asked this worker to stop."""


class Turn:
    """The parameter server's lock, handed over first in, first out.

    Participants 0..n−1 are the workers and n is the coordinator (on the distributed engine's local launch, n is
    rank 0's server thread and n + 1 its coordinator, and the server thread asks for checkpoints). `meta` guards
    a ring buffer of waiting participants and the current holder; it is held for a few instructions only. Each
    participant sleeps on its own semaphore, which the releaser posts when the turn is handed to it, or the
    coordinator posts with `action` set to SAVE (write a checkpoint), FLUSH (send your rows) or STOP. A lock held
    by a process that died is taken back by the coordinator (`recover`), so a SIGKILL cannot hang the others. Every
    wait polls: `waiting()` is called about once a second and may raise to give up.
    """

    def __init__(self, ctx, participants: int, device: torch.device):
        self.device = device  # where θ lives (`central_device`): on a GPU, see `release`
        # how long to wait for a killed participant's process to end before its turn is recovered: with θ on a GPU,
        # kernels it queued under the turn may run until its CUDA context is torn down
        self.kill_wait_s = 30.0 if device.type == "cuda" else 2.0
        self.meta = ctx.Lock()
        self.sems = [ctx.Semaphore(0) for _ in range(participants)]
        # [holder, head, count, ring...]: holder −1 when free
        self.state = torch.zeros(3 + participants, dtype=torch.long).share_memory_()
        self.state[0] = -1
        self.action = torch.zeros(participants, dtype=torch.long).share_memory_()
        # the process that holds `meta` (0: none): one frozen inside it stalls whoever next asks for the turn (peek)
        self.meta_pid = ctx.RawValue("q", 0)  # (a shared C integer: written at every take of `meta`, so cheap)
        self.size = participants

    def _take(self, timeout: float) -> bool:
        if not self.meta.acquire(timeout=timeout):
            return False
        self.meta_pid.value = os.getpid()
        return True

    def _give(self) -> None:
        self.meta_pid.value = 0
        self.meta.release()

    def _lock_meta(self, waiting=None) -> None:
        while not self._take(POLL_S):
            if waiting is not None:
                waiting()

    def _line(self) -> list[int]:
        s = self.state
        return [int(s[3 + (int(s[1]) + i) % self.size]) for i in range(int(s[2]))]

    def _enqueue(self, who: int) -> None:
        s = self.state
        s[3 + (int(s[1]) + int(s[2])) % self.size] = who
        s[2] += 1

    def _hand_over(self) -> None:
        """Give the turn to the oldest waiter that is not asked to stop, or free it. Call with meta held. (A
        participant asked to stop is woken to stop, and out of line: given the turn, it would stop holding it.)"""
        s = self.state
        while int(s[2]):
            nxt = int(s[3 + int(s[1])])
            s[1] = (int(s[1]) + 1) % self.size
            s[2] -= 1
            self.sems[nxt].release()
            if int(self.action[nxt]) != STOP:
                self.action[nxt] = GO
                s[0] = nxt
                return
        s[0] = -1

    def acquire(self, who: int, waiting=None, on_request=None, timeout: float | None = None, on_queued=None) -> bool:
        """Wait for the turn. `on_request(action)`: do what the coordinator asks (SAVE, FLUSH) meanwhile.
        With a `timeout`, give up after it, out of line again, and return False. `on_queued()` runs at the
        moment `who` takes its place (under `meta`): what is measured from then is the line's doing alone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._lock_meta(waiting)
        try:
            act = int(self.action[who])
            if act == STOP:
                raise Gone()
            if on_queued is not None:
                on_queued()
            if int(self.state[0]) == -1:
                self.state[0] = who
                return True
            self._enqueue(who)
        finally:
            self._give()
        if act in (SAVE, FLUSH) and on_request is not None:  # asked before we queued: nobody will wake us
            self.answered(who, act, waiting)
            on_request(act)
        while True:
            if not self.sems[who].acquire(timeout=POLL_S):
                if waiting is not None:
                    waiting()
                if deadline is not None and time.monotonic() > deadline:
                    self.leave(who)
                    return False
                continue
            act = int(self.action[who])
            if act == STOP:
                raise Gone()
            if act in (SAVE, FLUSH):
                self.answered(who, act, waiting)  # (not a STOP that came meanwhile: its permit wakes us next)
                if on_request is not None:
                    on_request(act)
                continue
            if self._holder(waiting) == who:
                return True  # GO: the turn is ours
            # a request's permit left over (a hand-over overwrote its action before we woke): not the turn

    def _holder(self, waiting=None) -> int:
        self._lock_meta(waiting)
        try:
            return int(self.state[0])
        finally:
            self._give()

    def release(self, waiting=None) -> None:
        if self.device.type == "cuda":  # what this process queued on θ's GPU is done
            torch.cuda.synchronize(self.device)  # before the next holder, whose stream is not ordered after ours
        self._lock_meta(waiting)
        try:
            self._hand_over()
        finally:
            self._give()

    def ask(self, workers: set[int], action: int, waiting=None) -> None:
        """(coordinator, holding the turn) Ask these workers to SAVE or FLUSH: at once if they wait in line,
        else as soon as they queue."""
        self._lock_meta(waiting)
        try:
            line = set(self._line())
            for w in workers:
                if int(self.action[w]) == STOP:
                    continue  # stopping already: asked nothing more
                self.action[w] = action
                if w in line:
                    self.sems[w].release()
        finally:
            self._give()

    def answered(self, who: int, action: int, waiting=None) -> None:
        """`who` has done what `ask` asked of it (or by another way): ask it no more, unless asked to stop since."""
        self._lock_meta(waiting)
        try:
            if int(self.action[who]) == action:
                self.action[who] = GO
        finally:
            self._give()

    def peek(self, pids: dict[int, int] | None = None) -> tuple[set[int], int | None]:
        """(coordinator) The participants that wait for the turn now through no fault of their own, and the one
        frozen inside `meta`, if any. Those in line, read under `meta` if it can be had soon (it is held for a few
        instructions only), else as the line stands; and where `meta` cannot be had because a participant froze
        inside it (`pids`: participant → its process id; `meta_pid` says who holds `meta`), every other participant
        too: whoever next asks for the turn, answers a request or hands the turn on waits on it."""
        if self._take(POLL_S):
            try:
                return set(self._line()), None
            finally:
                self._give()
        line, holder = set(self._line()), self.meta_pid.value
        if not holder and pids:
            # held and no holder named: one froze between taking meta and writing its pid, or between writing 0
            # and letting go (two instructions; a worker's stop landed there once in CI). The one stopped (kill
            # -STOP, a debugger), if exactly one participant is, and meta is still held (its 0 may only say that
            # meta was let go of since)
            stopped = [pid for pid in pids.values() if _stopped(pid)]
            if len(stopped) == 1:
                if self._take(0):
                    try:
                        return set(self._line()), None
                    finally:
                        self._give()
                holder = stopped[0]
        frozen = next((w for w, pid in (pids or {}).items() if holder and pid == holder), None)
        if frozen is None:
            return line, None
        return set(pids) - {frozen}, frozen  # (frozen there while in line, it is still to blame)

    def stop(self, who: int) -> None:
        if self._take(2.0):
            try:
                self.action[who] = STOP
            finally:
                self._give()
        else:
            self.action[who] = STOP
        self.sems[who].release()

    def leave(self, who: int) -> None:
        """`who` gives up waiting: out of line, or the turn handed on if it came just now (and that hand-over's
        permit dropped)."""
        self.recover(who)
        while self.sems[who].acquire(block=False):
            pass

    def recover(self, gone: int) -> None:
        """(coordinator) Take the turn, and any place in line, back from a participant that died, or from the
        coordinator itself when it gives up waiting."""
        if not self._take(2.0):
            # meta is held for a few instructions only: after 2 s its holder is the process that died
            self._give()
            if not self._take(2.0):
                return
        try:
            s = self.state
            line = self._line()
            if gone in line:
                line.remove(gone)
                s[1], s[2] = 0, 0
                for w in line:
                    self._enqueue(w)
            if int(s[0]) == gone:
                self._hand_over()
        finally:
            self._give()


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, or a debugger's stop), as Linux's /proc says; elsewhere, not known:
    False."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
