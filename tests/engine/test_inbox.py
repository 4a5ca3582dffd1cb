"""The inbox's back-pressure: a submitter finding `high_water` submissions untaken waits for the loop, bounded."""

from __future__ import annotations

import threading
import time

import pytest

from cbnb.engine.inbox import MAX_WAIT_S, EngineStoppedError, Inbox


def test_submit_waits_for_room_and_goes_on_when_the_loop_takes():
    inbox = Inbox(max_per_turn=2, high_water=3)
    for i in range(3):
        inbox.submit(i)
    done = threading.Event()
    t = threading.Thread(target=lambda: (inbox.submit(3), done.set()))
    t.start()
    assert not done.wait(0.05)  # full: the submitter waits
    assert inbox.take_submissions() == [0, 1]
    assert done.wait(MAX_WAIT_S)
    t.join()
    assert inbox.take_submissions() == [2, 3]


def test_a_full_inbox_never_loses_nor_deadlocks_the_submitter_queues_after_the_wait():
    inbox = Inbox(max_per_turn=2, high_water=1)
    inbox.submit("a")
    t0 = time.monotonic()
    inbox.submit("b")  # nobody takes: it waits at most MAX_WAIT_S, then queues
    assert time.monotonic() - t0 < MAX_WAIT_S + 1.0
    assert inbox.take_submissions() == ["a", "b"]


def test_no_wait_for_the_loop_thread_itself():
    inbox = Inbox(max_per_turn=2, high_water=1)
    inbox.submit("a")
    t0 = time.monotonic()
    inbox.submit("b", wait=False)
    assert time.monotonic() - t0 < MAX_WAIT_S / 2
    assert inbox.take_submissions() == ["a", "b"]


def test_a_waiting_submitter_is_refused_as_soon_as_stop_begins():
    inbox = Inbox(max_per_turn=2, high_water=1)
    inbox.submit("a")
    errors: list[BaseException] = []

    def submit():
        try:
            inbox.submit("b")
        except EngineStoppedError as e:
            errors.append(e)

    t = threading.Thread(target=submit)
    t.start()
    time.sleep(0.05)
    inbox.request_stop(drain=False, reason="engine is stopping")
    t.join(MAX_WAIT_S + 1.0)
    assert not t.is_alive()
    assert len(errors) == 1 and "stopping" in str(errors[0])
    leftover, _ = inbox.close("stopped")
    assert leftover == ["a"]  # submitted before the stop: handed back to be ended, never lost
    with pytest.raises(EngineStoppedError):
        inbox.submit("c")
