"""Finding: a requestor-side question for "what do the nodes hold of this request id?",
as a small machine with no I/O.

A service answering ``GET``/``DELETE`` for an id it may not have placed (another replica
did, or this process before a restart) asks the nodes, which are the truth. Every node
holding something of a *findable* id (a reservation, an allocation, the task of one)
binds the id's own lookup topic (:func:`~reservoir.protocol.messages.lookup_topic`)
before it offers, so the question is one ``Lookup`` on that topic, sent ``following``
(it contends for nothing), and the answer is a fact rather than a wait:

    find(id)                  -> Lookup(following) on the id's topic, a timer at the
                                 deadline; a find of an id already being found joins it
    the Lookup unroutable     -> no node holds anything of the id: settled, nothing held
    AlreadyPlaced from a node -> its allocations and tasks kept, and the placement's size
                                 (``instances``); once the instances heard reach the
                                 size: settled, what was heard
    Decline in_flight from X  -> a node holds X's reservation of the id: X is placing it
                                 (kept; the find goes on, an answer may complete it)
    the deadline              -> not settled: what was heard, and who was placing it

Settled means every holder answered: each holder says how many instances the placement
has in all, so the asker knows when it has heard them all; and a ``Lookup`` nobody binds
comes back, so "nobody holds it" is known at once. The deadline says nothing of the id:
a find it ends is *not settled* (a holder slow to answer, or a placement in flight), and
its asker must say "not known yet", never "not found".

A holder that is not reachable when the ``Lookup`` goes out (its inbox and bindings go
with its connection) is not heard: the answer is what the nodes that can be reached hold,
as the protocol's own lookups have it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reservoir.protocol.effects import CancelTimer, Dropped, Effect, Found, Publish, SetTimer
from reservoir.protocol.messages import (
    IN_FLIGHT_ELSEWHERE,
    AlreadyPlaced,
    Decline,
    Lookup,
    Message,
    TaskState,
    check_ids,
    lookup_topic,
)
from reservoir.protocol.placement import Holdings, PlacedAllocation, Placement

__all__ = ["FindTimer", "Finding"]


@dataclass(frozen=True, slots=True)
class FindTimer:
    """The deadline of the find of ``request_id`` has come."""

    request_id: str


@dataclass
class _Find:
    request_id: str
    #: the placement the asker remembers: the answer when the nodes hold exactly it
    expected: Placement | None
    found: dict[str, PlacedAllocation] = field(default_factory=dict)
    tasks: dict[tuple[str, str], TaskState] = field(default_factory=dict)
    requested_at_s: float = 0.0
    #: the fewest instances a holder said the placement has (0: none said)
    instances: int = 0
    placing: str | None = None

    def heard_instances(self) -> int:
        return len(self.found.keys() | {allocation for _node, allocation in self.tasks})

    def complete(self) -> bool:
        """Every holder has answered: the instances heard reach the placement's size.
        (The size only shrinks, so the fewest said is the final one once its holder
        answered, and until then more are awaited.)"""
        if self.instances:
            return self.heard_instances() >= self.instances
        expected = self.expected
        # nodes of an earlier release say no size: the remembered placement says it
        return (
            expected is not None
            and bool(expected.allocations)
            and all(a.allocation_id in self.found for a in expected.allocations)
        )


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
        deadline_s: float,
        *,
        expected: Placement | None = None,
    ) -> list[Effect]:
        """Ask the nodes what they hold of ``request_id``; after ``deadline_s`` the find
        ends unsettled. ``expected``: the placement the asker remembers making under the
        id, the answer (as the asker knows it: tiers tried, instances requested) when the
        nodes hold exactly it."""
        if deadline_s <= 0:
            raise ValueError(f"a find waits a positive time, not {deadline_s!r} s")
        if request_id in self._finds:
            return []  # being found: the caller joins it
        if expected is not None and expected.request_id != request_id:
            raise ValueError(f"expected a placement of {request_id}, not {expected.request_id}")
        question = self.lookup(request_id)
        self._finds[request_id] = _Find(request_id, expected)
        return [
            Publish(lookup_topic(request_id), question),
            SetTimer(FindTimer(request_id), now + deadline_s),
        ]

    def handle(self, message: Message, now: float) -> list[Effect]:
        effects: list[Effect] = []
        find = self._finds.get(message.request_id)
        if isinstance(message, AlreadyPlaced) and find is not None:
            self._heard_placed(find, message)
            if find.complete():
                self._over(find, effects, settled=True)
        elif isinstance(message, Decline) and find is not None:
            placing = next(
                (r.subject for r in message.reasons if r.code == IN_FLIGHT_ELSEWHERE), None
            )
            if placing is None:
                effects.append(Dropped("unexpected", f"a find does not take {message!r}"))
            else:
                find.placing = placing
        elif isinstance(message, AlreadyPlaced | Decline):
            effects.append(Dropped("late_found", f"{message.request_id} from {message.sender}"))
        else:
            effects.append(Dropped("unexpected", f"a find does not take {message.kind!r}"))
        return effects

    def on_unroutable(self, message: Message, now: float) -> list[Effect]:
        """The ``Lookup`` came back: no node binds the id's topic, so none holds it."""
        effects: list[Effect] = []
        find = self._finds.get(message.request_id)
        if isinstance(message, Lookup) and find is not None:
            self._over(find, effects, settled=True)
        else:
            effects.append(Dropped("unroutable", f"{message.kind} for {message.request_id}"))
        return effects

    def on_timer(self, key: object, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if isinstance(key, FindTimer):
            find = self._finds.get(key.request_id)
            if find is not None:
                self._over(find, effects, settled=False)
        return effects

    def abandon(self) -> list[str]:
        """Forget every find (the asker is closing); the ids whose askers were waiting."""
        ids = list(self._finds)
        self._finds.clear()
        return ids

    def _heard_placed(self, find: _Find, message: AlreadyPlaced) -> None:
        for info in message.allocations:
            find.found[info.allocation_id] = PlacedAllocation(
                node=message.sender,
                address=message.reply_to,
                allocation_id=info.allocation_id,
                resources=dict(info.resources),
                numa=info.numa,
            )
        for task in message.tasks:
            find.tasks[(message.sender, task.allocation_id)] = TaskState(
                request_id=message.request_id,
                sender=message.sender,
                reply_to=message.reply_to,
                allocation_id=task.allocation_id,
                state=task.state,
                driver=task.driver,
                exit_code=task.exit_code,
                reason=task.reason,
                limits=task.limits,
                kept=task.kept,
                answering=True,
            )
        find.requested_at_s = max(find.requested_at_s, message.requested_at_s)
        if message.instances:
            find.instances = min(find.instances or message.instances, message.instances)

    def _over(self, find: _Find, effects: list[Effect], *, settled: bool) -> None:
        del self._finds[find.request_id]
        effects.append(CancelTimer(FindTimer(find.request_id)))
        holdings = Holdings(
            request_id=find.request_id,
            placement=_placement(find),
            tasks=tuple(find.tasks[key] for key in sorted(find.tasks)),
            settled=settled,
            placing=find.placing,
        )
        effects.append(Found(find.request_id, holdings))


def _placement(find: _Find) -> Placement | None:
    """What the nodes hold, as a placement: the expected one when they hold exactly it."""
    if not find.found:
        return None
    expected = find.expected
    if expected is not None and {(a.node, a.allocation_id) for a in expected.allocations} == {
        (a.node, a.allocation_id) for a in find.found.values()
    }:
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
