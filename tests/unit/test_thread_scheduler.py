"""The real-time scheduler: callbacks in time order on its thread, woken for a timer only
when it would otherwise look too late.

The clock is a FakeClock, so "due" is decided by the test, not by sleeping: a timer due
far ahead would keep the serving thread asleep for that long in real time, and a test that
sees a sooner one run promptly proves the thread was woken for it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from reservoir.clock import FakeClock, ThreadScheduler

#: how long a test waits for a callback that should run at once (never reached when it does)
PROMPTLY_S = 5.0
#: a timer this far ahead would hold the serving thread asleep past the end of any test
FAR_AHEAD_S = 3600.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start_s=0.0)


@pytest.fixture
def scheduler(clock: FakeClock) -> Iterator[ThreadScheduler]:
    scheduler = ThreadScheduler(clock, name="test-scheduler")
    yield scheduler
    scheduler.close()


def test_a_timer_due_now_runs_although_the_thread_sleeps_for_one_far_ahead(
    scheduler: ThreadScheduler,
) -> None:
    far, soon = threading.Event(), threading.Event()
    scheduler.call_at(FAR_AHEAD_S, far.set)
    scheduler.call_at(0.0, soon.set)
    assert soon.wait(PROMPTLY_S)
    assert not far.is_set()


def test_a_timer_set_after_the_awaited_one_was_cancelled_still_runs_when_due(
    scheduler: ThreadScheduler,
) -> None:
    far, soon = threading.Event(), threading.Event()
    scheduler.call_at(FAR_AHEAD_S, far.set).cancel()
    scheduler.call_at(FAR_AHEAD_S * 2, far.set)  # later than the one it waits for
    scheduler.call_at(0.0, soon.set)
    assert soon.wait(PROMPTLY_S)
    assert not far.is_set()


def test_timers_set_while_a_callback_runs_are_found_when_it_returns(
    scheduler: ThreadScheduler,
) -> None:
    gate, ran = threading.Event(), []
    done = threading.Event()

    def hold() -> None:
        gate.wait(PROMPTLY_S)

    scheduler.call_at(0.0, hold)
    for label, when in (("third", 0.3), ("first", 0.1), ("second", 0.2)):
        scheduler.call_at(when, lambda label=label: ran.append(label))  # type: ignore[misc]
    scheduler.call_at(0.4, done.set)
    gate.set()
    # The clock reads 0 still: none of them is due; once it reads 1, all are.
    clock = scheduler.clock
    assert isinstance(clock, FakeClock)
    clock.set(1.0)
    scheduler.call_at(0.0, lambda: None)  # a timer due now makes it look again
    assert done.wait(PROMPTLY_S)
    assert ran == ["first", "second", "third"]


def test_a_cancelled_timer_never_runs(scheduler: ThreadScheduler) -> None:
    cancelled, after = threading.Event(), threading.Event()
    scheduler.call_at(0.0, cancelled.set).cancel()
    scheduler.call_at(0.0, after.set)
    assert after.wait(PROMPTLY_S)
    assert not cancelled.is_set()


def test_after_close_nothing_more_runs(clock: FakeClock) -> None:
    scheduler = ThreadScheduler(clock, name="test-scheduler")
    scheduler.close()
    ran = threading.Event()
    timer = scheduler.call_at(0.0, ran.set)
    assert timer.cancelled  # refused, not queued: there is no thread left to run it
    assert not ran.is_set()
