"""Events due in a later second of virtual time, kept out of the event heap until then.

This module owns :class:`LaterSeconds`, the second level of both engines' event queues.
A run at 100,000 nodes has about a hundred thousand instance departures pending at any
moment (an hour's lifetimes), against a few thousand timers and messages due within
seconds. In one heap, every push and pop of a message climbs past the departures: log2 of
a hundred thousand levels, each a comparison that misses the cache. Here an event due in
a later whole second than the current time waits in that second's bucket, a plain list,
and one *marker* event in the heap stands for the bucket; when the marker comes out, the
bucket's events go into the heap.

The order of events is exactly the one-heap order: every entry keeps its ``(time,
sequence)`` key, a bucket's events are all due at or after its second, and its marker
``(second, -1)`` comes out before any event due at that second or later (sequences are
positive). Pushing straight into the heap is always correct; only deferral needs the rule
that a bucket's second is still to come, which :meth:`LaterSeconds.push` checks.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

__all__ = ["LaterSeconds"]

Entry = tuple[Any, ...]


class LaterSeconds:
    """One bucket of entries per whole second of virtual time, each with a marker in
    ``heap``. ``marker(second)`` makes the engine's marker entry: ``(float(second), -1,
    <the engine's spill code>, ...)``, the same shape as its other entries."""

    __slots__ = ("_buckets", "_heap", "_marker")

    def __init__(self, heap: list[Any], marker: Callable[[int], Entry]) -> None:
        self._heap = heap
        self._marker = marker
        self._buckets: dict[int, list[Entry]] = {}

    def push(self, entry: Entry, now: float) -> None:
        """Add ``entry`` (due at ``entry[0]``, not before ``now``): into the heap when it
        is due within the current second, else into its second's bucket."""
        second = math.floor(entry[0])
        if second <= now:  # this second's bucket, if it had one, is in the heap already
            heapq.heappush(self._heap, entry)
            return
        bucket = self._buckets.get(second)
        if bucket is None:
            self._buckets[second] = [entry]
            heapq.heappush(self._heap, self._marker(second))
        else:
            bucket.append(entry)

    def spill(self, second: int) -> None:
        """The marker of ``second`` came out of the heap: its entries go in."""
        heap = self._heap
        push = heapq.heappush
        for entry in self._buckets.pop(second):
            push(heap, entry)

    def __len__(self) -> int:
        """Entries waiting in buckets (not yet in the heap)."""
        return sum(len(bucket) for bucket in self._buckets.values())
