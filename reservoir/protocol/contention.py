"""Request-id contention: one conversation's machine for "is this id placed, or being
placed, by someone else?".

A caller-chosen request id may have been placed before (a retry, a restarted requestor) or
be in flight at another requestor right now. The conversation looks the id up before it
decides (``Lookup`` on the id's bucket), and learns of other requestors from nodes:

    event                                    -> what this machine does
    the caller chose the id                  -> looks up before every decision
    node: in_flight_elsewhere from X         -> looks up from now on; X sorts before us:
                                                X has precedence (stand back while we own
                                                nothing of the id); either way the id is
                                                contended until X's reservation must have
                                                expired: no failure verdict before then
    node: AlreadyPlaced, owner X (not us)    -> the allocation is adopted; X finishes the
                                                request: we follow (look up, contend for
                                                nothing) until the placement is whole
    a Lookup went out                        -> decisions wait until its answers are due
    the Lookup's wait is over                -> following, and nobody said "placed" again:
                                                the owner let go (OWNER_GONE, place it
                                                ourselves); else a deferred decision runs
                                                (DECIDE); else nothing
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["IdContention", "LookupOutcome"]


class LookupOutcome(Enum):
    NOTHING = "nothing"
    #: a decision was deferred until the lookup was over: take it now
    DECIDE = "decide"
    #: we were following another requestor's placement, and nobody holds any of it now
    OWNER_GONE = "owner gone"


@dataclass
class IdContention:
    """What one conversation knows of other requestors placing its id."""

    #: this requestor's id: precedence goes to the id that sorts first
    me: str
    #: look the id up before deciding: the caller chose it, or another requestor was seen
    #: placing it too
    looks_up: bool = False
    #: while a Lookup may still be answered, awards and failure wait
    lookup_until: float | None = None
    decision_due: bool = False
    #: the attempt whose decision a Lookup sent after its offers has cleared
    confirmed_attempt: int = 0
    #: requestors with precedence that are placing the same id
    yield_to: set[str] = field(default_factory=set)
    #: another requestor owns allocations of this id: it finishes, we only look up
    following: str | None = None
    #: a node said "already placed" since the last lookup went out
    heard_placed: bool = False
    #: allocations nodes reported as placed already (AlreadyPlaced), not awarded by us
    adopted: set[str] = field(default_factory=set)
    #: until when another requestor's reservation of the id may still be alive: it may
    #: yet become an allocation we must adopt, or expire and leave the room to us
    contended_until: float | None = None

    # -- lookups -----------------------------------------------------------------------

    def must_look_up(self, attempt: int) -> bool:
        """Whether a decision on ``attempt`` needs a Lookup sent after its offers."""
        return self.looks_up and self.confirmed_attempt != attempt

    def looking_up(self) -> bool:
        return self.lookup_until is not None

    def lookup_sent(self, attempt: int, until: float, *, following: bool = False) -> None:
        self.lookup_until = until
        self.decision_due = True
        if following:
            self.heard_placed = False
        else:
            self.confirmed_attempt = attempt

    def lookup_over(self) -> LookupOutcome:
        self.lookup_until = None
        if self.following is not None and not self.heard_placed:
            self.following = None
            self.decision_due = False
            return LookupOutcome.OWNER_GONE
        if self.decision_due:
            self.decision_due = False
            return LookupOutcome.DECIDE
        return LookupOutcome.NOTHING

    # -- other requestors --------------------------------------------------------------

    def in_flight_elsewhere(self, other: str, *, alive_until: float) -> None:
        """A node holds a reservation of the id for ``other`` too, which may live until
        ``alive_until``."""
        self.looks_up = True
        if other < self.me:
            self.yield_to.add(other)
        if self.contended_until is None or alive_until > self.contended_until:
            self.contended_until = alive_until

    def contended(self, now: float) -> bool:
        """Whether another requestor's reservation of the id may still be alive (then a
        failure would be no verdict on the request: the other may place it, or its
        reservation expire and free the room)."""
        return self.contended_until is not None and now < self.contended_until

    def placed_already(self, allocation_id: str, owner: str | None, ours: bool) -> None:
        """A node reports an allocation of the id that we did not award."""
        self.adopted.add(allocation_id)
        self.heard_placed = True
        if not ours and owner is not None:
            self.following = owner

    def defers_to_others(self) -> bool:
        """Another requestor has precedence, or owns part of the placement."""
        return bool(self.yield_to) or self.following is not None

    def stand_back(self) -> str:
        """We let the others go first: who they are (and forget the precedence claims:
        after the pause we ask again and hear what became of them)."""
        others = sorted(self.yield_to | ({self.following} if self.following else set()))
        self.yield_to.clear()
        return f"the same request id is being placed by {', '.join(others)}"
