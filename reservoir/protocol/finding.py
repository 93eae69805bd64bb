"""Finding: a requestor-side question for "what do the nodes hold of this request id?",
as a small machine with no I/O.

A service answering ``GET``/``DELETE`` for an id it may not have placed (another replica
did, or this process before a restart) asks the nodes, which are the truth. Every node
holding allocations of a *findable* id binds the id's lookup bucket
(:func:`~reservoir.protocol.messages.lookup_topic`), so the question is one ``Lookup`` on
that bucket, sent ``following`` (it contends for nothing: a node answers with what is
placed and never with a reservation's contention):

    find(id)                -> Lookup(following) on the id's bucket, a timer at the wait;
                               a find of an id already being found joins it
    AlreadyPlaced from node -> its allocations are kept; once every allocation expected
                               (the placement the asker remembers, if any) is heard: Found
    the Lookup unroutable   -> no node binds the bucket: nobody holds the id, Found(None)
    the timer               -> Found with what was heard (None: nothing)

A holder that is not reachable when the ``Lookup`` goes out (its inbox and bindings go
with its connection) is not heard: the answer is what the nodes that can be reached hold,
as the protocol's own lookups have it. Nodes do not say how many instances a placement
has, so without an expected placement the find waits the whole wait for holders it has
not heard yet (the asker passes the wait its lookups use).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from reservoir.protocol.effects import CancelTimer, Dropped, Effect, Found, Publish, SetTimer
from reservoir.protocol.messages import (
    AlreadyPlaced,
    Lookup,
    Message,
    check_ids,
    lookup_topic,
)
from reservoir.protocol.placement import PlacedAllocation, Placement

__all__ = ["FindTimer", "Finding"]


@dataclass(frozen=True, slots=True)
class FindTimer:
    """The wait of the find of ``request_id`` is over."""

    request_id: str


@dataclass
class _Find:
    request_id: str
    #: the placement the asker remembers: its allocations, once all heard, end the wait
    expected: Placement | None
    found: dict[str, PlacedAllocation] = field(default_factory=dict)
    requested_at_s: float = 0.0


class Finding:
    """Every find of one asker. Not thread-safe: its driver serialises calls."""

    def __init__(self, *, sender: str, reply_to: str) -> None:
        self._sender = sender
        self._reply_to = reply_to
        self._finds: dict[str, _Find] = {}

    def pending(self) -> int:
        return len(self._finds)

    def lookup(self, request_id: str) -> Lookup:
        """The question for ``request_id``, checked as a node checks it: raises
        :class:`~reservoir.protocol.messages.InvalidField` naming ``request_id`` for an id
        no node would accept (it would be dropped, and the find wait for nothing)."""
        question = Lookup(
            request_id=request_id,
            sender=self._sender,
            reply_to=self._reply_to,
            following=True,
        )
        check_ids(question)
        return question

    def find(
        self,
        request_id: str,
        now: float,
        wait_s: float,
        *,
        expected: Placement | None = None,
    ) -> list[Effect]:
        """Ask the nodes what they hold of ``request_id``, for at most ``wait_s``.
        ``expected``: the placement the asker remembers making under the id; the find ends
        as soon as all of its allocations are reported, and answers with it (as the asker
        knows it: tiers tried, instances requested) when the nodes hold exactly it."""
        if wait_s <= 0:
            raise ValueError(f"a find waits a positive time, not {wait_s!r} s")
        if request_id in self._finds:
            return []  # being found: the caller joins it
        if expected is not None and expected.request_id != request_id:
            raise ValueError(f"expected a placement of {request_id}, not {expected.request_id}")
        question = self.lookup(request_id)
        self._finds[request_id] = _Find(request_id, expected)
        return [
            Publish(lookup_topic(request_id), question),
            SetTimer(FindTimer(request_id), now + wait_s),
        ]

    def handle(self, message: Message, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if not isinstance(message, AlreadyPlaced):
            effects.append(Dropped("unexpected", f"a find does not take {message.kind!r}"))
            return effects
        find = self._finds.get(message.request_id)
        if find is None:
            effects.append(Dropped("late_found", f"{message.request_id} from {message.sender}"))
            return effects
        for info in message.allocations:
            find.found[info.allocation_id] = PlacedAllocation(
                node=message.sender,
                address=message.reply_to,
                allocation_id=info.allocation_id,
                resources=dict(info.resources),
                numa=info.numa,
            )
        find.requested_at_s = max(find.requested_at_s, message.requested_at_s)
        expected = find.expected
        if (
            expected is not None
            and expected.allocations
            and all(a.allocation_id in find.found for a in expected.allocations)
        ):
            self._over(find, effects)
        return effects

    def on_unroutable(self, message: Message, now: float) -> list[Effect]:
        """The ``Lookup`` came back: no node binds the id's bucket, so none holds it."""
        effects: list[Effect] = []
        find = self._finds.get(message.request_id)
        if isinstance(message, Lookup) and find is not None:
            self._over(find, effects)
        else:
            effects.append(Dropped("unroutable", f"{message.kind} for {message.request_id}"))
        return effects

    def on_timer(self, key: object, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if isinstance(key, FindTimer):
            find = self._finds.get(key.request_id)
            if find is not None:
                self._over(find, effects)
        return effects

    def abandon(self) -> list[str]:
        """Forget every find (the asker is closing); the ids whose askers were waiting."""
        ids = list(self._finds)
        self._finds.clear()
        return ids

    def _over(self, find: _Find, effects: list[Effect]) -> None:
        del self._finds[find.request_id]
        effects.append(CancelTimer(FindTimer(find.request_id)))
        effects.append(Found(find.request_id, _placement(find)))


def _placement(find: _Find) -> Placement | None:
    """What the nodes hold, as a placement: the expected one when they hold exactly it."""
    if not find.found:
        return None
    expected = find.expected
    if expected is not None and _same(expected.allocations, find.found.values()):
        return expected
    allocations = tuple(sorted(find.found.values(), key=lambda a: a.allocation_id))
    return Placement(
        request_id=find.request_id,
        allocations=allocations,
        # nodes do not say how many instances were asked for: those held
        requested=len(allocations),
        # nothing of how it was placed is known here
        attempts=0,
        requested_at_s=find.requested_at_s,
    )


def _same(these: Iterable[PlacedAllocation], those: Iterable[PlacedAllocation]) -> bool:
    def key(allocations: Iterable[PlacedAllocation]) -> set[tuple[str, str]]:
        return {(a.node, a.allocation_id) for a in allocations}

    return key(these) == key(those)
