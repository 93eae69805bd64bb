"""Request-id contention: one conversation's machine for "is this id placed, or being
placed, by someone else?".

A caller-chosen request id may have been placed before (a retry, a restarted requestor) or
be in flight at another requestor right now. The conversation claims the id first (a key
the broker lets one requestor hold at a time), then looks it up (``Lookup`` on the id's
topic) before it asks any node; while the claim holds and that lookup found nobody, no
other requestor can be placing the id, nor have placed it, so it decides without looking
up again. Otherwise it looks the id up before every decision, and learns of other
requestors from nodes:

    event                                    -> what this machine does
    the caller chose the id                  -> claims it, or looks up before every decision
    the claim is held, and the lookup after  -> exclusive: no lookup before deciding, as
    it came back unroutable                     long as the claim holds (and no node tells
                                                of another requestor)
    the claim is refused                     -> another requestor is placing it: claim
                                                again after a pause (its placement is then
                                                found by the lookup, and adopted)
    the claim is lost (the connection went), -> looks up before every decision
    or the broker cannot claim
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

__all__ = ["ClaimState", "IdContention", "LookupOutcome"]


class ClaimState(Enum):
    #: not claimed: a generated id, a broker that cannot claim, or a claim lost
    NONE = "none"
    #: the broker is asked
    ASKED = "asked"
    #: held: no other requestor can hold it until we let go or our connection goes
    HELD = "held"
    #: another requestor holds it: asked again after a pause
    REFUSED = "refused"


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
    #: the id's claim (see the module docstring)
    claim: ClaimState = ClaimState.NONE
    #: the lookup sent once the claim was held came back unroutable, and no node has told
    #: of another requestor since: nobody holds anything of the id but us
    clear: bool = False

    # -- the claim ---------------------------------------------------------------------

    def exclusive(self) -> bool:
        """Whether no other requestor can be placing the id, nor have placed it: the
        claim holds, and nobody held anything of it when it was looked up under it."""
        return self.claim is ClaimState.HELD and self.clear

    def claim_lost(self) -> None:
        """The connection the claim was held on went (and the claim with it): another
        requestor may claim the id now, so look up before every decision again."""
        if self.claim is ClaimState.HELD:
            self.claim = ClaimState.NONE
            self.clear = False

    # -- lookups -----------------------------------------------------------------------

    def must_look_up(self, attempt: int) -> bool:
        """Whether a decision on ``attempt`` needs a Lookup sent after its offers: not
        while the id is ours alone (:meth:`exclusive`)."""
        return self.looks_up and self.confirmed_attempt != attempt and not self.exclusive()

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
        self.clear = False
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
        if not ours:
            self.clear = False
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
