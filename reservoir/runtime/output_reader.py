"""Reading a task's output from the node that runs it (or ran it): one stream of one
instance's task, chunk by chunk, in order, with :class:`OutputReader`; several at once,
merged as they come, with :func:`merged`.

Each chunk is asked for with a :class:`~reservoir.protocol.messages.TaskOutputQuery`
sent straight to the node, and the next one only once its answer came: a reader has
one query in flight, and one answer in its requestor's queue, however much the task
writes. Following (``follow=True``), each query waits on the node until there is
output past the reader's offset or the task ended, so output shows as it is written and
a quiet task costs two messages per :data:`FOLLOW_WAIT_S`. Output the node no longer
keeps (the task wrote more than the node keeps before the reader got to it) is skipped
and said (:attr:`OutputPiece.skipped`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from reservoir.protocol.messages import OUTPUT_WAIT_MAX_S, TaskOutput, TaskReport

__all__ = [
    "ANSWER_GRACE_S",
    "FOLLOW_WAIT_S",
    "OutputNotKnown",
    "OutputPiece",
    "OutputReader",
    "OutputUnreachable",
    "merged",
]

log = logging.getLogger("reservoir.requestor")

#: how long a following reader's query waits on the node for output
FOLLOW_WAIT_S: Final = min(20.0, OUTPUT_WAIT_MAX_S)
#: how much longer than the query's own wait a reader waits for its answer
ANSWER_GRACE_S: Final = 5.0

#: asks a node for a chunk: (node, request id, allocation id, stream, offset, wait_s)
Ask = Callable[[str, str, str, str, int, float], "concurrent.futures.Future[TaskOutput]"]


class OutputUnreachable(RuntimeError):
    """The node holding a task's output did not answer (it is down, or not reachable)."""


class OutputNotKnown(OutputUnreachable):
    """The node holding a task runs a release that keeps no output to read (0.1.0)."""


@dataclass(frozen=True)
class OutputPiece:
    """Bytes of one stream of one instance's task, in order. ``skipped``: bytes before
    these that the node no longer kept when they were asked for."""

    node: str
    allocation_id: str
    stream: str
    data: bytes
    skipped: int = 0


class OutputReader:
    """One stream (``stdout`` or ``stderr``) of the task of ``allocation_id`` on
    ``node``, from ``offset`` on. Iterating yields :class:`OutputPiece` until the end of
    what the node holds now, or, with ``follow``, until the task ended and all of it was
    read. Afterwards :attr:`task` is the task's state as the node last told it (None: the
    node knows no such task) and :attr:`kept` whether it kept any output of it."""

    def __init__(
        self,
        ask: Ask,
        node: str,
        request_id: str,
        allocation_id: str,
        stream: str = "stdout",
        *,
        follow: bool = False,
        offset: int = 0,
        wait_s: float = FOLLOW_WAIT_S,
    ) -> None:
        self._ask = ask
        self.node = node
        self.request_id = request_id
        self.allocation_id = allocation_id
        self.stream = stream
        self.follow = follow
        self.offset = offset
        self._wait_s = wait_s
        self.task: TaskReport | None = None
        self.kept = True
        #: the task ended and every byte of the stream was read (or skipped)
        self.ended = False
        self._stopped = threading.Event()

    def stop(self) -> None:
        """End a following reader at its next answer (or its next wait for one)."""
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _query(self) -> concurrent.futures.Future[TaskOutput]:
        wait_s = self._wait_s if self.follow else 0.0
        return self._ask(
            self.node, self.request_id, self.allocation_id, self.stream, self.offset, wait_s
        )

    def _answer_wait_s(self) -> float:
        return (self._wait_s if self.follow else 0.0) + ANSWER_GRACE_S

    def _take(self, answer: TaskOutput, target: list[int]) -> tuple[OutputPiece | None, bool]:
        """The piece ``answer`` carries, and whether the reading is over."""
        self.task = answer.task
        self.kept = answer.kept
        piece = None
        if answer.data or answer.skipped:
            piece = OutputPiece(
                self.node, self.allocation_id, self.stream, answer.data, answer.skipped
            )
        self.offset = answer.offset + len(answer.data)
        if answer.ended:
            self.ended = True
            return piece, True
        if not self.follow:
            if not target:
                target.append(answer.size)  # what the node holds now: read up to there
            return piece, self.offset >= target[0]
        return piece, self._stopped.is_set()

    def __iter__(self) -> Iterator[OutputPiece]:
        target: list[int] = []
        silent = False
        while not self._stopped.is_set():
            future = self._query()
            try:
                answer = future.result(timeout=self._answer_wait_s())
            except concurrent.futures.TimeoutError:
                future.cancel()  # given up: its requestor lets go of it
                if not self.follow:
                    raise OutputUnreachable(
                        f"node {self.node} did not answer for the output of {self.allocation_id}"
                    ) from None
                if not silent:  # said once per silence; a node restarting answers later
                    log.warning("node %s does not answer for the output of %s; still asking",
                                self.node, self.allocation_id)  # fmt: skip
                silent = True
                continue
            silent = False
            piece, over = self._take(answer, target)
            if piece is not None:
                yield piece
            if over:
                return

    async def __aiter__(self) -> AsyncIterator[OutputPiece]:
        target: list[int] = []
        while not self._stopped.is_set():
            future = self._query()
            try:
                answer = await asyncio.wait_for(
                    asyncio.wrap_future(future), timeout=self._answer_wait_s()
                )
            except TimeoutError:
                if not self.follow:
                    raise OutputUnreachable(
                        f"node {self.node} did not answer for the output of {self.allocation_id}"
                    ) from None
                continue
            piece, over = self._take(answer, target)
            if piece is not None:
                yield piece
            if over:
                return


def merged(readers: Iterable[OutputReader]) -> Iterator[OutputPiece]:
    """The pieces of several readers as they come, each reader's in order (a thread per
    reader). Closing the iterator early stops the readers."""
    readers = list(readers)
    if len(readers) == 1:
        yield from readers[0]
        return
    pieces: queue.Queue[OutputPiece | BaseException | None] = queue.Queue()

    def pump(reader: OutputReader) -> None:
        try:
            for piece in reader:
                pieces.put(piece)
        except BaseException as error:  # handed to the consumer, raised there
            pieces.put(error)
        else:
            pieces.put(None)

    threads = [
        threading.Thread(target=pump, args=(r,), name=f"output-{r.allocation_id}", daemon=True)
        for r in readers
    ]
    for thread in threads:
        thread.start()
    running = len(threads)
    try:
        while running:
            item = pieces.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for reader in readers:
            reader.stop()
