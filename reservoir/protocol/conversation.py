"""One placement conversation's state, and the table of its phases.

A conversation is everything a requestor knows about placing one request id: the offers it
holds, the awards it is waiting on, the allocations placed, what it has tried. Its
``phase`` changes only through :meth:`Conversation.enter`, which follows
:data:`TRANSITIONS`; an event the table does not allow in the current phase is a bug in
the machine and raises :class:`ProtocolBug` (as h11's ``_state.py`` does).

    phase          what is going on                          events that leave it
    NEW            nothing sent yet                          PROBE, BROADCAST, BACK_OFF (a
                                                             keeper's sample is awaited),
                                                             CLAIM (a caller-chosen id)
    CLAIMING       the id is claimed, then looked up,        PROBE, BROADCAST, BACK_OFF
                   before any node is asked                  (claimed elsewhere), FOLLOW
                                                             (another's placement found)
    PROBING        the request is out to sampled nodes,      PROBE (next round), BROADCAST
                   each of which answers                     (the exhaustive step), AWARD,
                                                             BACK_OFF, FOLLOW
    BROADCASTING   the request is out on a tier topic        BROADCAST (widen), AWARD,
                   (the exhaustive step)                     BACK_OFF, FOLLOW, PROBE (nodes
                                                             that declined and told of more
                                                             room since, before a failure)
    AWARDING       awards are out; the pool holds the spares AWARD (a spare fills a gap),
                                                             PROBE, BROADCAST (nothing held
                                                             fills it), BACK_OFF, FOLLOW
    BACKING_OFF    waiting to ask again: nodes were busy, a  PROBE (the busy nodes),
                   requestor with precedence goes first, or  BROADCAST, AWARD (a late offer
                   the id is claimed elsewhere               fills the gap), BACK_OFF, FOLLOW,
                                                             CLAIM (claimed elsewhere: again)
    FOLLOWING      another requestor owns the placement: we  BACK_OFF (until the owner is
                   look the id up until it is whole          done), PROBE, BROADCAST (the
                                                             owner let go), AWARD

A claim is asked for only first or after a pause, never mid-conversation; nothing is
awarded before anything is asked; and following goes on through a pause (BACK_OFF, then
FOLLOW), never from FOLLOWING itself. An event in a phase that does not list it is a
:class:`ProtocolBug` (tests/unit/test_conversation_table.py provokes each one).

Any phase may end in a placement or a failure; the conversation is then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from reservoir.protocol.contention import IdContention
from reservoir.protocol.effects import CancelTimer, Effect, SetTimer
from reservoir.protocol.errors import ProtocolBug
from reservoir.protocol.messages import NO_FEATURES, Decline, Offer
from reservoir.protocol.placement import PlacedAllocation, PlacementRequest
from reservoir.protocol.policies import Candidate
from reservoir.protocol.timers import PER_ATTEMPT, ConversationTimer, TimerKind

__all__ = ["TRANSITIONS", "Awarded", "Conversation", "Event", "Held", "Phase", "ProtocolBug"]


class Phase(Enum):
    # Members are singletons compared by identity: hashed so too, in C, rather than by
    # Enum's Python-level hash of the name (a call per lookup, several per placement).
    __hash__ = object.__hash__

    NEW = "new"
    CLAIMING = "claiming"
    PROBING = "probing"
    BROADCASTING = "broadcasting"
    AWARDING = "awarding"
    BACKING_OFF = "backing off"
    FOLLOWING = "following"


class Event(Enum):
    __hash__ = object.__hash__  # as Phase's

    #: the request was sent to sampled nodes (or busy nodes), each alone
    PROBE = "probe"
    #: the request was published on a tier topic
    BROADCAST = "broadcast"
    #: awards were sent
    AWARD = "award"
    #: a retry timer was set instead of asking again now
    BACK_OFF = "back off"
    #: a Lookup went out to follow another requestor's placement
    FOLLOW = "follow"
    #: the id's claim was asked for
    CLAIM = "claim"


_TARGET: Final = {
    Event.PROBE: Phase.PROBING,
    Event.BROADCAST: Phase.BROADCASTING,
    Event.AWARD: Phase.AWARDING,
    Event.BACK_OFF: Phase.BACKING_OFF,
    Event.FOLLOW: Phase.FOLLOWING,
    Event.CLAIM: Phase.CLAIMING,
}

#: phase -> the events the machine may take in it; each event leads to one phase
#: (``_TARGET``). Every pair listed is one a path of the machine takes (the comment names
#: it); any other is a bug in the machine, and :meth:`Conversation.enter` raises.
TRANSITIONS: Final[dict[Phase, frozenset[Event]]] = {
    # place(): ask (a keeper's sample awaited: back off), or claim a caller-chosen id
    Phase.NEW: frozenset({Event.PROBE, Event.BROADCAST, Event.BACK_OFF, Event.CLAIM}),
    # the claim's answer, or its lookup's end: ask, or follow the placement it found;
    # refused, back off. Nothing is held yet to award, and the claim is asked for already
    Phase.CLAIMING: frozenset({Event.PROBE, Event.BROADCAST, Event.BACK_OFF, Event.FOLLOW}),
    # the answers decide: award, widen (the next round, the exhaustive step, a recheck of
    # nodes with more room), stand back or back off, or follow another's placement
    Phase.PROBING: frozenset(
        {Event.PROBE, Event.BROADCAST, Event.AWARD, Event.BACK_OFF, Event.FOLLOW}
    ),
    Phase.BROADCASTING: frozenset(
        {Event.PROBE, Event.BROADCAST, Event.AWARD, Event.BACK_OFF, Event.FOLLOW}
    ),
    # a refusal or an award given up: a spare fills the gap (award), else ask again, or
    # stand back, or follow; a late offer fills a gap (award)
    Phase.AWARDING: frozenset(
        {Event.PROBE, Event.BROADCAST, Event.AWARD, Event.BACK_OFF, Event.FOLLOW}
    ),
    # the retry timer: the busy nodes (probe), from the roster or every node, the claim
    # again, follow, or wait for a keeper's sample (back off); a late offer that fills
    # the gap (award), or one another requestor with precedence makes us let go
    Phase.BACKING_OFF: frozenset(
        {Event.PROBE, Event.BROADCAST, Event.AWARD, Event.BACK_OFF, Event.FOLLOW, Event.CLAIM}
    ),
    # a lookup's end: the owner let go (ask again: probe, broadcast, or wait for a keeper's
    # sample), or the deferred decision (award, or stand back until the owner is done,
    # after which the retry follows again: following never follows from here directly)
    Phase.FOLLOWING: frozenset({Event.PROBE, Event.BROADCAST, Event.AWARD, Event.BACK_OFF}),
}

#: the phases in which answers to an attempt are being gathered
COLLECTING: Final = frozenset({Phase.PROBING, Phase.BROADCASTING})


@dataclass
class Held:
    """An offer held: its reservation is ours until it is awarded, released or expires."""

    offer: Offer
    usable_until: float

    def candidate(self) -> Candidate:
        o = self.offer
        return Candidate(o.reservation_id, o.sender, o.slots, o.utilisation, o.score)


@dataclass
class Awarded:
    """An award sent and not yet answered."""

    offer: Offer
    slots: int
    first_sent_at: float
    last_sent_at: float


@dataclass
class Conversation:
    request_id: str
    spec: PlacementRequest
    started_at: float
    deadline: float
    ttl_s: float
    #: instances we settle for: count, or fewer once a partial placement is decided
    target: int
    contention: IdContention
    #: the wall-clock time the requestor was asked (seconds since the epoch), sent with
    #: every award: of two placements of one id, the later one stands
    requested_at_s: float = 0.0
    #: the latest ``requested_at_s`` among the allocations placed so far (adopted ones
    #: carry their own placement's; set with the first): the finished placement's
    placed_at_s: float = 0.0
    phase: Phase = Phase.NEW
    tier_index: int = 0
    attempt: int = 0
    broadcast_at: float = 0.0
    collect_timer_set: bool = False
    busy_rounds: int = 0
    #: rounds over every tier in which no node answered at all (see ``Deciding.start_over``)
    unheard_rounds: int = 0
    #: answers from nodes (offers, declines, acceptances, refusals, "already placed")
    #: since the conversation began, and how many of them came before the current pass
    answers: int = 0
    answers_before_pass: int = 0
    pool: dict[str, Held] = field(default_factory=dict)
    awards: dict[str, Awarded] = field(default_factory=dict)
    placed: dict[str, PlacedAllocation] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    #: awards given up on: their allocations, should any turn up, are freed
    abandoned: set[str] = field(default_factory=set)
    tiers_tried: list[int] = field(default_factory=list)
    offers_received: int = 0
    declines: dict[str, Decline] = field(default_factory=dict)
    #: busy nodes (name -> address), asked again alone after a back-off
    busy_nodes: dict[str, str] = field(default_factory=dict)
    group_hosts: dict[str, int] = field(default_factory=dict)
    note: str = ""
    #: still sampling from the roster (False: the exhaustive tier broadcast)
    sampling: bool = False
    #: sampling ran and found too little: tier broadcasts ask every node to answer
    exhaustive: bool = False
    probe_round: int = 0
    #: how often sampling came up short and waited for a keeper's sample of nodes with room
    sample_waits: int = 0
    #: the nodes that declined and told of more room since were asked again (once)
    rooms_rechecked: bool = False
    #: every node probed so far, not to be probed again by a later round
    probed: set[str] = field(default_factory=set)
    #: probed nodes whose answer to the current attempt is still due
    expected: set[str] = field(default_factory=set)
    #: the caller's trace context (W3C traceparent), carried on requests and awards
    traceparent: str | None = None
    #: the features the request uses (``ReservationRequest.needs``): only nodes that say
    #: they know them are probed
    needs: frozenset[str] = NO_FEATURES
    #: the timers set and not yet fired or cancelled, by kind (the latest of each kind)
    armed: dict[TimerKind, ConversationTimer] = field(default_factory=dict)

    def enter(self, event: Event) -> None:
        if event not in TRANSITIONS[self.phase]:
            raise ProtocolBug(f"{self.request_id}: {event.value} is not allowed {self.phase.value}")
        self.phase = _TARGET[event]

    def set_timer(self, kind: TimerKind, at: float, effects: list[Effect]) -> None:
        """Arm the conversation's timer of ``kind`` (one per kind: a later one replaces
        it), keyed by the attempt for the kinds that belong to one."""
        attempt = self.attempt if kind in PER_ATTEMPT else 0
        key = self.armed[kind] = ConversationTimer(self.request_id, kind, attempt)
        effects.append(SetTimer(key, at))

    def cancel_timer(self, kind: TimerKind, effects: list[Effect]) -> None:
        """Cancel the conversation's timer of ``kind``, if one is armed. Only armed timers
        are cancelled: a conversation cancels its collect and widen timers at every
        attempt and all six kinds when it ends, and a cancel for a timer never set was
        an effect (and a driver operation) for nothing, ten of them per placement."""
        key = self.armed.pop(kind, None)
        if key is not None:
            effects.append(CancelTimer(key))

    def new_attempt(self, now: float, effects: list[Effect]) -> None:
        """The request goes out again: the last attempt's windows close, and its answers
        no longer count as this one's."""
        self.cancel_timer(TimerKind.COLLECT, effects)
        self.cancel_timer(TimerKind.WIDEN, effects)
        self.attempt += 1
        self.collect_timer_set = False
        self.broadcast_at = now
        self.expected.clear()

    @property
    def collecting(self) -> bool:
        return self.phase in COLLECTING

    def heard_answer(self) -> None:
        self.answers += 1

    def start_pass(self) -> None:
        """The request is asked anew (a retry after a pause, a gap left by an award): what
        comes of it is judged by the answers to it alone."""
        self.answers_before_pass = self.answers

    def heard_in_pass(self) -> bool:
        """Whether any node answered since the request was last asked anew. What nodes
        said before is no verdict on this pass: a successor of a killed requestor heard
        of its reservation, then an outage silenced every node, and failing then left
        the dead one's late award allocated to nobody (found by ``reservoir chaos``)."""
        return self.answers > self.answers_before_pass

    def awarded_slots(self) -> int:
        return sum(a.slots for a in self.awards.values())

    def needed(self) -> int:
        return self.target - len(self.placed) - self.awarded_slots()
