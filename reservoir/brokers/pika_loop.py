"""The IO thread's event loop for pika's ``SelectConnection``: one ``epoll``, one timer heap.

This module owns the loop the pika driver hands to ``SelectConnection`` as its
``custom_ioloop``: pika's ``AbstractSelectorIOLoop`` interface (``add_handler``,
``update_handler``, ``remove_handler``, ``call_later``, ``remove_timeout``,
``add_callback``, ``start``, ``stop``, ``close``) and ``add_callback_threadsafe``, the one
method other threads call.

Why not pika's own ``IOLoop``: it does the same thing in more Python per turn, and the IO
thread turns its loop several times per placement in every process (a delivery, a
publisher confirm, a wake-up). pika's turn builds a ``defaultdict`` of the events, tests
each descriptor against three sets, asks three functions how long it may wait, and keeps
timers as objects ordered by a Python ``__lt__``. Here a turn is the ``epoll.poll``, one
dict lookup per ready descriptor, and a look at the head of a heap of tuples;
docs/performance.md measures what that saves.

What stays as pika's loop has it, because pika's adapter relies on it:

- a handler is called with the events it registered for (and HUP): a handler removed or
  narrowed by an earlier handler of the same turn is not called for what it no longer
  watches;
- callbacks added during a turn run in the next one (no starvation of the socket), in the
  order they were added; timers run in deadline order, each at most once, and one
  cancelled before it runs never runs;
- ``stop`` ends the loop after the turn in which it was asked, from any thread (it wakes
  the loop), and ``start`` may be called again after it returns;
- no poll waits longer than five seconds.

Linux only (``select.epoll``): :func:`new_loop` gives pika's ``IOLoop`` elsewhere.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

__all__ = ["EpollLoop", "Timeout", "new_loop"]

#: the longest one poll waits, as pika's loop: a lost wake-up costs no more than this
MAX_WAIT_S: Final = 5.0
#: cancelled timers the heap may hold before it is rebuilt without them (when they are
#: also more than half of it): a timer set again and again far ahead cannot grow it
CANCELLED_KEPT: Final = 1024


class Timeout:
    """A handle :meth:`EpollLoop.call_later` returns; its callback is None once it has run
    or been cancelled."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback: Callable[[], None] | None = callback


