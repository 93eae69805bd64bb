"""A node agent's answers to :class:`~reservoir.protocol.messages.TaskOutputQuery`: a
chunk of a task's output, read from where its driver keeps it.

A query that waits (``wait_s``) and finds nothing new is held, and looked at again on
each of the agent's task polls (every 50 ms; a driver may ask to be read less often,
``output_poll_s``), until there is output past its offset, the task ended, or its wait
passed. So a reader following a task has one query in flight at a time, and its answer
leaves as soon as there is something to tell. At most :data:`MAX_WAITING` queries are
held; one more answers the oldest at once (its reader asks again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from reservoir.protocol.messages import TaskOutput, TaskOutputQuery, TaskReport
from reservoir.protocol.task_book import ENDED_STATES
from reservoir.runtime.tasks import OutputChunk

__all__ = ["MAX_WAITING", "OutputDesk"]

#: the most queries a node holds waiting for output
MAX_WAITING: Final = 1024

#: reads ``stream`` of an allocation's task through driver ``driver``: (driver, query)
Read = Callable[[str, TaskOutputQuery], OutputChunk | None]


@dataclass
class _Held:
    query: TaskOutputQuery
    until: float
    driver: str
    polled_at: float


class OutputDesk:
    """Answers output queries for the node ``node`` (``address``): ``task_of`` tells
    what the node knows of a request's task on an allocation, ``read`` reads its output, ``answer``
    sends an answer, ``poll_s`` says how often a driver's output may be read again."""

    def __init__(
        self,
        *,
        node: str,
        address: str,
        task_of: Callable[[str, str], TaskReport | None],
        read: Read,
        answer: Callable[[TaskOutputQuery, TaskOutput], None],
        poll_s: Callable[[str], float],
        clock: Callable[[], float] = time.monotonic,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self._node = node
        self._address = address
        self._task_of = task_of
        self._read = read
        self._answer = answer
        self._poll_s = poll_s
        self._clock = clock
        self._max_waiting = max_waiting
        self._held: list[_Held] = []
        self._lock = threading.Lock()

    def waiting(self) -> int:
        with self._lock:
            return len(self._held)

    def ask(self, query: TaskOutputQuery) -> None:
        """A query came: answered now, or held until there is something to say."""
        report = self._task_of(query.request_id, query.allocation_id)
        output = self._output(query, report, final=query.wait_s <= 0)
        if output is not None:
            self._answer(query, output)
            return
        assert report is not None  # an unknown task is answered at once
        now = self._clock()
        oldest = None
        with self._lock:
            if len(self._held) >= self._max_waiting:
                oldest = self._held.pop(0)
            self._held.append(_Held(query, now + query.wait_s, report.driver, now))
        if oldest is not None:
            self._look_again(oldest, final=True)

    def tick(self) -> None:
        """Look again at the held queries due (the agent's task poll)."""
        now = self._clock()
        with self._lock:
            due = [
                h
                for h in self._held
                if now >= h.until or now - h.polled_at >= self._poll_s(h.driver)
            ]
        for held in due:
            held.polled_at = now
            if self._look_again(held, final=now >= held.until):
                with self._lock:
                    if held in self._held:
                        self._held.remove(held)

    def _look_again(self, held: _Held, *, final: bool) -> bool:
        query = held.query
        output = self._output(
            query, self._task_of(query.request_id, query.allocation_id), final=final
        )
        if output is None:
            return False
        self._answer(held.query, output)
        return True

    def close(self) -> None:
        with self._lock:
            self._held.clear()

    def _output(
        self, query: TaskOutputQuery, report: TaskReport | None, *, final: bool
    ) -> TaskOutput | None:
        """The answer to ``query``, or None to hold it (nothing new yet, not ``final``)."""
        if report is None:
            return self._message(query, OutputChunk(offset=query.offset), None, kept=False)
        # the state first: once it says ended, the output read after it is complete
        ended = report.state in ENDED_STATES
        chunk = self._read(report.driver, query)
        if chunk is None:
            if ended:  # never started, or its output is gone
                return self._message(query, OutputChunk(offset=query.offset), report, kept=False)
            chunk = OutputChunk(offset=query.offset)  # being started: nothing yet
        # a query for no bytes asks for the task's state alone: held until it ended
        at_end = query.max_bytes == 0 or chunk.offset + len(chunk.data) >= chunk.size
        if chunk.data or chunk.skipped or (ended and at_end) or final:
            return self._message(query, chunk, report, ended=ended and at_end)
        return None

    def _message(
        self,
        query: TaskOutputQuery,
        chunk: OutputChunk,
        report: TaskReport | None,
        *,
        kept: bool = True,
        ended: bool = False,
    ) -> TaskOutput:
        return TaskOutput(
            request_id=query.request_id,
            sender=self._node,
            reply_to=self._address,
            allocation_id=query.allocation_id,
            stream=query.stream,
            offset=chunk.offset,
            data=chunk.data,
            skipped=chunk.skipped,
            size=chunk.size,
            ended=ended or report is None or not kept,
            task=report,
            kept=kept,
        )
