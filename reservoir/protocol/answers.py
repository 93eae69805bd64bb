"""What a requestor answered for caller-chosen ids, for reconciling after a holder's absence.

A node that was away (down, or cut off from the broker) when a retry looked up an id it
holds could not be found, so the retry placed the id again. When such a node is back it
names the lookup buckets of what it holds (``NodeStatus.rejoined_buckets``); the requestor
looks up again every id it answered for in those buckets, and compares what the holders
report with its own answer: of two placements of one id, the one asked for later stands.

:class:`AnsweredIds` is the record that comparison needs: per caller-chosen id this
requestor placed (and may have freed since), when the request behind that placement was
asked for (``requested_at_s``, the wall clock), indexed by
lookup bucket. A placement that was freed stays recorded: an earlier placement that turns
up afterwards is an orphan all the same. A failure is not recorded: it supersedes nothing,
and a placement found afterwards may be one another requestor handed out. Bounded like
the requestor's memory of placements (``remember_finished``): the oldest are forgotten
first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from reservoir.protocol.messages import lookup_bucket

__all__ = ["AnsweredIds"]


class AnsweredIds:
    """Caller-chosen ids placed, when their placements were asked for, by lookup bucket."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._at_s: OrderedDict[str, float] = OrderedDict()
        self._by_bucket: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self._at_s)

    def answered(self, request_id: str, requested_at_s: float) -> None:
        """Record (or renew) the answer for ``request_id``, asked for at ``requested_at_s``."""
        if request_id not in self._at_s:
            self._by_bucket.setdefault(lookup_bucket(request_id), set()).add(request_id)
        self._at_s[request_id] = requested_at_s
        self._at_s.move_to_end(request_id)
        while len(self._at_s) > self.capacity:
            forgotten, _ = self._at_s.popitem(last=False)
            self._unindex(forgotten)

    def requested_at_s(self, request_id: str) -> float | None:
        """When the request behind our answer for ``request_id`` was asked for (None: no
        answer of ours on record)."""
        return self._at_s.get(request_id)

    def in_buckets(self, buckets: Iterable[int]) -> set[str]:
        """The ids answered whose lookup bucket is among ``buckets``."""
        found: set[str] = set()
        for bucket in buckets:
            found.update(self._by_bucket.get(bucket, ()))
        return found

    def _unindex(self, request_id: str) -> None:
        bucket = lookup_bucket(request_id)
        ids = self._by_bucket[bucket]
        ids.discard(request_id)
        if not ids:
            del self._by_bucket[bucket]
