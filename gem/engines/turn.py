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
    by a process that died is taken back by the coordinator (`recover`), so a SIGKILL cannot hang the others.

    No wait here lasts longer than POLL_S: each operation has a bounded try (`Ticket.step`, `try_release`,
    `try_ask`, `try_answered`) that returns None when it could not finish. A coordinator loops over them itself and
    looks after its workers between tries (coordinator.Coordinator.wait_on); a worker uses the looping forms
    (`acquire`, `release`, ...), whose `waiting()`, called between tries, only checks that the coordinator is alive.
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
        """(a worker) Wait for the turn, a `Ticket` step at a time. `on_request(action)`: do what the coordinator
        asks (SAVE, FLUSH) meanwhile. `waiting()`, between steps, may raise to give up (the coordinator is gone); it
        must not act on the turn. With a `timeout`, give up after it, out of line again, and return False.
        `on_queued()` runs at the moment `who` takes its place (under `meta`): what is measured from then is the
        line's doing alone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = Ticket(self, who, on_queued)
        while True:
            got = ticket.step()
            if got == GO:
                return True
            if got is not None:  # SAVE or FLUSH, answered: do it, then wait on
                if on_request is not None:
                    on_request(got)
                continue
            if waiting is not None:
                waiting()
            if deadline is not None and time.monotonic() > deadline:
                ticket.cancel()
                return False

    def holder(self, timeout: float = POLL_S) -> int | None:
        """Who holds the turn (−1: nobody); None if `meta` could not be had within `timeout`."""
        if not self._take(timeout):
            return None
        try:
            return int(self.state[0])
        finally:
            self._give()

    def try_release(self, timeout: float = POLL_S) -> bool | None:
        """Hand the turn to the next in line (or free it): True, or None if `meta` could not be had in time."""
        if self.device.type == "cuda":  # what this process queued on θ's GPU is done
            torch.cuda.synchronize(self.device)  # before the next holder, whose stream is not ordered after ours
        if not self._take(timeout):
            return None
        try:
            self._hand_over()
        finally:
            self._give()
        return True

    def release(self, waiting=None) -> None:
        while self.try_release() is None:
            if waiting is not None:
                waiting()

    def try_ask(self, workers: set[int], action: int, timeout: float = POLL_S) -> bool | None:
        """(coordinator, holding the turn) Ask these workers to SAVE or FLUSH: at once if they wait in line,
        else as soon as they queue. True, or None if `meta` could not be had in time (nobody was asked)."""
        if not self._take(timeout):
            return None
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
        return True

    def ask(self, workers: set[int], action: int, waiting=None) -> None:
        while self.try_ask(workers, action) is None:
            if waiting is not None:
                waiting()

    def try_answered(self, who: int, action: int, timeout: float = POLL_S) -> bool | None:
        """`who` has done what `ask` asked of it (or by another way): ask it no more, unless asked to stop since.
        True, or None if `meta` could not be had in time."""
        if not self._take(timeout):
            return None
        try:
            if int(self.action[who]) == action:
                self.action[who] = GO
        finally:
            self._give()
        return True

    def answered(self, who: int, action: int, waiting=None) -> None:
        while self.try_answered(who, action) is None:
            if waiting is not None:
                waiting()

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


class Ticket:
    """One participant's way to the turn, one bounded step at a time (`step`), with nothing of the turn held or
    half done between two steps. A coordinator waits with it in a loop of its own (coordinator.Coordinator
    .wait_on), looking after its workers between steps: it may lose one then, and take back its turn (`recover`),
    never from inside a wait of the turn's. A worker waits with `Turn.acquire`, built on it."""

    def __init__(self, turn: Turn, who: int, on_queued=None):
        self.turn, self.who, self.on_queued = turn, who, on_queued
        self.queued = False  # `who` has its place in line
        self.asked: int | None = None  # a SAVE or FLUSH found but not yet answered (`meta` was busy)
        self.woken = False  # woken, and whether the turn is ours not yet known (`meta` was busy)

    def step(self, timeout: float = POLL_S) -> int | None:
        """Take a place in line, or wait in it for up to `timeout`. GO: the turn is ours. SAVE or FLUSH: the
        coordinator asks for it, and the request is answered (do it, then step again). None: not yet. Raises Gone
        when `who` is asked to stop."""
        turn, who = self.turn, self.who
        if not self.queued:
            if not turn._take(timeout):
                return None
            try:
                act = int(turn.action[who])
                if act == STOP:
                    raise Gone()
                if self.on_queued is not None:
                    self.on_queued()
                if int(turn.state[0]) == -1:
                    turn.state[0] = who
                    return GO
                turn._enqueue(who)
                self.queued = True
            finally:
                turn._give()
            if act in (SAVE, FLUSH):  # asked before we queued: nobody will wake us for it
                self.asked = act
        elif self.asked is None and not self.woken:
            if not turn.sems[who].acquire(timeout=timeout):
                return None
            act = int(turn.action[who])
            if act == STOP:
                raise Gone()
            if act in (SAVE, FLUSH):  # (not a STOP that came meanwhile: its permit wakes us next)
                self.asked = act
            else:
                self.woken = True
        if self.asked is not None:
            if turn.try_answered(who, self.asked) is None:
                return None
            act, self.asked = self.asked, None
            return act
        if not self.woken:
            return None
        holder = turn.holder()
        if holder is None:
            return None
        self.woken = False
        if holder == who:
            self.queued = False
            return GO
        return None  # a request's permit left over (a hand-over overwrote its action before we woke): not the turn

    def cancel(self) -> None:
        """Give up waiting: out of line, or the turn handed on if it came just now."""
        if self.queued:
            self.turn.leave(self.who)
            self.queued = False
