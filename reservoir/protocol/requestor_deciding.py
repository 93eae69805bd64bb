"""Deciding: what a requestor makes of the nodes' answers to a request.

**Collect** offers and declines: the first answer to a broadcast opens a short window for
the others, a probe round is decided the moment every probed node has answered. Then
**decide**: enough slots offered, **award** the winners the policy chooses and keep the
best spare; not enough, **widen** to the next sampling round or tier, and past the last
one retry (busy nodes), settle for a partial placement (``min_count``), start over (no
node answered: an outage is no verdict), or fail. Another requestor placing the same id
with precedence makes us **stand back**. The awards' answers come back here too: a
refusal, or an award never answered, leaves a gap to fill.

:class:`Deciding` asks through :class:`~reservoir.protocol.requestor_asking.Asking` and
ends conversations through :class:`~reservoir.protocol.requestor_settling.Settling`.
"""

from __future__ import annotations

from typing import Final

from reservoir.protocol.conversation import Awarded, Conversation, Event, Held, Phase
from reservoir.protocol.effects import Dropped, Effect, Send
from reservoir.protocol.freeing import FreeTarget
from reservoir.protocol.messages import (
    IN_FLIGHT_ELSEWHERE,
    Award,
    Decline,
    Offer,
    Refused,
    Release,
)
from reservoir.protocol.requestor_asking import Asking
from reservoir.protocol.requestor_settling import Settling
from reservoir.protocol.requestor_state import RequestorState
from reservoir.protocol.timers import TimerKind

__all__ = ["Deciding"]

#: another requestor's reservation of an id is taken to live this long past a TTL from
#: when a node last reported it (timers fire late; a node's clock runs its own way)
_CONTENTION_MARGIN_S: Final = 1.0


