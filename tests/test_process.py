"""What is particular to the `process` engine: the FIFO turn the workers pass among themselves, and its worker
processes' heap. The contract every engine keeps (every commit once, staleness, windows, resume, lost workers,
signals, ...) is tested on all three engines in tests/test_engines.py."""

import time

import pytest
from helpers.engines import job, run
from helpers.procs import frozen_inside_meta, stopped_process

from gem.data import make_synthetic


@pytest.fixture(scope="module")
def data():
    return make_synthetic((1, 28, 28), train_size=256, val_size=64, seed=1)


def test_turns_are_first_in_first_out(data, tmp_path):
    """While a worker waits for the server, each other worker is served at most once before it: first in,
    first out. Polling workers in a fixed order, as the original code did, lets low ranks overtake high ones
    again and again; CPU contention on a small machine changes how long turns take, never this bound."""
    n = 4
    _, m = run(job(data, "process", n, epochs=4), tmp_path)
    assert (m["wait_commits"] >= 0).all() and (m["wait_s"] >= 0).all()
    assert m["wait_commits"].max() <= n - 1, m["wait_commits"].value_counts().to_dict()
    assert sorted(m["worker"].unique()) == list(range(n))


def test_threads_per_process_is_cores_over_processes_capped_by_omp_num_threads(monkeypatch):
    import os

    from gem.engines.worker import threads_per_process

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [threads_per_process(n) for n in (1, cores, 4 * cores)] == [cores, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the test suite sets (conftest.py)
    assert threads_per_process(1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert threads_per_process(1) == cores


def test_a_participant_asked_to_stop_is_never_handed_the_turn():
    """Stopped while in line, a participant is woken to stop (Gone) and the turn goes to the next one: handed the
    turn, it would stop holding it, and everyone behind it would wait for good (the distributed engine's server
    thread takes the turn after stopping its local workers)."""
    import multiprocessing

    import torch

    from gem.engines.turn import SAVE, STOP, Gone, Turn

    turn = Turn(multiprocessing.get_context("spawn"), 3, torch.device("cpu"))
    assert turn.acquire(0)
    assert turn._take(5)
    turn._enqueue(1)  # 1 and then 2 wait in line behind 0
    turn._enqueue(2)
    turn._give()
    turn.stop(1)
    turn.release()
    assert int(turn.state[0]) == 2 and turn.peek() == (set(), None)  # handed to 2; 1 is out of line
    with pytest.raises(Gone):
        turn.acquire(1, timeout=1.0)  # woken: it stops
    turn.release()
    assert int(turn.state[0]) == -1
    turn.ask({1}, SAVE)  # a checkpoint asked after the stop does not undo it
    assert int(turn.action[1]) == STOP


def test_a_requests_left_over_permit_is_not_taken_for_the_turn():
    """A checkpoint asks a worker in line (its semaphore posted), and the turn is handed to it before it wakes (the
    hand-over overwrites the request): two permits, one turn. The second permit, found at its next wait, must not
    make it a second holder beside the one that holds the turn then."""
    import multiprocessing

    import torch

    from gem.engines.turn import SAVE, Turn

    turn = Turn(multiprocessing.get_context("spawn"), 2, torch.device("cpu"))
    assert turn.acquire(0)
    assert turn._take(5)
    turn._enqueue(1)
    turn._give()
    turn.ask({1}, SAVE)
    turn.release()  # handed to 1, which has not woken yet
    assert int(turn.state[0]) == 1 and turn.sems[1].acquire(timeout=5.0)  # 1 wakes in its wait: the turn is its
    turn.release()
    assert turn.acquire(0) and int(turn.state[0]) == 0
    assert not turn.acquire(1, timeout=1.5)  # the left-over permit is not the turn: 0 holds it
    assert int(turn.state[0]) == 0


def test_a_coordinator_waits_on_the_turn_a_bounded_step_at_a_time():
    """A coordinator never waits inside the turn for longer than one step: with `meta` held by someone else a step
    returns None at once; in line, a step returns None after its timeout; between two steps it may take the turn
    back from a holder that died (recover, from its own loop), and its next step finds the turn its own."""
    import multiprocessing

    import torch

    from gem.engines.turn import GO, Ticket, Turn

    turn = Turn(multiprocessing.get_context("spawn"), 3, torch.device("cpu"))
    assert turn.acquire(0)  # worker 0 holds the turn, and then dies holding it
    ticket = Ticket(turn, 2)  # the coordinator
    assert turn._take(5)  # someone is inside `meta`
    began = time.monotonic()
    assert ticket.step(0.2) is None and not ticket.queued
    turn._give()
    assert ticket.step(0.2) is None and ticket.queued  # in line behind 0
    assert ticket.step(0.2) is None  # nothing came
    assert time.monotonic() - began < 5.0
    turn.recover(0)  # between two steps: 0's turn handed on, to the coordinator
    assert ticket.step(0.2) == GO and int(turn.state[0]) == 2 and not ticket.queued
    assert turn.try_release() and int(turn.state[0]) == -1


@pytest.mark.slow  # over 3 s in the fast tier (2026-11-29)
def test_a_participant_frozen_inside_the_turn_s_lock_is_the_one_waited_on():
    """Frozen inside `meta` (held a few instructions at a time), a participant stalls whoever next asks for the
    turn before it can queue: `peek` names every other participant as waiting through no fault of its own, and
    not the frozen one; without the process ids it says only who is in line."""
    import multiprocessing

    import torch

    from gem.engines.turn import Turn

    ctx = multiprocessing.get_context("spawn")
    turn = Turn(ctx, 4, torch.device("cpu"))
    assert turn.acquire(0)
    assert turn._take(5)
    turn._enqueue(2)  # 2 waits in line behind 0
    turn._give()
    p = frozen_inside_meta(ctx, turn)
    try:
        pids = {0: 11, 1: p.pid, 2: 12, 3: 13}
        assert turn.peek(pids) == ({0, 2, 3}, 1)  # 1 is frozen inside meta: everyone else waits on it
        assert turn.peek() == ({2}, None)
    finally:
        p.kill()
        p.join(10)
    turn.recover(1)  # the coordinator takes meta back from the dead process
    assert turn.peek({0: 11, 2: 12}) == ({2}, None) and turn.meta_pid.value == 0
    # frozen inside meta while it waits in line (woken to answer a request, say): still the one to blame
    assert turn._take(5)
    turn._enqueue(3)
    turn._give()
    p = frozen_inside_meta(ctx, turn)
    try:
        assert turn.peek({0: 11, 1: 14, 2: 12, 3: p.pid}) == ({0, 1, 2}, 3)
    finally:
        p.kill()
        p.join(10)
    turn.recover(3)
    # frozen between taking meta and writing its pid (CI's stop landed there once): meta has no holder named, and
    # the one stopped is the one frozen
    p, other = frozen_inside_meta(ctx, turn, named=False), stopped_process(ctx)
    try:
        assert turn.meta_pid.value == 0
        assert turn.peek({0: 11, 1: p.pid, 2: 12, 3: 13}) == ({0, 2, 3}, 1)
        # two stopped: which one holds meta cannot be told, and nobody is named
        assert turn.peek({0: 11, 1: p.pid, 2: other.pid, 3: 13}) == ({2}, None)  # (2 waits in line)
    finally:
        p.kill()
        p.join(10)
    turn.recover(1)
    # one stopped but meta free: it is not to blame for anyone's wait; also where meta was let go of just after
    # peek's wait for it gave up (its pid then reads 0 as well)
    assert turn.peek({0: 11, 1: other.pid, 2: 12}) == ({2}, None)
    real_take, tries = turn._take, []
    turn._take = lambda timeout: bool(tries.append(timeout)) if not tries else real_take(timeout)
    assert turn.peek({0: 11, 1: other.pid, 2: 12}) == ({2}, None) and len(tries) == 1
    del turn._take
    other.kill()
    other.join(10)
