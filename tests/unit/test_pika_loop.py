"""The pika driver's event loop (:class:`reservoir.brokers.pika_loop.EpollLoop`): what pika's
adapter needs of a loop, on real descriptors (a socket pair) and a fake clock for the timers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from reservoir.brokers.pika_loop import CANCELLED_KEPT, MAX_WAIT_S, EpollLoop, new_loop
from reservoir.clock import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def loop(clock: FakeClock) -> Iterator[EpollLoop]:
    loop = EpollLoop(now=clock.now)
    yield loop
    loop.close()


Pair = tuple[socket.socket, socket.socket]


def _socket_pair() -> Iterator[Pair]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


pair = pytest.fixture(_socket_pair)
#: another, for the tests that need two descriptors ready in one turn
second_pair = pytest.fixture(_socket_pair, name="second_pair")


def test_timers_run_in_deadline_order_and_a_cancelled_one_never_runs(
    loop: EpollLoop, clock: FakeClock
) -> None:
    ran: list[str] = []
    loop.call_later(2.0, lambda: ran.append("second"))
    loop.call_later(1.0, lambda: ran.append("first"))
    cancelled = loop.call_later(1.5, lambda: ran.append("cancelled"))
    loop.call_later(2.0, lambda: ran.append("third, set after second for the same time"))
    loop.remove_timeout(cancelled)
    clock.advance(3.0)
    loop.call_later(0.0, loop.stop)
    loop.start()
    assert ran == ["first", "second", "third, set after second for the same time"]
    assert cancelled.callback is None


def test_a_timer_not_yet_due_does_not_run(loop: EpollLoop, clock: FakeClock) -> None:
    ran: list[str] = []
    loop.call_later(10.0, lambda: ran.append("later"))
    loop.call_later(0.0, loop.stop)
    loop.start()
    assert ran == []
    clock.advance(10.0)
    loop.call_later(0.0, loop.stop)
    loop.start()
    assert ran == ["later"]


def test_a_timer_cancelled_by_one_due_in_the_same_turn_is_skipped(
    loop: EpollLoop, clock: FakeClock
) -> None:
    ran: list[str] = []
    victim = loop.call_later(2.0, lambda: ran.append("victim"))
    loop.call_later(1.0, lambda: loop.remove_timeout(victim))
    loop.call_later(3.0, loop.stop)
    clock.advance(5.0)
    loop.start()
    assert ran == []


def test_a_negative_delay_is_refused(loop: EpollLoop) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        loop.call_later(-1.0, lambda: None)


def test_timers_cancelled_over_and_over_do_not_grow_the_heap(
    loop: EpollLoop, clock: FakeClock
) -> None:
    kept = loop.call_later(100.0, lambda: None)
    for _ in range(10 * CANCELLED_KEPT):
        loop.remove_timeout(loop.call_later(50.0, lambda: None))
    assert loop.timers_held <= 2 * CANCELLED_KEPT + 2
    assert kept.callback is not None


def test_callbacks_from_other_threads_wake_a_waiting_loop_and_run_in_order(
    loop: EpollLoop,
) -> None:
    ran: list[int] = []
    started = threading.Event()
    loop.add_callback_threadsafe(started.set)

    def other_thread() -> None:
        started.wait(5)
        for i in range(100):
            loop.add_callback_threadsafe(lambda i=i: ran.append(i))
        loop.add_callback_threadsafe(loop.stop)

    thread = threading.Thread(target=other_thread)
    thread.start()
    loop.start()  # waits in epoll (no timer is set) until the other thread's wake-up
    thread.join(5)
    assert ran == list(range(100))


def test_a_callback_added_by_a_callback_waits_for_the_next_turn(loop: EpollLoop) -> None:
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        loop.add_callback(lambda: ran.append("added by first"))

    loop.add_callback(first)
    loop.add_callback(lambda: ran.append("second"))
    loop.add_callback(lambda: loop.add_callback(loop.stop))
    loop.start()
    assert ran == ["first", "second", "added by first"]


def test_callbacks_that_add_callbacks_do_not_keep_the_socket_waiting(
    loop: EpollLoop, pair: Pair
) -> None:
    a, b = pair
    runs: list[int] = []

    def again() -> None:
        runs.append(1)
        if len(runs) < 1000:
            loop.add_callback(again)
        else:
            loop.stop()

    def on_readable(_fd: int, _events: int) -> None:
        a.recv(10)
        loop.stop()

    loop.add_handler(a.fileno(), on_readable, loop.READ)
    b.send(b"x")
    loop.add_callback(again)
    loop.start()
    assert len(runs) <= 2  # the socket was heard between two rounds of callbacks


def test_stop_from_another_thread_wakes_the_loop_and_it_can_start_again(loop: EpollLoop) -> None:
    running = threading.Event()
    loop.add_callback(running.set)
    thread = threading.Thread(target=loop.start)
    thread.start()
    assert running.wait(5)
    loop.stop()
    # The loop waits in epoll with no timer set, MAX_WAIT_S at most: only the wake-up that
    # stop() sends ends it sooner than that.
    thread.join(MAX_WAIT_S / 2)
    assert not thread.is_alive(), "stop() did not wake the loop"
    ran: list[str] = []
    loop.add_callback(lambda: ran.append("again"))
    loop.add_callback(loop.stop)
    loop.start()
    assert ran == ["again"]


def test_start_is_not_reentrant(loop: EpollLoop) -> None:
    errors: list[BaseException] = []

    def reenter() -> None:
        try:
            loop.start()
        except RuntimeError as error:
            errors.append(error)
        loop.stop()

    loop.add_callback(reenter)
    loop.start()
    assert len(errors) == 1 and "reentrant" in str(errors[0])


def test_a_handler_hears_what_it_watches_and_nothing_once_removed(
    loop: EpollLoop, pair: Pair
) -> None:
    a, b = pair
    heard: list[int] = []

    def on_events(fd: int, events: int) -> None:
        heard.append(events)
        if events & loop.READ:
            a.recv(100)
            loop.remove_handler(fd)
            loop.add_callback(loop.stop)

    loop.add_handler(a.fileno(), on_events, loop.READ)
    b.send(b"x")
    b.send(b"y")  # still unread when the handler goes: it must not be heard
    loop.start()
    assert heard == [loop.READ]
    b.send(b"z")
    loop.add_callback(loop.stop)
    loop.start()
    assert heard == [loop.READ]


def test_update_handler_changes_what_is_heard(loop: EpollLoop, pair: Pair) -> None:
    a, _ = pair
    heard: list[int] = []

    def on_events(_fd: int, events: int) -> None:
        heard.append(events)
        loop.update_handler(a.fileno(), loop.READ)  # writable no more: nothing to read
        loop.call_later(0.0, loop.stop)

    loop.add_handler(a.fileno(), on_events, loop.WRITE)
    loop.start()
    assert heard == [loop.WRITE]


def test_a_handler_is_not_told_of_events_it_stopped_watching_in_the_same_turn(
    loop: EpollLoop, pair: Pair, second_pair: Pair
) -> None:
    first, second = pair[0], second_pair[0]
    heard: list[tuple[int, int]] = []
    other = {first.fileno(): second.fileno(), second.fileno(): first.fileno()}

    def on_events(fd: int, events: int) -> None:
        heard.append((fd, events))
        if len(heard) == 1:
            loop.update_handler(other[fd], loop.READ)  # both were writable this turn
            loop.update_handler(fd, loop.READ)
            loop.call_later(0.0, loop.stop)

    loop.add_handler(first.fileno(), on_events, loop.WRITE)
    loop.add_handler(second.fileno(), on_events, loop.WRITE)
    loop.start()
    assert len(heard) == 1


def test_a_handler_removed_by_another_of_the_same_turn_is_not_called(
    loop: EpollLoop, pair: Pair, second_pair: Pair
) -> None:
    (first, first_peer), (second, second_peer) = pair, second_pair
    called: list[int] = []
    other = {first.fileno(): second.fileno(), second.fileno(): first.fileno()}

    def on_events(fd: int, _events: int) -> None:
        called.append(fd)
        loop.remove_handler(other[fd])  # the other one, ready in this turn too
        loop.remove_handler(fd)
        loop.add_callback(loop.stop)

    loop.add_handler(first.fileno(), on_events, loop.READ)
    loop.add_handler(second.fileno(), on_events, loop.READ)
    first_peer.send(b"x")
    second_peer.send(b"x")
    loop.start()
    assert len(called) == 1


def test_a_closed_loop_refuses_to_start_and_takes_late_wake_ups_quietly(clock: FakeClock) -> None:
    loop = EpollLoop(now=clock.now)
    loop.close()
    loop.add_callback_threadsafe(lambda: None)  # a late wake-up from another thread
    with pytest.raises(RuntimeError, match="closed"):
        loop.start()
    loop.close()  # twice is harmless


def test_the_driver_gets_this_loop_on_linux() -> None:
    made = new_loop()
    try:
        assert isinstance(made, EpollLoop)
    finally:
        made.close()
