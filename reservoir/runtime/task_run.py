"""``TaskRun``: a request with a task, as its caller waits on it (what
:meth:`~reservoir.runtime.requestor.Requestor.run` returns).

The placing requestor hears each instance's task state from its node as it changes
(``started``, then ``exited`` with its code, ``failed`` with a reason, or ``stopped``);
the run collects them and says when every instance's task has ended.

News can be lost: the node sends each change once, and a requestor that was reconnecting
at that moment never hears it. So a waiter that hears nothing for ``check_s`` asks the
nodes holding the instances (``ask``, a :class:`~reservoir.protocol.messages.TaskQuery`
to each), and their answers count as news. Nodes remember ended tasks for a while, so an
end missed is heard again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable

from reservoir.protocol.messages import TaskState
from reservoir.protocol.placement import Placement
from reservoir.protocol.task_book import ENDED_STATES

__all__ = ["TaskRun", "TaskRunTimeout"]

log = logging.getLogger("reservoir.runtime")


class TaskRunTimeout(TimeoutError):
    """The tasks did not reach the state waited for in time."""


class TaskRun:
    """One request's tasks. ``placement`` resolves to the placement (or raises the
    :class:`~reservoir.PlacementError`); :meth:`wait` returns once every instance's task
    ended."""

    def __init__(
        self,
        request_id: str,
        placement: concurrent.futures.Future[Placement],
        on_change: Callable[[TaskState], None] | None = None,
        *,
        ask: Callable[[Placement], None] | None = None,
        check_s: float = math.inf,
    ) -> None:
        """``ask(placement)`` asks the nodes holding ``placement`` to say again what
        became of its tasks; a waiter calls it after ``check_s`` without news (the
        requestor gives both, ``check_s`` from ``Settings.task_check_s``)."""
        if not check_s > 0:
            raise ValueError(f"check_s must be positive, not {check_s!r}")
        self.request_id = request_id
        self.placement = placement
        self._on_change = on_change
        self._ask = ask
        self._check_s = check_s
        #: when a waiter heard from the nodes last, or asked them (time.monotonic())
        self._last_news = time.monotonic()
        #: asks since the last news: a second one in a row says the nodes are silent
        self._unanswered = 0
        self._changed = threading.Condition()
        #: every state heard, in order
        self.history: list[TaskState] = []
        #: allocation id -> its latest state
        self.latest: dict[str, TaskState] = {}
        placement.add_done_callback(lambda _: self._notify())

    def heard(self, state: TaskState) -> None:
        """A node told of a change (called by the requestor)."""
        with self._changed:
            self._last_news = time.monotonic()
            self._unanswered = 0
            before = self.latest.get(state.allocation_id)
            if before is not None and before.state in ENDED_STATES:
                return  # an ended task does not come back (a late duplicate)
            if before is not None and before.state == state.state and state.answering:
                return  # an answer that tells what was heard already
            self.history.append(state)
            self.latest[state.allocation_id] = state
            self._changed.notify_all()
        if self._on_change is not None:
            self._on_change(state)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _allocation_ids(self) -> list[str] | None:
        if not self.placement.done():
            return None
        return [a.allocation_id for a in self.placement.result().allocations]

    def _wait(self, done: Callable[[list[str]], bool], timeout_s: float | None) -> Placement:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._changed:
                ids = self._allocation_ids()  # raises PlacementError when not placed
                if ids is not None and done(ids):
                    return self.placement.result()
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if left is not None and left <= 0:
                    raise TaskRunTimeout(f"request {self.request_id}: tasks not done in time")
                quiet_for = None
                if ids is not None and self._ask is not None and math.isfinite(self._check_s):
                    quiet_for = self._last_news + self._check_s - now
                if quiet_for is None or quiet_for > 0:
                    waits = [s for s in (left, quiet_for) if s is not None]
                    self._changed.wait(min(waits) if waits else None)
                    continue
                self._last_news = now  # the next ask after another quiet spell
                self._unanswered += 1
                silent = self._unanswered == 2
            if silent:  # once per silence: the caller waits on, and should know why
                log.warning("request %s: the nodes holding its tasks have not answered for "
                            "%g s; still asking", self.request_id, self._check_s)  # fmt: skip
            # Outside the lock: the answers are delivered under it, maybe before this returns.
            self._ask_nodes()

    def _ask_nodes(self) -> None:
        assert self._ask is not None
        try:
            self._ask(self.placement.result())
        except Exception as error:  # the broker down, say: asked again after check_s
            log.warning("request %s: could not ask the nodes about its tasks: %s",
                        self.request_id, error)  # fmt: skip

    def wait_started(self, timeout_s: float | None = None) -> dict[str, TaskState]:
        """Wait until every instance's task started (or already ended)."""
        self._wait(lambda ids: all(i in self.latest for i in ids), timeout_s)
        return self.states()

    def wait(self, timeout_s: float | None = None) -> dict[str, TaskState]:
        """Wait until every instance's task ended; the final state of each."""
        self._wait(
            lambda ids: all(i in self.latest and self.latest[i].state in ENDED_STATES for i in ids),
            timeout_s,
        )
        return self.states()

    async def wait_async(self, timeout_s: float | None = None) -> dict[str, TaskState]:
        """:meth:`wait` without blocking the running event loop."""
        return await asyncio.to_thread(self.wait, timeout_s)

    @property
    def finished(self) -> bool:
        """Placed, and every instance's task ended (or not placed at all)."""
        if not self.placement.done():
            return False
        if self.placement.exception() is not None:
            return True
        states = self.states()
        return all(
            i in states and states[i].state in ENDED_STATES
            for i in (a.allocation_id for a in self.placement.result().allocations)
        )

    def states(self) -> dict[str, TaskState]:
        with self._changed:
            return dict(self.latest)

    @property
    def exit_code(self) -> int | None:
        """The run's exit code once every task ended: the first non-zero one among the
        instances (0 when all exited 0); None while running, or when an exit code is
        unknown (a task that failed to start has none)."""
        states = self.states()
        ids = self._allocation_ids() if self.placement.done() else None
        if not ids or any(i not in states or states[i].state not in ENDED_STATES for i in ids):
            return None
        codes = [states[i].exit_code for i in ids]
        if any(code is None for code in codes):
            return None
        return next((code for code in codes if code), 0)