class EpollLoop:
    """pika's ``AbstractSelectorIOLoop``, on one ``epoll`` and a heap of
    ``(deadline, sequence, Timeout)`` tuples (compared in C; the sequence keeps equal
    deadlines in the order they were set)."""

    READ: Final = select.EPOLLIN
    WRITE: Final = select.EPOLLOUT
    ERROR: Final = select.EPOLLERR
    #: what a handler is told beyond what it asked for, as pika's loop tells it
    _ALWAYS: Final = ~(select.EPOLLIN | select.EPOLLOUT | select.EPOLLERR)

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        #: monotonic seconds; a test gives a fake clock's
        self._now = now
        self._epoll = select.epoll()
        #: fd -> (handler, the events it asked for, with what is always reported)
        self._handlers: dict[int, tuple[Callable[[int, int], None], int]] = {}
        self._timers: list[tuple[float, int, Timeout]] = []
        self._sequence = itertools.count()
        self._cancelled = 0
        self._callbacks: deque[Callable[[], None]] = deque()
        self._running = False
        self._stopping = False
        self._closed = False
        # The wake-up: an eventfd, written from any thread and read by the loop. The lock
        # keeps a write from reaching a descriptor number that close() has freed.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self.add_handler(self._wake_fd, self._read_wake, self.READ)

    # -- descriptors (the IO thread only) ---------------------------------------------------

    def add_handler(self, fd: int, handler: Callable[[int, int], None], events: int) -> None:
        self._handlers[fd] = (handler, events | self._ALWAYS)
        self._epoll.register(fd, events)

    def update_handler(self, fd: int, events: int) -> None:
        handler, _ = self._handlers[fd]
        self._handlers[fd] = (handler, events | self._ALWAYS)
        self._epoll.modify(fd, events)

    def remove_handler(self, fd: int) -> None:
        del self._handlers[fd]
        # the descriptor closed first: epoll dropped it already
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)

    # -- timers and callbacks --------------------------------------------------------------

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timeout:
        if delay < 0:
            raise ValueError(f"call_later: delay must be non-negative, not {delay!r}")
        timeout = Timeout(callback)
        heapq.heappush(self._timers, (self._now() + delay, next(self._sequence), timeout))
        return timeout

    def remove_timeout(self, timeout_handle: Timeout) -> None:
        # Left in the heap, skipped when its deadline comes: the heap is never searched.
        if timeout_handle.callback is None:
            return  # run or cancelled already
        timeout_handle.callback = None
        self._cancelled += 1
        if self._cancelled > CANCELLED_KEPT and self._cancelled * 2 > len(self._timers):
            self._timers = [t for t in self._timers if t[2].callback is not None]
            heapq.heapify(self._timers)
            self._cancelled = 0

    def add_callback_threadsafe(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop's thread soon: the one method for other threads."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {callback!r}")
        self._callbacks.append(callback)  # deque.append is atomic
        self._wake()

    add_callback = add_callback_threadsafe

    @property
    def timers_held(self) -> int:
        """Timers the heap holds, the cancelled ones not yet dropped included."""
        return len(self._timers)

    # -- running ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._running:
            raise RuntimeError("the loop is already running (it is not reentrant)")
        if self._closed:
            raise RuntimeError("the loop is closed")
        self._running = True
        try:
            while not self._stopping:
                self._turn()
        finally:
            self._stopping = False
            self._running = False

    def stop(self) -> None:
        """End :meth:`start` after the current turn; from any thread."""
        self._stopping = True
        self._wake()

    def close(self) -> None:
        """Release the loop's descriptors, after :meth:`start` has returned."""
        if self._running:
            raise RuntimeError("close() while the loop runs")
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_fd)
        self._epoll.close()
        for _, _, timeout in self._timers:
            timeout.callback = None
        self._timers.clear()
        self._handlers.clear()

    def _turn(self) -> None:
        callbacks = self._callbacks
        timers = self._timers
        if callbacks:
            wait_s = 0.0
        elif timers:
            wait_s = min(max(0.0, timers[0][0] - self._now()), MAX_WAIT_S)
        else:
            wait_s = MAX_WAIT_S
        handlers = self._handlers
        for fd, events in self._epoll.poll(wait_s):
            entry = handlers.get(fd)
            if entry is not None:  # None: removed by an earlier handler of this turn
                events &= entry[1]
                if events:
                    entry[0](fd, events)
        # Only those there now: one a callback adds waits for the next turn's poll.
        for _ in range(len(callbacks)):
            callbacks.popleft()()
        if timers and timers[0][0] <= self._now():
            self._run_timers()

    def _run_timers(self) -> None:
        timers = self._timers
        now = self._now()
        due: list[Timeout] = []
        while timers and timers[0][0] <= now:
            timeout = heapq.heappop(timers)[2]
            if timeout.callback is None:
                self._cancelled -= 1
            else:
                due.append(timeout)
        for timeout in due:
            callback = timeout.callback
            if callback is None:  # cancelled by an earlier one of these: skipped
                self._cancelled -= 1
            else:
                timeout.callback = None
                callback()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._closed:
                os.eventfd_write(self._wake_fd, 1)

    def _read_wake(self, fd: int, _events: int) -> None:
        with contextlib.suppress(BlockingIOError):  # read already: a spurious report
            os.eventfd_read(fd)


def new_loop() -> Any:
    """The IO loop for a pika connection: :class:`EpollLoop` where ``epoll`` exists, pika's
    own ``IOLoop`` elsewhere."""
    if hasattr(select, "epoll") and hasattr(os, "eventfd"):
        return EpollLoop()
    from pika.adapters.select_connection import IOLoop

    return IOLoop()
