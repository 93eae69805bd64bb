"""Lookups: what a requestor does with the answers about a request id, rather than
about a request.

A caller-chosen id may be placed, before or meanwhile, by another requestor (the rules
are :mod:`reservoir.protocol.contention`'s). :class:`Lookups` takes the broker's answer to
the id's claim, the end of a lookup's wait (or its coming back unroutable: nobody holds
the id), and a node back holding ids of some lookup buckets, and carries on the
conversation: ask the nodes, decide a deferred decision, place the id afresh once the
requestor we followed let go, or look an id up again.
"""

from __future__ import annotations

from reservoir.protocol.contention import ClaimState, LookupOutcome
from reservoir.protocol.conversation import Conversation, Phase
from reservoir.protocol.effects import Effect, Publish, Unclaim
from reservoir.protocol.messages import Lookup, buckets_in, lookup_bucket, lookup_topic
from reservoir.protocol.requestor_asking import Asking
from reservoir.protocol.requestor_deciding import Deciding
from reservoir.protocol.requestor_state import RequestorState

__all__ = ["Lookups"]


class Lookups:
    """The id's claim and lookups, over the machine's shared state."""

    def __init__(self, state: RequestorState, asking: Asking, deciding: Deciding) -> None:
        self.state = state
        self.config = state.config
        self.asking = asking
        self.deciding = deciding

    def on_claim(
        self, request_id: str, held: bool | None, now: float, effects: list[Effect]
    ) -> None:
        """The broker's answer to a conversation's claim (see
        :meth:`~reservoir.protocol.requestor.RequestorMachine.on_claim`)."""
        c = self.state.active.get(request_id)
        if c is None or c.contention.claim is not ClaimState.ASKED:
            if held:
                effects.append(Unclaim(request_id))  # over meanwhile: nobody needs it
            return
        if held is None:
            c.contention.claim = ClaimState.NONE
            self.asking.broadcast(c, now, effects)
        elif held:
            c.contention.claim = ClaimState.HELD
            self.state.claims_held += 1
            # Nobody else can start placing the id now; has anyone placed it before, or
            # is a requestor that lost its claim still at it? Asked before any node holds
            # anything of ours, so that an unroutable answer means "nobody".
            self.asking.send_lookup(c, now, effects, following=False)
        else:
            c.contention.claim = ClaimState.REFUSED
            c.note = "the same request id is being placed by another requestor"
            self.deciding.back_off(c, now, effects)

    def claims_lost(self) -> None:
        """The broker connection went and came back: every claim held went with it."""
        for c in self.state.active.values():
            if c.contention.claim is ClaimState.HELD:
                c.contention.claim_lost()
        self.state.claims_held = 0

    def unroutable(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """The conversation's Lookup reached no node: nobody holds anything of the id."""
        if c.phase is Phase.CLAIMING:
            # asked under the claim, before any node held anything of ours
            c.contention.clear = c.contention.claim is ClaimState.HELD
        self.lookup_over(c, now, effects)

    def lookup_over(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Every holder of the id could have answered the conversation's Lookup."""
        outcome = c.contention.lookup_over()
        if c.phase is Phase.CLAIMING:
            # The lookup under the claim is over: ask the nodes (or follow the placement
            # it found, whose holders answered "already placed").
            self.asking.broadcast(c, now, effects)
            return
        if outcome is LookupOutcome.OWNER_GONE:
            # Nobody holds any of it any more: the owner failed and let go. Place it
            # ourselves, from scratch.
            for allocation_id in c.contention.adopted:
                c.placed.pop(allocation_id, None)
            c.contention.adopted.clear()
            c.start_pass()
            self.asking.broadcast(c, now, effects)
        elif outcome is LookupOutcome.DECIDE:
            self.deciding.decide(c, now, effects)

    def look_up_again(self, bitmap: bytes, effects: list[Effect]) -> None:
        """A node is back holding caller-chosen ids of these buckets. While it was away, a
        lookup could not find them: one of them may have been placed again, by us. Look
        up each id we placed there (freed since or not), and each one in flight (its own
        lookup may be behind it); a node holding an earlier placement of it answers
        ``AlreadyPlaced``, and :meth:`Settling.on_accepted
        <reservoir.protocol.requestor_settling.Settling.on_accepted>` frees that or adopts
        it."""
        buckets = set(buckets_in(bitmap))
        ids = self.state.answers.in_buckets(buckets)
        ids.update(
            request_id
            for request_id, c in self.state.active.items()
            if c.contention.looks_up and lookup_bucket(request_id) in buckets
        )
        for request_id in sorted(ids):
            self.state.counters["lookups_again"] += 1
            lookup = Lookup(
                request_id=request_id,
                sender=self.config.requestor_id,
                reply_to=self.config.reply_to,
                following=True,
            )
            effects.append(Publish(lookup_topic(request_id), lookup))