class Deciding:
    """Collecting answers and deciding on them, over the machine's shared state."""

    def __init__(self, state: RequestorState, asking: Asking, settling: Settling) -> None:
        self.state = state
        self.config = state.config
        self.asking = asking
        self.settling = settling

    # -- collecting --------------------------------------------------------------------

    def on_offer(self, offer: Offer, now: float, effects: list[Effect]) -> None:
        c = self.state.active.get(offer.request_id)
        if c is None:
            # Late: the request is decided or unknown. Let the node go at once rather than
            # make it wait out the reservation.
            effects.append(
                Send(
                    offer.reply_to,
                    Release(
                        request_id=offer.request_id,
                        sender=self.config.requestor_id,
                        reservation_id=offer.reservation_id,
                    ),
                )
            )
            effects.append(Dropped("late_offer", f"{offer.reservation_id} for {offer.request_id}"))
            return
        self.answered(c, offer.attempt, now, effects)
        if offer.reservation_id in c.seen:
            effects.append(Dropped("duplicate_offer", offer.reservation_id))
            self.heard_from(c, offer.sender, offer.attempt, now, effects)
            return
        c.seen.add(offer.reservation_id)
        c.offers_received += 1
        if offer.group_members:
            c.group_hosts[offer.sender] = offer.group_members
        c.pool[offer.reservation_id] = Held(
            offer, usable_until=now + offer.ttl_s - self.config.award_margin_s
        )
        if not c.collecting:
            # Between awards and acceptances, or backing off: use it if there is a gap to
            # fill, else let it go.
            if c.needed() > 0:
                self.decide(c, now, effects)
            else:
                self.settling.release_surplus(c, effects, keep_spares=True)
            return
        self.heard_from(c, offer.sender, offer.attempt, now, effects)

    def answered(self, c: Conversation, attempt: int, now: float, effects: list[Effect]) -> None:
        """The first answer to a broadcast, offer or decline, even a repeat of an offer we
        hold (a node that heard an earlier tier hears this one too), opens the collect
        window: the other nodes of the tier answer within about as long again. A probe
        round needs no window (it is decided when every probed node has answered); its
        first answer is only timed."""
        if attempt != c.attempt or c.collect_timer_set or not c.collecting:
            return
        latency = self.state.latency
        latency_s = now - c.broadcast_at
        latency.add(latency_s)
        c.collect_timer_set = True
        if c.phase is Phase.PROBING:
            return
        window_s = max(latency_s, latency.mean_s or 0.0) * self.config.collect_factor
        window_s = min(max(window_s, self.config.min_collect_s), self.config.max_collect_s)
        c.set_timer(TimerKind.COLLECT, now + window_s, effects)

    def on_decline(self, decline: Decline, now: float, effects: list[Effect]) -> None:
        c = self.state.active.get(decline.request_id)
        if c is None:
            effects.append(Dropped("late_decline", decline.request_id))
            return
        self.answered(c, decline.attempt, now, effects)
        c.declines[decline.sender] = decline
        if decline.busy:
            c.busy_nodes[decline.sender] = decline.reply_to
        if decline.group_members:
            c.group_hosts[decline.sender] = decline.group_members
        for reason in decline.reasons:
            # Another requestor is placing the same id. Exactly one of us must go on: the
            # one whose id sorts first. The other stands back, then asks again and hears
            # "AlreadyPlaced" (or, if the first failed, places it itself).
            if reason.code == IN_FLIGHT_ELSEWHERE:
                # its reservation lives a TTL at most (ours and theirs are alike)
                alive_until = now + c.ttl_s + _CONTENTION_MARGIN_S
                c.contention.in_flight_elsewhere(reason.subject or "", alive_until=alive_until)
        self.heard_from(c, decline.sender, decline.attempt, now, effects)

    def heard_from(
        self, c: Conversation, node: str, attempt: int, now: float, effects: list[Effect]
    ) -> None:
        """A probed node answered (or its probe came back): once all have, decide."""
        if attempt != c.attempt or node not in c.expected:
            return
        c.expected.discard(node)
        if not c.expected and c.collecting:
            c.cancel_timer(TimerKind.COLLECT, effects)
            self.nobody_came(c, now, effects)

    def nobody_came(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """The tier's wait ran out, the broker said nobody is bound to it, or every
        probed node has answered."""
        if not c.collecting:
            return
        if self.usable(c, now, effects):
            self.decide(c, now, effects)
        else:
            self.widen(c, now, effects)

    def usable(self, c: Conversation, now: float, effects: list[Effect]) -> list[Held]:
        """Offers still worth awarding; the ones about to expire are released."""
        usable = []
        for reservation_id, held in list(c.pool.items()):
            if held.usable_until <= now:
                del c.pool[reservation_id]
                effects.append(self.settling.release(c, held.offer))
            else:
                usable.append(held)
        return usable

    # -- deciding ----------------------------------------------------------------------

    def decide(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        if c.phase is Phase.CLAIMING:
            return  # nothing is decided before the lookup under the claim is over
        if c.contention.looking_up():
            c.contention.decision_due = True  # holders of an earlier placement may yet answer
            return
        own = bool(c.awards) or bool(c.placed.keys() - c.contention.adopted)
        needed = c.needed()
        if not own and needed > 0 and c.contention.defers_to_others():
            # Nothing of our own is awarded or placed, and another requestor has
            # precedence or owns part of the placement already: let it finish first.
            self.stand_back(c, now, effects)
            return
        usable = self.usable(c, now, effects)
        if needed <= 0:
            self.settling.release_surplus(c, effects, keep_spares=bool(c.awards))
            self.settling.maybe_complete(c, now, effects)
            return
        candidates, why_not = self.eligible(c, usable)
        if sum(h.offer.slots for h in candidates) >= needed:
            if c.contention.must_look_up(c.attempt):
                self.asking.look_up(c, now, effects)  # then decide again
                return
            self.award(c, candidates, needed, now, effects)
        elif c.collecting:
            if why_not:
                c.note = why_not
            self.widen(c, now, effects)
        elif c.phase is Phase.AWARDING:
            # A refusal (or an award given up) left a gap and nothing held can fill it:
            # ask again.
            c.start_pass()
            self.asking.broadcast(c, now, effects)
        # BACKING_OFF, FOLLOWING: the retry timer or the lookup asks again

    def eligible(self, c: Conversation, usable: list[Held]) -> tuple[list[Held], str]:
        """Hard affinity narrows the offers to the node that hosts the group, if any
        node said it does; with no host yet, to offers that can take every instance."""
        group = c.spec.group
        if group is None or group.policy != "affinity":
            return usable, ""
        if c.group_hosts or c.placed:
            hosts = set(c.group_hosts) | {p.node for p in c.placed.values()}
            eligible = [h for h in usable if h.offer.sender in hosts]
            why = f"affinity group {group.name} lives on {', '.join(sorted(hosts))}"
            return eligible, "" if eligible else why + ", which cannot take more"
        needed = c.needed()
        return [h for h in usable if h.offer.slots >= needed], ""

    # -- awarding ----------------------------------------------------------------------

    def award(
        self,
        c: Conversation,
        candidates: list[Held],
        needed: int,
        now: float,
        effects: list[Effect],
    ) -> None:
        by_id = {h.offer.reservation_id: h for h in candidates}
        choice = self.config.policy.choose([h.candidate() for h in candidates], needed)
        if c.spec.group is not None and c.spec.group.policy == "affinity" and len(choice) > 1:
            # All of an affinity request's instances go to one node.
            best = next(h for h in candidates if h.offer.slots >= needed)
            choice = [(best.candidate(), needed)]
        for candidate, slots in choice:
            held = by_id[candidate.reservation_id]
            del c.pool[candidate.reservation_id]
            c.awards[candidate.reservation_id] = Awarded(held.offer, slots, now, now)
            effects.append(self.award_message(c, held.offer, slots))
        c.enter(Event.AWARD)
        c.cancel_timer(TimerKind.COLLECT, effects)
        c.cancel_timer(TimerKind.WIDEN, effects)
        c.set_timer(TimerKind.AWARD, now + self.config.award_retry_s, effects)
        self.settling.release_surplus(c, effects, keep_spares=True)

    def award_message(self, c: Conversation, offer: Offer, slots: int) -> Send:
        return Send(
            offer.reply_to,
            Award(
                request_id=c.request_id,
                sender=self.config.requestor_id,
                reply_to=self.config.reply_to,
                reservation_id=offer.reservation_id,
                slots=slots,
                traceparent=c.traceparent,
                requested_at_s=c.requested_at_s,
                # the placement's size, so that whoever finds the id knows when every
                # holder has answered (it only shrinks: min_count lowers it at the end)
                instances=c.target,
            ),
        )

    def on_refused(self, refused: Refused, now: float, effects: list[Effect]) -> None:
        c = self.state.active.get(refused.request_id)
        if c is None:
            effects.append(Dropped("late_refusal", refused.reservation_id))
            return
        if c.pool.pop(refused.reservation_id, None) is not None:
            return  # a withdrawn offer (the node is stopping): simply not a candidate
        award = c.awards.get(refused.reservation_id)
        if award is None or award.offer.sender != refused.sender:
            effects.append(Dropped("late_refusal", refused.reservation_id))
            return
        del c.awards[refused.reservation_id]
        c.note = f"{refused.sender} refused: {refused.reason}"
        self.decide(c, now, effects)

    def chase_awards(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Re-send unanswered awards; give up on one once its reservation must be gone."""
        give_up_after_s = c.ttl_s + self.config.award_retry_s
        gap = False
        for reservation_id, award in list(c.awards.items()):
            if now - award.first_sent_at >= give_up_after_s:
                del c.awards[reservation_id]
                c.abandoned.add(reservation_id)
                gap = True
                # The node may yet have allocated: freeing that reservation's allocations
                # (until the node confirms) makes sure nothing of it stays behind there.
                target = FreeTarget(
                    award.offer.reply_to, award.offer.sender, reservation_id=reservation_id
                )
                self.state.frees.free(c.request_id, [target], now, effects)
                c.note = f"{award.offer.sender} never answered its award"
            elif now - award.last_sent_at >= self.config.award_retry_s:
                award.last_sent_at = now
                effects.append(self.award_message(c, award.offer, award.slots))
        if c.awards:
            c.set_timer(TimerKind.AWARD, now + self.config.award_retry_s, effects)
        if gap:
            self.decide(c, now, effects)

    # -- standing back, backing off, widening ------------------------------------------

    def stand_back(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Another requestor with precedence is placing this id: let go of what we hold
        and ask again after a pause."""
        c.note = c.contention.stand_back()
        for held in c.pool.values():
            effects.append(self.settling.release(c, held.offer))
        c.pool.clear()
        self.back_off(c, now, effects)

    def back_off(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        c.enter(Event.BACK_OFF)
        backoff_s = min(self.config.busy_retry_s * 2**c.busy_rounds, self.config.max_busy_retry_s)
        c.busy_rounds += 1
        c.cancel_timer(TimerKind.COLLECT, effects)
        c.cancel_timer(TimerKind.WIDEN, effects)
        c.set_timer(TimerKind.RETRY, now + backoff_s, effects)

    def widen(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        config = self.config
        if c.sampling:
            self.asking.broadcast(c, now, effects)  # the next sampling round, or every node
            return
        if c.tier_index + 1 < len(config.tiers):
            c.tier_index += 1
            self.asking.broadcast(c, now, effects)
            return
        if c.contention.yield_to and now < c.deadline:
            self.stand_back(c, now, effects)
            return
        have = len(c.placed) + c.awarded_slots()
        held = sum(h.offer.slots for h in self.eligible(c, self.usable(c, now, effects))[0])
        if c.busy_nodes and now + config.busy_retry_s < c.deadline:
            # Every tier is tried, but some nodes only lacked room that other requests'
            # reservations hold: those free up within a TTL, so ask again shortly.
            self.back_off(c, now, effects)
            return
        minimum = c.spec.min_count
        if minimum is not None and have + held >= minimum:
            c.target = have + held
            if held:
                self.decide(c, now, effects)
            else:
                self.settling.maybe_complete(c, now, effects)
            return
        # Fail only once holders of an earlier placement could have said "placed".
        if c.contention.looking_up():
            c.contention.decision_due = True
            return
        if c.contention.must_look_up(c.attempt):
            self.asking.look_up(c, now, effects)
            return
        if c.contention.contended(now) and now + config.max_busy_retry_s < c.deadline:
            # Another requestor's reservation of this id may still become its placement
            # (which we then adopt) or expire (and leave the room to us): no verdict yet.
            # Its requestor may also be dead (killed mid-conversation): then only the TTL
            # settles it. Found by the chaos runs.
            c.note = c.note or "the same request id is being placed by another requestor"
            self.back_off(c, now, effects)
            return
        if not c.heard_in_pass() and now + self.unheard_backoff_s(c) < c.deadline:
            # Not one node answered this pass, not even to decline: this is no verdict on
            # the request, the path to the nodes is down (our connection or theirs lost,
            # the broker restarting, nodes restarting). Failing now would fail a request
            # that fits because of a moment's outage, and would leave behind whatever
            # became of an allocation we did not hear of (a dead predecessor's late
            # award, adopted once the nodes are heard again): start over shortly, until
            # the deadline. Answers to earlier passes do not count: they are no verdict
            # on this one.
            self.start_over(c, now, effects)
            return
        roster = self.state.roster
        grown = [] if c.rooms_rechecked else roster.roomier_since(c.declines, c.spec.resources)
        if c.needs:
            grown = [m for m in grown if c.needs <= m.features]
        if grown:
            # A node that declined has told of more room since (an instance it held
            # ended while the tiers were asked): ask it alone before failing, or the
            # verdict "no valid host" would be out of date when it is given. Once per
            # conversation, so a node that keeps changing cannot hold the verdict off.
            c.rooms_rechecked = True
            self.state.counters["room_rechecks"] += 1
            self.asking.probe_nodes(c, [(m.name, m.address) for m in grown], now, effects)
            return
        self.settling.fail(c, now, effects, timed_out=False)

    def unheard_backoff_s(self, c: Conversation) -> float:
        config = self.config
        return min(config.unheard_retry_s * 2.0**c.unheard_rounds, config.max_unheard_retry_s)

    def start_over(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask from the first tier again after a pause (sampling from the roster again)."""
        config = self.config
        backoff_s = self.unheard_backoff_s(c)
        c.unheard_rounds += 1
        self.state.counters["unheard_retries"] += 1
        c.note = f"no node answered in {c.unheard_rounds} round(s) over every tier"
        affinity = c.spec.group is not None and c.spec.group.policy in ("affinity", "soft-affinity")
        c.tier_index = len(config.tiers) - 1 if affinity else 0
        c.sampling = not affinity and config.probe_rounds > 0
        c.probe_round = 0
        c.probed.clear()
        c.enter(Event.BACK_OFF)
        c.cancel_timer(TimerKind.COLLECT, effects)
        c.cancel_timer(TimerKind.WIDEN, effects)
        c.set_timer(TimerKind.RETRY, now + backoff_s, effects)
