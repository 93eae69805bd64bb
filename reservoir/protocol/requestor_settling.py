"""Settling: how a requestor's conversation ends, and what it lets go of.

A conversation ends **placed** (every instance accepted, the spare offers released) or
**failed** (an explanation; whatever was held, awarded or allocated released or freed:
all or nothing). :class:`Settling` also takes what nodes report as allocated
(``Accepted`` after our award, ``AlreadyPlaced`` for an earlier placement of the id), in a
conversation or after it: an allocation nobody holds is freed, and of two placements of
one id the one asked for later stands.
"""

from __future__ import annotations

from collections.abc import Iterable

from reservoir.protocol.contention import ClaimState
from reservoir.protocol.conversation import Conversation
from reservoir.protocol.effects import CancelTimer, Dropped, Effect, Failed, Placed, Send, Unclaim
from reservoir.protocol.freeing import FreeTarget
from reservoir.protocol.messages import AllocationInfo, Offer, Release
from reservoir.protocol.placement import (
    Explanation,
    PlacedAllocation,
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
    reason_label,
)
from reservoir.protocol.requestor_state import RequestorState

__all__ = ["Settling", "refusal", "shape_mismatch"]


class Settling:
    """Ending conversations, and the allocations nodes report, over the machine's shared
    state."""

    def __init__(self, state: RequestorState) -> None:
        self.state = state
        self.config = state.config

    # -- letting go of offers ----------------------------------------------------------

    def release(self, c: Conversation, offer: Offer) -> Send:
        return Send(
            offer.reply_to,
            Release(
                request_id=c.request_id,
                sender=self.config.requestor_id,
                reservation_id=offer.reservation_id,
            ),
        )

    def release_surplus(self, c: Conversation, effects: list[Effect], keep_spares: bool) -> None:
        """Release held offers, keeping the best ``spare_slots`` worth while awards are
        unanswered (a refusal can then be covered without a new broadcast)."""
        keep: set[str] = set()
        if keep_spares and self.config.spare_slots > 0:
            ranked = self.config.policy.choose(
                [h.candidate() for h in c.pool.values()], self.config.spare_slots
            )
            keep = {candidate.reservation_id for candidate, _ in ranked}
        for reservation_id, held in list(c.pool.items()):
            if reservation_id not in keep:
                del c.pool[reservation_id]
                effects.append(self.release(c, held.offer))

    # -- what nodes report as allocated ------------------------------------------------

    def on_accepted(
        self,
        request_id: str,
        node: str,
        address: str,
        allocations: Iterable[AllocationInfo],
        now: float,
        effects: list[Effect],
        *,
        reservation_id: str | None,
        owner: str | None = None,
        requested_at_s: float | None,
    ) -> None:
        """Allocations a node reports: accepted after our award (``reservation_id``), or
        found already placed (``requested_at_s``: when their placement was asked for;
        None for our own award's)."""
        allocations = tuple(allocations)
        ours = reservation_id is not None or owner == self.config.requestor_id
        c = self.state.active.get(request_id)
        if c is None:
            self._after_the_end(
                request_id, node, address, allocations, now, effects, ours, requested_at_s
            )
            return
        if reservation_id is not None:
            award = c.awards.get(reservation_id)
            if award is not None and award.offer.sender != node:
                effects.append(Dropped("foreign_accept", f"{reservation_id} from {node}"))
                return
            c.awards.pop(reservation_id, None)
        abandoned = reservation_id is not None and reservation_id in c.abandoned
        surplus = []
        for info in allocations:
            if info.allocation_id in c.placed:
                continue
            if abandoned or len(c.placed) >= c.target:
                surplus.append(info.allocation_id)
                continue
            if reservation_id is None:
                # Placed already; if another requestor holds (part of) this placement, it
                # finishes it and we follow until it is whole.
                c.contention.placed_already(info.allocation_id, owner, ours)
            stamp_s = c.requested_at_s if requested_at_s is None else requested_at_s
            c.placed_at_s = max(c.placed_at_s, stamp_s) if c.placed else stamp_s
            c.placed[info.allocation_id] = PlacedAllocation(
                node=node,
                address=address,
                allocation_id=info.allocation_id,
                resources=dict(info.resources),
                numa=info.numa,
            )
        if surplus and not abandoned:  # an abandoned award is being freed already
            target = FreeTarget(address, node, tuple(surplus))
            self.state.frees.free(request_id, [target], now, effects)
        self.maybe_complete(c, now, effects)

    def _after_the_end(
        self,
        request_id: str,
        node: str,
        address: str,
        allocations: tuple[AllocationInfo, ...],
        now: float,
        effects: list[Effect],
        ours: bool,
        requested_at_s: float | None,
    ) -> None:
        """Allocations reported for a request no longer in flight."""
        placement = self.state.finished.get(request_id)
        known = {a.allocation_id for a in placement.allocations} if placement else set()
        stray = tuple(a.allocation_id for a in allocations if a.allocation_id not in known)
        # Another placement of an id we placed (freed since or not), asked for before
        # ours: the id was placed twice (its holder away when we looked it up), and our
        # caller holds ours.
        at_s = self.state.answers.requested_at_s(request_id)
        superseded = later = False
        if requested_at_s is not None and at_s is not None:
            superseded, later = requested_at_s < at_s, requested_at_s > at_s
        # Ours but asked for later than our answer: part of a placement that stands
        # now (another requestor may have adopted it), not ours to free.
        if stray and (superseded or (ours and not later)):
            # Allocations for a request that failed, or that is placed without them,
            # or superseded: free them so nothing stays allocated that nobody holds.
            self.state.frees.free(request_id, [FreeTarget(address, node, stray)], now, effects)
            if not ours:
                self.state.counters["superseded_frees"] += 1
            effects.append(
                Dropped(
                    "late_accept",
                    f"freeing {len(stray)} allocation(s) of {request_id} on {node}",
                )
            )
        elif stray and later and placement is not None:
            # A later placement of an id we answered for: it stands, and its caller
            # holds it. Forget ours, so that a retry here looks the id up and adopts
            # it (the requestor that placed it frees ours, as the branch above).
            self.state.finished.pop(request_id, None)
            self.state.counters["superseded_placements"] += 1
            effects.append(Dropped("superseded", f"{request_id} placed again on {node}"))
        else:
            effects.append(Dropped("duplicate_accept", f"{request_id} on {node}"))

    # -- ending ------------------------------------------------------------------------

    def maybe_complete(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        if c.awards or len(c.placed) < c.target:
            return
        adopted = [a for a in c.placed.values() if a.allocation_id in c.contention.adopted]
        mismatch = shape_mismatch(c.request_id, c.spec, adopted)
        if mismatch:
            # The id was placed before with another shape: that placement is the caller's
            # earlier one, not ours to free, and not the answer to this request.
            for allocation in adopted:
                del c.placed[allocation.allocation_id]
            c.note = mismatch
            self.fail(c, now, effects, timed_out=False)
            return
        self.release_surplus(c, effects, keep_spares=False)
        placement = Placement(
            request_id=c.request_id,
            allocations=tuple(sorted(c.placed.values(), key=lambda a: a.allocation_id)),
            requested=c.spec.count,
            tiers_tried=tuple(c.tiers_tried),
            attempts=c.attempt,
            elapsed_s=now - c.started_at,
            offers_received=c.offers_received,
            requested_at_s=c.placed_at_s,
        )
        self.finish(c, placement, effects)
        effects.append(Placed(c.request_id, placement))

    def fail(self, c: Conversation, now: float, effects: list[Effect], *, timed_out: bool) -> None:
        for held in c.pool.values():
            effects.append(self.release(c, held.offer))
        c.pool.clear()
        # All or nothing: whatever was allocated or awarded goes back.
        targets = {FreeTarget(a.offer.reply_to, a.offer.sender) for a in c.awards.values()}
        targets |= {FreeTarget(a.address, a.node) for a in c.placed.values()}
        if targets:
            self.state.frees.free(
                c.request_id, sorted(targets, key=lambda t: t.address), now, effects
            )
        found = len(c.placed) + c.awarded_slots()
        c.awards.clear()
        c.placed.clear()
        reasons: dict[str, int] = {}
        for decline in c.declines.values():
            for label in {reason_label(r) for r in decline.reasons}:
                reasons[label] = reasons.get(label, 0) + 1
        explanation = Explanation(
            request_id=c.request_id,
            wanted=c.spec.wanted_slots,
            found=found,
            tiers_tried=tuple(c.tiers_tried),
            offers_received=c.offers_received,
            declines_received=len(c.declines),
            busy_nodes=len(c.busy_nodes),
            reasons=reasons,
            note=c.note,
            elapsed_s=now - c.started_at,
        )
        error = PlacementTimeout(explanation) if timed_out else PlacementError(explanation)
        self.finish(c, None, effects)
        effects.append(Failed(c.request_id, error))

    def finish(self, c: Conversation, outcome: Placement | None, effects: list[Effect]) -> None:
        state = self.state
        del state.active[c.request_id]
        if c.contention.claim is ClaimState.HELD:
            # Placed (its allocations bound, so the next claimer's lookup finds them) or
            # failed (what it held is being freed): the id is free to claim.
            state.claims_held -= 1
            effects.append(Unclaim(c.request_id))
        effects.extend(CancelTimer(key) for key in c.armed.values())
        c.armed.clear()
        state.finished[c.request_id] = outcome
        state.finished.move_to_end(c.request_id)
        if c.contention.looks_up and outcome is not None:
            # A failure is no answer to compare with: a placement found later may be one
            # a live requestor handed out, and a failure never superseded it.
            state.answers.answered(c.request_id, outcome.requested_at_s)
        while len(state.finished) > self.config.remember_finished:
            state.finished.popitem(last=False)


def shape_mismatch(
    request_id: str, spec: PlacementRequest, held: Iterable[PlacedAllocation]
) -> str:
    """Why allocations already placed under ``request_id`` cannot be the answer to
    ``spec`` (empty when they can): the id is the idempotency key of one request, and the
    same key with another shape is a caller's mistake to report, not to paper over."""
    held = list(held)
    if not held:
        return ""
    wanted = {rc: amount for rc, amount in spec.resources.items() if amount}
    shapes = {tuple(sorted((rc, n) for rc, n in a.resources.items() if n)) for a in held}
    if shapes != {tuple(sorted(wanted.items()))} or len(held) > spec.count:
        holds = "; ".join(", ".join(f"{rc}={n}" for rc, n in shape) for shape in sorted(shapes))
        asks = ", ".join(f"{rc}={n}" for rc, n in sorted(wanted.items()))
        return (
            f"request id {request_id} is already placed with another shape ({len(held)} "
            f"instance(s) of {holds}; this request asks {spec.count} of {asks}): "
            "use another request id"
        )
    return ""


def refusal(request_id: str, spec: PlacementRequest, note: str) -> Explanation:
    """The explanation of a request refused before any node was asked."""
    return Explanation(
        request_id=request_id,
        wanted=spec.wanted_slots,
        found=0,
        tiers_tried=(),
        offers_received=0,
        note=note,
    )
