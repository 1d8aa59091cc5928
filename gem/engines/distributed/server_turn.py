"""Rank 0's server for a local launch's workers in shared memory (`TurnServer`). The workers take no exchange: they
pass the server's turn among themselves (turn.Turn) and commit to θ in rank 0's window (window.py), as on engine
=process, and send only rows (ROWS), a checkpoint's state and a barrier's PULL over the wire.

This thread is one participant in the turn's line (`me`; the coordinator is `me + 1`). It holds the turn from the
start until every worker is ready (all start from one θ), takes it for a checkpoint (the workers are asked SAVE
through the turn, and send their state while they wait in line) and to read θ for a barrier's pull, and reads who
made each commit from the window's log (`read_log`). Stopping the run stops the workers' turns; each sends its
last rows with one ASK, answered STOP.
"""

from __future__ import annotations

import threading

import torch

from gem.engines.distributed.messages import STOP
from gem.engines.distributed.server import ParameterServer, Standing, StepsLost, all_started
from gem.engines.distributed.window import LOG_WORKERS
from gem.engines.turn import SAVE as TURN_SAVE
from gem.engines.turn import Turn


class TurnServer(ParameterServer):
    """The workers pass the turn among themselves; this thread reads their commits from the window's log."""

    def __init__(self, *args, turn: Turn, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn, self.me = turn, len(self.ranks)
        self.holding = True  # from the start until every worker is ready
        self.logged = self.server.t  # the clock up to which the commit log has been read

    def step(self, started: bool) -> bool:
        if self.holding and started and self.saving is None:  # the race begins: all start from one θ
            self.release_turn()
        if self.saving is not None and not self.holding:
            self.take_turn_for_checkpoint()
            return True
        return False

    def stop(self, why: str) -> None:
        super().stop(why)
        for r, peer in self.peers.items():  # a worker stopped in line sends its rows with one last ASK
            if peer.expected:
                self.turn.stop(r - 1)

    def read_log(self) -> None:
        """The commits the workers made since the last look, from the window's log: pending until their rows come
        (whose times are the coordinator's progress)."""
        t, log = self.server.t, self.window.log
        if t - self.logged > log.numel():
            raise RuntimeError(
                f"{t - self.logged} commits since rank 0 last read the commit log, which holds {log.numel()}"
            )
        if t <= self.logged:
            return
        lost = []
        for i, entry in zip(
            range(self.logged, t), log[torch.arange(self.logged, t) % log.numel()].tolist(), strict=True
        ):
            if entry // LOG_WORKERS != i:  # not yet visible here: read it at the next look (its rows come after it)
                t = i
                break
            peer = self.peers.get(entry % LOG_WORKERS + 1)
            pending = peer.pending if peer is not None else None
            if pending is not None:
                pending.append(i + 1)
            else:  # lost: its row will never come
                lost.append(i + 1)
        self.logged = t
        if lost:
            self.events.put(StepsLost(lost))

    def claims(self, src: int, extra: bytes) -> str | None:
        if extra != b"1":
            return f"a READY header followed by {extra!r}, where every worker takes its turn in shared memory (b'1')"
        self.peers[src].maps_window = True
        return None

    def on_ask(self, src: int) -> None:
        """Only a worker stopped in line asks, with its last rows: STOP. Any other ASK breaks the protocol."""
        if self.stopping or self.peers[src].standing is Standing.LOST:
            self.done_with(src)
            self.reply(src, STOP)
        else:
            self.ban(src, "an ASK, where every worker takes its turn in shared memory")

    def pull(self, src: int) -> None:
        """θ as of the clock, read under the turn; sent once the turn is handed on."""
        held = self.holding
        if not held:
            self.take_turn()
        try:
            with self.lock:
                view = self.server.pull(src - 1)
            # copies on the host, where gloo sends from (θ may be on the workers' GPU: launch.py)
            theta = self.server.theta.to("cpu", copy=True)
            state = {k: v.to("cpu", copy=True) for k, v in self.server.state.items()}
        finally:
            if not held:
                self.release_turn()
        self.send_pulled(src, view, theta, state)

    def on_saved(self, src: int, state: dict) -> None:
        super().on_saved(src, state)
        self.turn.answered(src - 1, TURN_SAVE)  # saved at a barrier (`hold`): the turn's request is answered too

    def checkpoint_written(self) -> None:
        if self.holding and all_started(self.peers):
            self.release_turn()

    def ended(self) -> None:
        if self.holding:  # (failed) the coordinator may wait for the turn
            self.release_turn()

    # --- the turn

    def take_turn(self) -> None:
        """Wait in line for the turn (a frozen holder is lost, killed and its turn handed on by the coordinator)."""
        if not self.turn.acquire(self.me, self._turn_waiting, timeout=self.wait_s):
            raise RuntimeError(f"the server's turn did not come within {self.wait_s:.0f} s")
        self.holding = True

    def _turn_waiting(self) -> None:
        if not threading.main_thread().is_alive():
            raise RuntimeError("rank 0's main thread has ended")

    def release_turn(self) -> None:
        self.holding = False
        self.turn.release()

    def take_turn_for_checkpoint(self) -> None:
        """Hold the turn, so that θ stays as saved, and ask every live worker for its state: one in line sends it
        at once, one computing when it next asks for the turn (link's TurnLink)."""
        self.take_turn()
        live = self.expected_ranks()
        self.saving["told"] |= live
        self.turn.ask({r - 1 for r in live}, TURN_SAVE)
