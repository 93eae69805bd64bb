"""Time, injected: clocks and the schedulers that run callbacks at clock times.

Nothing in reservoir reads the system clock behind its caller's back. The live runtime
gets a :class:`SystemClock` and a :class:`ThreadScheduler`; tests and the simulator get a
:class:`VirtualScheduler` whose :class:`FakeClock` only moves when they advance it, so a
five-second reservation expiry is tested in microseconds and never by sleeping.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "Clock",
    "FakeClock",
    "Scheduler",
    "SystemClock",
    "ThreadScheduler",
    "Timer",
    "VirtualScheduler",
]

log = logging.getLogger(__name__)

Callback = Callable[[], None]


class Clock(Protocol):
    """A source of time. ``now`` is monotonic seconds; ``wall`` is seconds since the epoch."""

    def now(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The real clock: ``time.monotonic`` for intervals, the wall clock for cross-host stamps."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()  # noqa: TID251 - the one sanctioned wall-clock read


class FakeClock:
    """A clock that moves only when told to. ``wall`` keeps a fixed offset from ``now``."""

    def __init__(self, start_s: float = 1000.0, wall_offset_s: float = 1_700_000_000.0) -> None:
        self._now_s = start_s
        self._wall_offset_s = wall_offset_s

    def now(self) -> float:
        return self._now_s

    def wall(self) -> float:
        return self._now_s + self._wall_offset_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not run backwards")
        self._now_s += seconds

    def set(self, now_s: float) -> None:
        if now_s < self._now_s:
            raise ValueError("a clock does not run backwards")
        self._now_s = now_s


class Timer:
    """A scheduled callback. ``cancel`` is idempotent and safe from any thread."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callback) -> None:
        self.when = when
        self.callback: Callback | None = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.callback = None  # drop references early: cancelled timers linger in the heap


class Scheduler(ABC):
    """Runs callbacks at times of its clock, one at a time, in time order."""

    clock: Clock

    @abstractmethod
    def call_at(self, when: float, callback: Callback) -> Timer:
        """Run ``callback`` once the clock reaches ``when`` (at once if it already has)."""

    def call_soon(self, callback: Callback) -> Timer:
        return self.call_at(self.clock.now(), callback)

    def call_later(self, delay_s: float, callback: Callback) -> Timer:
        return self.call_at(self.clock.now() + delay_s, callback)

    @abstractmethod
    def close(self) -> None:
        """Stop running callbacks; pending ones are dropped."""


class _TimerHeap:
    """A heap of timers ordered by time, then by insertion (FIFO among equal times)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._sequence = itertools.count()

    def push(self, timer: Timer) -> None:
        heapq.heappush(self._heap, (timer.when, next(self._sequence), timer))

    def next_due(self) -> float | None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def pop(self) -> Timer:
        return heapq.heappop(self._heap)[2]

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)


def _run(timer: Timer) -> None:
    callback = timer.callback
    timer.cancel()
    if callback is None:
        return
    try:
        callback()
    except Exception:
        # A failing callback is a bug in its owner, not in the scheduler: log it and keep
        # serving every other owner's callbacks.
        log.exception("scheduled callback failed")


class ThreadScheduler(Scheduler):
    """A daemon thread that runs callbacks at real-clock times. Event-driven: it sleeps on a
    condition until the earliest timer it knew of is due, or one due sooner arrives; it
    never polls. A timer cancelled while it slept still wakes it once, at its time."""

    def __init__(self, clock: Clock | None = None, *, name: str = "reservoir-scheduler") -> None:
        self.clock = clock if clock is not None else SystemClock()
        self._timers = _TimerHeap()
        self._condition = threading.Condition()
        self._closed = False
        #: when the serving thread looks at the timers next by itself: -inf while it runs
        #: (it looks before it sleeps again), +inf while it sleeps with nothing due
        self._looks_at = -math.inf
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call_at(self, when: float, callback: Callback) -> Timer:
        timer = Timer(when, callback)
        with self._condition:
            if self._closed:
                timer.cancel()
                return timer
            self._timers.push(timer)
            # Wake the serving thread only when it would otherwise look too late. It may
            # be set to wake for a timer cancelled since (most are: a conversation's
            # timeouts rarely fire); then it finds this one when it does, and a wake-up per
            # timer set (three per placement) cost more than one per cancelled timeout.
            if when < self._looks_at:
                self._condition.notify()
        return timer

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._timers.clear()
            self._condition.notify()
        if not self.on_thread():
            self._thread.join(timeout=5.0)

    def _serve(self) -> None:
        while True:
            with self._condition:
                while True:
                    if self._closed:
                        return
                    due = self._timers.next_due()
                    if due is None:
                        self._looks_at = math.inf
                        self._condition.wait()
                        self._looks_at = -math.inf
                        continue
                    delay_s = due - self.clock.now()
                    if delay_s <= 0:
                        timer = self._timers.pop()
                        break
                    self._looks_at = due
                    self._condition.wait(delay_s)
                    self._looks_at = -math.inf
            _run(timer)


class VirtualScheduler(Scheduler):
    """A scheduler on a :class:`FakeClock`: callbacks run only when the caller advances time.

    Deterministic and single-threaded: the simulator and the property tests drive every
    participant through one of these, so a run is reproducible from its seed.
    """

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock: FakeClock = clock if clock is not None else FakeClock()
        self._timers = _TimerHeap()
        self._lock = threading.Lock()
        self._closed = False

    def call_at(self, when: float, callback: Callback) -> Timer:
        timer = Timer(when, callback)
        with self._lock:
            if self._closed:
                timer.cancel()
            else:
                self._timers.push(timer)
        return timer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._timers.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._timers) if self._timers.next_due() is not None else 0

    def next_due(self) -> float | None:
        with self._lock:
            return self._timers.next_due()

    def step(self, until: float | None = None) -> bool:
        """Run the earliest callback due at or before ``until`` (or at all), moving the clock
        to its time. Returns False when there is none."""
        with self._lock:
            due = self._timers.next_due()
            if due is None or (until is not None and due > until):
                return False
            timer = self._timers.pop()
        if timer.when > self.clock.now():
            self.clock.set(timer.when)
        _run(timer)
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Run everything due now, including what those callbacks schedule for now."""
        for _ in range(max_steps):
            if not self.step(until=self.clock.now()):
                return
        raise RuntimeError(f"still busy after {max_steps} steps: a callback loop?")

    def advance(self, seconds: float, max_steps: int = 10_000_000) -> None:
        """Move time forward by ``seconds``, running every callback due on the way."""
        target = self.clock.now() + seconds
        for _ in range(max_steps):
            if not self.step(until=target):
                break
        else:
            raise RuntimeError(f"still busy after {max_steps} steps")
        self.clock.set(max(target, self.clock.now()))

    def run_until(
        self, done: Callable[[], bool], *, timeout_s: float, max_steps: int = 10_000_000
    ) -> bool:
        """Advance event by event until ``done()`` holds or ``timeout_s`` of virtual time
        has passed. Returns whether ``done()`` held."""
        limit = self.clock.now() + timeout_s
        for _ in range(max_steps):
            if done():
                return True
            if not self.step(until=limit):
                self.clock.set(max(limit, self.clock.now()))
                return done()
        raise RuntimeError(f"still busy after {max_steps} steps")
